//! Lossy-coded matrices (`kernels/lossy.cu`, codec `lossy`): `lossy_decode` writes a matrix's
//! weights (BF16, F16 or F32: the prefill path's dequantisation; or FP8 E4M3 / INT8 codes under
//! per-row scales, [`launch_decode_low`]), `lossy_mv` multiplies one vector by it as the tiles
//! decode (the batch-1 product), one warp a tile. Their selftest against the
//! codec's CPU decoder and product is `lossy_selftest`; the host side of the decode (the flat
//! tables and the kernel's lane-order renormalisation) is checked on the CPU by this module's
//! tests, which run the kernel's algorithm in Rust over the uploaded arrays.
//!
//! Tolerances: decode is bit-exact (F32: the codec's values; BF16/F16: their round-to-nearest-even;
//! FP8/INT8: the codes of the codec's `decode_low`); the product is f32 sums in another order than
//! the CPU's.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_codec::lossy::low::{LowPrecision, LowRows};
use entrollm_codec::lossy::{FlatTables, LossyTensor, Quantizer};
use entrollm_format::coded::LossyCoded;
use entrollm_format::Dtype;

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};
use crate::mem::upload;

pub static LOSSY: KernelSource = KernelSource {
    name: "lossy.cu",
    source: include_str!("../../kernels/lossy.cu"),
};

/// Tiles (warps) a block.
pub const WARPS: u32 = 4;
/// The kernel's table and trellis limits.
const MAX_TABLES: usize = 17;
const MAX_NEXT: usize = 512;

/// The precision a decode writes, or a product rounds its weights to (the container's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossyOut {
    Bf16,
    F16,
    F32,
}

impl LossyOut {
    pub const ALL: [LossyOut; 3] = [LossyOut::Bf16, LossyOut::F16, LossyOut::F32];

    fn code(self) -> i64 {
        match self {
            LossyOut::Bf16 => 0,
            LossyOut::F16 => 1,
            LossyOut::F32 => 2,
        }
    }

    /// Bytes of one decoded weight.
    pub fn bytes(self) -> usize {
        match self {
            LossyOut::F32 => 4,
            _ => 2,
        }
    }

    /// The precision a container of `dtype` serves (None: not one a lossy matrix decodes to).
    pub fn of(dtype: Dtype) -> Option<LossyOut> {
        Self::ALL.into_iter().find(|o| o.dtype() == dtype)
    }

    fn dtype(self) -> Dtype {
        match self {
            LossyOut::Bf16 => Dtype::BF16,
            LossyOut::F16 => Dtype::F16,
            LossyOut::F32 => Dtype::F32,
        }
    }

    /// `v` at this precision as the container's reconstruction rounds it
    /// ([`LossyCoded::served_as`]), which is how the kernels round it.
    pub fn round(self, v: f32) -> f32 {
        LossyCoded::served_as(self.dtype(), v)
    }

    /// `v`'s stored bits at this precision (F32: its own bits).
    pub fn bits(self, v: f32) -> u32 {
        let r = self.round(v);
        match self {
            LossyOut::Bf16 => half::bf16::from_f32(r).to_bits() as u32,
            LossyOut::F16 => half::f16::from_f32(r).to_bits() as u32,
            LossyOut::F32 => r.to_bits(),
        }
    }
}

/// Which kernel decodes `q` (a match, not `row_multiple`, which builds the quantiser: launches ask).
pub(crate) fn is_e8(q: Quantizer) -> bool {
    matches!(q, Quantizer::E8)
}

/// The kernel's `LOSSY_OUT` for a low-precision decode (after [`LossyOut`]'s 0, 1, 2).
fn low_code(kind: LowPrecision) -> i64 {
    match kind {
        LowPrecision::Fp8E4m3 => 3,
        LowPrecision::Int8 => 4,
    }
}

fn module(quantizer: Quantizer, out_code: i64) -> KernelVariant {
    KernelVariant::new(
        &LOSSY,
        vec![
            ("LOSSY_E8", is_e8(quantizer) as i64),
            ("LOSSY_OUT", out_code),
            ("LOSSY_WARPS", WARPS as i64),
        ],
    )
}

/// The compiled module for `quantizer`'s kernels writing or rounding to `out`.
pub fn variant(quantizer: Quantizer, out: LossyOut) -> KernelVariant {
    module(quantizer, out.code())
}

/// The compiled module for `quantizer`'s decode to `kind` codes (it holds no `lossy_mv`).
pub fn low_variant(quantizer: Quantizer, kind: LowPrecision) -> KernelVariant {
    module(quantizer, low_code(kind))
}

/// Every variant the selftest and the benches launch (one module serves every TCQ trellis).
pub fn all_variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for q in [Quantizer::E8, Quantizer::Tcq { log2_states: 5 }] {
        for out in LossyOut::ALL {
            v.push(variant(q, out));
        }
        for kind in LowPrecision::ALL {
            v.push(low_variant(q, kind));
        }
    }
    v
}

/// What the kernel reads of one tensor's tables, on the host: one 8-byte entry a slot (symbol |
/// (frequency − 1) << 16 | bias << 32: one load a symbol), the tables' minima, the trellis.
#[derive(Clone, Debug, PartialEq)]
pub struct LossyArrays {
    pub ent: Vec<u64>,
    pub mins: [i32; MAX_TABLES],
    pub next: Vec<u16>,
}

impl LossyArrays {
    /// `t`'s tables as the kernel takes them; an error if a table or trellis exceeds its limits.
    pub fn of(t: &LossyTensor) -> Result<LossyArrays> {
        let dec = t
            .decoder()
            .map_err(|e| GpuError::invalid("lossy upload", format!("tables: {e}")))?;
        let FlatTables {
            mins: flat_mins,
            slot,
            bias,
            next,
            ..
        } = dec.flat();
        if flat_mins.len() > MAX_TABLES || next.len() > MAX_NEXT {
            return Err(GpuError::invalid(
                "lossy upload",
                format!(
                    "{} tables and a {}-entry trellis (the kernel takes {MAX_TABLES} and {MAX_NEXT})",
                    flat_mins.len(),
                    next.len()
                ),
            ));
        }
        let mut mins = [0i32; MAX_TABLES];
        mins[..flat_mins.len()].copy_from_slice(&flat_mins);
        let ent = slot
            .iter()
            .zip(&bias)
            .map(|(&e, &b)| e as u64 | (b as u64) << 32)
            .collect();
        Ok(LossyArrays { ent, mins, next })
    }
}

/// A lossy-coded matrix on the device.
pub struct GpuLossy {
    pub rows: usize,
    pub cols: usize,
    pub quantizer: Quantizer,
    tile_rows: usize,
    tiles: usize,
    prob_bits: u8,
    mins: [i32; MAX_TABLES],
    ent: CudaSlice<u64>,
    scales: CudaSlice<f32>,
    states: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    payload: CudaSlice<u16>,
    next: CudaSlice<u16>,
    n_next: usize,
    /// Bytes of the stored tensor (what a batch-1 product reads).
    pub stored_bytes: usize,
}

impl GpuLossy {
    /// `t` on the device (its tables built and checked here; `t` itself was checked when read).
    pub fn upload(dev: &GpuDevice, t: &LossyTensor) -> Result<GpuLossy> {
        let a = LossyArrays::of(t)?;
        let tiles = t.tiles();
        if t.states.len() != 32 * tiles
            || t.offsets.len() != tiles + 1
            || t.scales.len() != t.rows
            || t.offsets.last().map(|&o| o as usize) != Some(t.payload.len())
            || t.rows * t.cols > i32::MAX as usize
        {
            return Err(GpuError::invalid(
                "lossy upload",
                format!(
                    "a {} × {} tensor's arrays do not match its shape",
                    t.rows, t.cols
                ),
            ));
        }
        // Empty arrays still get a device buffer (a null pointer is never passed).
        let nonempty_u16 = |v: &[u16]| if v.is_empty() { vec![0u16] } else { v.to_vec() };
        Ok(GpuLossy {
            rows: t.rows,
            cols: t.cols,
            quantizer: t.quantizer,
            tile_rows: t.tile_rows,
            tiles,
            prob_bits: t.prob_bits,
            mins: a.mins,
            ent: upload(dev, &a.ent)?,
            scales: upload(dev, &t.scales)?,
            states: upload(dev, &t.states)?,
            offsets: upload(dev, &t.offsets)?,
            payload: upload(dev, &nonempty_u16(&t.payload))?,
            next: upload(dev, &nonempty_u16(&a.next))?,
            n_next: a.next.len(),
            stored_bytes: t.stored_bytes(),
        })
    }

    /// A copy of the arrays in new device memory (device-to-device).
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLossy> {
        let s = dev.stream();
        let what = || format!("copying a lossy {}×{} matrix", self.rows, self.cols);
        Ok(GpuLossy {
            ent: s.clone_dtod(&self.ent).while_(what)?,
            scales: s.clone_dtod(&self.scales).while_(what)?,
            states: s.clone_dtod(&self.states).while_(what)?,
            offsets: s.clone_dtod(&self.offsets).while_(what)?,
            payload: s.clone_dtod(&self.payload).while_(what)?,
            next: s.clone_dtod(&self.next).while_(what)?,
            ..*self
        })
    }

    /// Bytes a batch-1 product reads.
    pub fn stored_bytes(&self) -> usize {
        self.stored_bytes
    }

    /// Device bytes held.
    pub fn device_bytes(&self) -> usize {
        8 * self.ent.len()
            + 4 * (self.scales.len() + self.states.len() + self.offsets.len())
            + 2 * (self.payload.len() + self.next.len())
    }
}

/// A low-precision decode's rows on the device: each row's multiplier of its points, which
/// `lossy_decode` (LOSSY_OUT 3, 4) reads in place of the row scales, and on the host the scales
/// the codes are served under. From the codec's [`LossyTensor::low_rows`] (or `decode_low`) of the
/// tensor it decodes.
pub struct GpuLowRows {
    pub kind: LowPrecision,
    mul: CudaSlice<f32>,
    /// Per row: a weight is `kind.value(code) · scale`.
    pub scales: Vec<f32>,
    /// Rows whose codes are lossy beyond the coder ([`LowRows::inexact_rows`]).
    pub inexact_rows: usize,
}

impl GpuLowRows {
    /// `rows` on the device.
    pub fn upload(dev: &GpuDevice, rows: &LowRows) -> Result<GpuLowRows> {
        if rows.mul.is_empty() || rows.mul.len() != rows.scales.len() {
            return Err(GpuError::invalid(
                "lossy low upload",
                format!(
                    "{} multipliers and {} scales",
                    rows.mul.len(),
                    rows.scales.len()
                ),
            ));
        }
        Ok(GpuLowRows {
            kind: rows.kind,
            mul: upload(dev, &rows.mul)?,
            scales: rows.scales.clone(),
            inexact_rows: rows.inexact_rows,
        })
    }

    /// Rows of `t`'s low-precision decode to `kind`, computed by the codec (a CPU decode of `t`)
    /// and uploaded.
    pub fn of(dev: &GpuDevice, t: &LossyTensor, kind: LowPrecision) -> Result<GpuLowRows> {
        let rows = t
            .low_rows(kind)
            .map_err(|e| GpuError::invalid("lossy low upload", e.to_string()))?;
        Self::upload(dev, &rows)
    }

    pub fn rows(&self) -> usize {
        self.scales.len()
    }
}

/// Most matrices in one launch (the kernel's `LOSSY_MAX_PARTS`).
pub const MAX_PARTS: usize = 3;

/// The kernel's `LossyPart`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct LossyPart {
    ent: u64,
    scales: u64,
    states: u64,
    offsets: u64,
    payload: u64,
    next: u64,
    out: u64,
    rows: i32,
    tile_rows: i32,
    tiles: i32,
    prob_bits: i32,
    n_next: i32,
    block0: i32,
    mins: [i32; MAX_TABLES],
}

/// The kernel's `LossyParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct LossyParams {
    part: [LossyPart; MAX_PARTS],
    x: u64,
    err: u64,
    cols: i32,
    n_parts: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for LossyParams {}

/// One launch over `parts` (same quantiser kind and columns) of the `LOSSY_OUT` `out_code`, part i
/// writing at device address `outs[i]`; `muls`, if given, part i's row multipliers in place of its
/// scales (the low-precision decodes).
#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &GpuDevice,
    op: &'static str,
    parts: &[&GpuLossy],
    out_code: i64,
    x: u64,
    outs: &[u64],
    muls: Option<&[u64]>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    let first = parts
        .first()
        .ok_or_else(|| GpuError::invalid(op, "no matrices to launch"))?;
    if parts.len() > MAX_PARTS
        || outs.len() != parts.len()
        || muls.is_some_and(|m| m.len() != parts.len())
        || parts
            .iter()
            .any(|m| m.cols != first.cols || is_e8(m.quantizer) != is_e8(first.quantizer))
    {
        return Err(GpuError::invalid(
            op,
            format!(
                "{} parts in one launch (at most {MAX_PARTS}, one quantiser kind, equal columns)",
                parts.len()
            ),
        ));
    }
    let stream = dev.stream();
    let mut p = LossyParams {
        x,
        cols: first.cols as i32,
        n_parts: parts.len() as i32,
        ..Default::default()
    };
    let mut guards = Vec::new();
    let mut blocks = 0usize;
    for (i, m) in parts.iter().enumerate() {
        let (ent, g1) = m.ent.device_ptr(stream);
        let (scales, g2) = m.scales.device_ptr(stream);
        let (states, g3) = m.states.device_ptr(stream);
        let (offsets, g4) = m.offsets.device_ptr(stream);
        let (payload, g5) = m.payload.device_ptr(stream);
        let (next, g6) = m.next.device_ptr(stream);
        guards.extend([g1, g2, g3, g4, g5, g6]);
        p.part[i] = LossyPart {
            ent,
            scales: muls.map_or(scales, |m| m[i]),
            states,
            offsets,
            payload,
            next,
            out: outs[i],
            rows: m.rows as i32,
            tile_rows: m.tile_rows as i32,
            tiles: m.tiles as i32,
            prob_bits: m.prob_bits as i32,
            n_next: m.n_next as i32,
            block0: blocks as i32,
            mins: m.mins,
        };
        blocks += m.tiles.div_ceil(WARPS as usize);
    }
    let (err, _ge) = match err {
        Some(e) if !e.is_empty() => {
            let (p, g) = e.device_ptr_mut(stream);
            (p, Some(g))
        }
        Some(_) => return Err(GpuError::invalid(op, "error word buffer is empty")),
        None => (0, None),
    };
    p.err = err;
    let f = dev.function(&module(first.quantizer, out_code), op)?;
    let lc = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&p);
    // SAFETY: `p` matches the kernel's parameter struct; every pointer is a live device buffer of
    // the sizes the tensors' shapes give (checked at upload and by the callers).
    unsafe { b.launch(lc) }.while_(|| {
        format!(
            "launching {op} on {} {} matrices of {} columns",
            parts.len(),
            first.quantizer,
            first.cols
        )
    })?;
    drop(guards);
    Ok(())
}

/// `out[at..at + rows·cols]` = the matrix's weights at `out_kind`'s precision (`T` must be its
/// size: u16 for BF16/F16, f32 for F32). `err`, if given, gets 1 OR-ed in when a tile is damaged.
pub fn launch_decode<T: DeviceRepr>(
    dev: &GpuDevice,
    m: &GpuLossy,
    out_kind: LossyOut,
    out: &mut CudaSlice<T>,
    at: usize,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "lossy_decode";
    if std::mem::size_of::<T>() != out_kind.bytes() || out.len() < at + m.rows * m.cols {
        return Err(GpuError::invalid(
            OP,
            format!(
                "an output of {} elements of {} bytes for {} × {} weights of {} bytes",
                out.len(),
                std::mem::size_of::<T>(),
                m.rows,
                m.cols,
                out_kind.bytes()
            ),
        ));
    }
    let (o, _g) = out.device_ptr_mut(dev.stream());
    let o = o + (at * out_kind.bytes()) as u64;
    launch(dev, OP, &[m], out_kind.code(), 0, &[o], None, err)
}

/// `out[at..at + rows·cols]` = the matrix's `low.kind` codes (FP8 E4M3, or INT8 as i8 bit
/// patterns), row-major, one byte a weight: the codec's `decode_low` codes, served under
/// `low.scales`. `low` must be of this matrix ([`GpuLowRows::of`]). `err` as for
/// [`launch_decode`].
pub fn launch_decode_low(
    dev: &GpuDevice,
    m: &GpuLossy,
    low: &GpuLowRows,
    out: &mut CudaSlice<u8>,
    at: usize,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "lossy_decode";
    if low.rows() != m.rows || low.mul.len() != m.rows || out.len() < at + m.rows * m.cols {
        return Err(GpuError::invalid(
            OP,
            format!(
                "{} codes from {at} and {} row multipliers for {} × {} weights",
                out.len(),
                low.rows(),
                m.rows,
                m.cols
            ),
        ));
    }
    let stream = dev.stream();
    let (mul, _gm) = low.mul.device_ptr(stream);
    let (o, _g) = out.device_ptr_mut(stream);
    let code = low_code(low.kind);
    launch(dev, OP, &[m], code, 0, &[o + at as u64], Some(&[mul]), err)
}

/// `y = [W_0; W_1; …]·x` for up to [`MAX_PARTS`] row-stacked matrices of the same columns and
/// quantiser kind in one launch (part i's rows after part i−1's), the weights rounded to `round`'s
/// precision (the container's dtype).
pub fn launch_mv(
    dev: &GpuDevice,
    parts: &[&GpuLossy],
    round: LossyOut,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "lossy_mv";
    let rows: usize = parts.iter().map(|m| m.rows).sum();
    super::check_len(OP, "x", x, parts.first().map_or(0, |m| m.cols))?;
    super::check_len(OP, "y", y, rows)?;
    let stream = dev.stream();
    let (xp, _gx) = x.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let mut outs = Vec::with_capacity(parts.len());
    let mut row0 = 0u64;
    for m in parts {
        outs.push(yp + 4 * row0);
        row0 += m.rows as u64;
    }
    launch(dev, OP, parts, round.code(), xp, &outs, None, err)
}

/// The kernel's decode of one tile, in Rust over the arrays it is given: lane `l` holds state `l`;
/// after each symbol step the lanes below 2^16 take words in lane order (the ballot's prefix
/// count); a read past the tile, a coset out of range, or a tile not ending at its offsets with
/// every state at 2^16 is an error. Returns the tile's point · `scales[row]`: the weights under the
/// tensor's scales, or what a low-precision decode codes under its row multipliers.
#[cfg(test)]
fn emulate_tile(
    t: &LossyTensor,
    a: &LossyArrays,
    scales: &[f32],
    tile: usize,
) -> std::result::Result<Vec<f32>, ()> {
    let (r0, cols, pb) = (tile * t.tile_rows, t.cols, t.prob_bits as u32);
    let nr = t.tile_rows.min(t.rows - r0);
    let n = nr * cols;
    let mut x: [u32; 32] = t.states[32 * tile..32 * tile + 32].try_into().unwrap();
    let (mut pos, end) = (t.offsets[tile] as usize, t.offsets[tile + 1] as usize);
    let mut bad = false;
    let mask = (1u32 << pb) - 1;
    let sym = |x: &mut u32, table: usize| -> i32 {
        let s = (table << pb) + (*x & mask) as usize;
        let (e, b) = (a.ent[s] as u32, (a.ent[s] >> 32) as u32);
        *x = ((e >> 16) + 1) * (*x >> pb) + b;
        a.mins[table] + (e & 0xffff) as i32
    };
    let renorm = |x: &mut [u32; 32], live: &[bool; 32], pos: &mut usize, bad: &mut bool| {
        for l in 0..32 {
            if live[l] && x[l] < 1 << 16 {
                if *pos < end {
                    x[l] = (x[l] << 16) | t.payload[*pos] as u32;
                } else {
                    *bad = true;
                }
                *pos += 1;
            }
        }
    };
    let mut out = vec![0f32; n];
    if is_e8(t.quantizer) {
        for g in (0..n / 8).step_by(32) {
            let live: [bool; 32] = std::array::from_fn(|l| g + l < n / 8);
            let mut f = [[0i32; 9]; 32];
            for l in 0..32 {
                if live[l] {
                    f[l][0] = sym(&mut x[l], 0);
                }
            }
            renorm(&mut x, &live, &mut pos, &mut bad);
            for l in 0..32 {
                if live[l] && !(0..=1).contains(&f[l][0]) {
                    bad = true;
                    f[l][0] = 0;
                }
            }
            for j in 1..9 {
                for l in 0..32 {
                    if live[l] {
                        f[l][j] = sym(&mut x[l], 2 * j - 1 + f[l][0] as usize);
                    }
                }
                renorm(&mut x, &live, &mut pos, &mut bad);
            }
            for l in (0..32).filter(|&l| live[l]) {
                let v = g + l;
                let s = scales[r0 + 8 * v / cols];
                let (c, mut par) = (f[l][0], 0);
                for i in 0..7 {
                    par += f[l][1 + i];
                    out[8 * v + i] = (f[l][1 + i] as f32 + 0.5 * c as f32) * s;
                }
                out[8 * v + 7] = ((2 * f[l][8] + (par & 1)) as f32 + 0.5 * c as f32) * s;
            }
        }
    } else {
        let mut st = [0u32; 32];
        for g in (0..n).step_by(32) {
            let live: [bool; 32] = std::array::from_fn(|l| g + l < n);
            for l in (0..32).filter(|&l| live[l]) {
                let z0 = st[l] & 1;
                let k = sym(&mut x[l], z0 as usize);
                let nx = (2 * st[l] + (k & 1) as u32) as usize;
                st[l] = a.next.get(nx).map_or(0, |&s| s as u32);
                out[g + l] = (2 * k + z0 as i32) as f32 * scales[r0 + (g + l) / cols];
            }
            renorm(&mut x, &live, &mut pos, &mut bad);
        }
    }
    if bad || pos != end || x.iter().any(|&s| s != 1 << 16) {
        return Err(());
    }
    Ok(out)
}

/// The kernel's `lossy_store` for LOSSY_OUT 3 and 4: E4M3 by `cvt.rn.satfinite` (to nearest, ties
/// to even, saturating at ±448; the codec's FP8 rounding is specified as the same); INT8 as
/// `fminf(fmaxf(rintf(w), -127), 127)`.
#[cfg(test)]
#[allow(clippy::manual_clamp)] // max/min as fmaxf/fminf: a NaN gives −127, as on the device
fn emulate_low_store(kind: LowPrecision, w: f32) -> u8 {
    match kind {
        LowPrecision::Fp8E4m3 => entrollm_codec::payload::f32_to_fp8_e4m3(w),
        LowPrecision::Int8 => w.round_ties_even().max(-127.0).min(127.0) as i32 as i8 as u8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use entrollm_codec::lossy::Options;

    /// Uniform on ±0.035 (σ ≈ 0.02), splitmix-driven.
    fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut r = entrollm_codec::rng::SplitMix64::new(seed);
        let mut w: Vec<f32> = (0..rows * cols)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 0.07 - 0.035)
            .collect();
        // A few outlier rows, as real weights have.
        for v in w.iter_mut().step_by(7 * cols.max(1) + 3) {
            *v *= 9.0;
        }
        w
    }

    #[test]
    fn params_layout_matches_the_kernel() {
        // A part: 7 pointers, 6 ints, 17 table minima, padded to 8 bytes; then 2 pointers, 2 ints.
        assert_eq!(std::mem::size_of::<LossyPart>(), 152);
        assert_eq!(std::mem::size_of::<LossyParams>(), 3 * 152 + 16 + 8);
    }

    /// The kernel's algorithm over the uploaded arrays gives the codec's weights bit for bit, on
    /// ragged shapes (rows not filling the last tile, rows shorter than a step, steps spanning rows)
    /// at several rates, for E8 and TCQ trellises of 4, 32 and 256 states.
    #[test]
    fn the_kernels_decode_is_the_codecs_on_ragged_shapes() {
        let quantizers = [
            Quantizer::E8,
            Quantizer::Tcq { log2_states: 2 },
            Quantizer::Tcq { log2_states: 5 },
            Quantizer::Tcq { log2_states: 8 },
        ];
        let mut case = 0u64;
        for q in quantizers {
            let m = q.row_multiple();
            for (rows, cols) in [(1, m), (3, 5 * m), (9, 72), (37, 264), (5, 4104), (70, 520)] {
                if cols % m != 0 {
                    continue;
                }
                for bits in [2.0, 3.3, 6.0] {
                    case += 1;
                    let w = matrix(rows, cols, case);
                    let (t, _) =
                        LossyTensor::encode(&w, rows, cols, &Options::new(bits, q)).unwrap();
                    let a = LossyArrays::of(&t).unwrap();
                    let want = t.decode().unwrap();
                    let got: Vec<f32> = (0..t.tiles())
                        .flat_map(|i| emulate_tile(&t, &a, &t.scales, i).unwrap())
                        .collect();
                    assert_eq!(got.len(), want.len());
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{q} {rows}×{cols} at {bits} bits");
                }
            }
        }
    }

    /// The kernel's low-precision decode over the uploaded arrays (the row multipliers in place of
    /// the scales, then the store's rounding) gives the codec's `decode_low` codes bit for bit, on
    /// the ragged shapes above, at rates where INT8 rows stay on the grid and where they do not.
    #[test]
    fn the_kernels_low_precision_decode_is_the_codecs_on_ragged_shapes() {
        let quantizers = [
            Quantizer::E8,
            Quantizer::Tcq { log2_states: 2 },
            Quantizer::Tcq { log2_states: 5 },
        ];
        let (mut case, mut inexact) = (0u64, [0usize; 2]);
        for q in quantizers {
            let m = q.row_multiple();
            for (rows, cols) in [(1, m), (3, 5 * m), (9, 72), (37, 264), (5, 4104), (70, 520)] {
                if cols % m != 0 {
                    continue;
                }
                for bits in [2.0, 4.0, 6.0, 8.0] {
                    case += 1;
                    let w = matrix(rows, cols, case);
                    let (t, _) =
                        LossyTensor::encode(&w, rows, cols, &Options::new(bits, q)).unwrap();
                    let a = LossyArrays::of(&t).unwrap();
                    for (k, kind) in LowPrecision::ALL.into_iter().enumerate() {
                        let want = t.decode_low(kind).unwrap();
                        let low = t.low_rows(kind).unwrap();
                        assert_eq!(low, want.rows);
                        inexact[k] += low.inexact_rows;
                        let got: Vec<u8> = (0..t.tiles())
                            .flat_map(|i| emulate_tile(&t, &a, &low.mul, i).unwrap())
                            .map(|v| emulate_low_store(kind, v))
                            .collect();
                        assert!(got == want.codes, "{kind} {q} {rows}×{cols} at {bits} bits");
                    }
                }
            }
        }
        // Both INT8 unit rules and inexact FP8 rows were among the cases.
        assert!(inexact.iter().all(|&n| n > 0), "{inexact:?}");
    }

    /// A damaged payload word or state fails the kernel's end-of-tile check wherever it fails the
    /// codec's decode.
    #[test]
    fn damage_the_codec_rejects_the_kernel_rejects() {
        for q in [Quantizer::E8, Quantizer::Tcq { log2_states: 5 }] {
            let w = matrix(40, 256, 9);
            let (t, _) = LossyTensor::encode(&w, 40, 256, &Options::new(3.0, q)).unwrap();
            let a = LossyArrays::of(&t).unwrap();
            let mut rejected = 0;
            for i in 0..40 {
                let mut d = t.clone();
                if i % 2 == 0 {
                    let k = (i * 7919) % d.payload.len();
                    d.payload[k] ^= 1 << (i % 16);
                } else {
                    let k = (i * 13) % d.states.len();
                    d.states[k] ^= 1 << (i % 17);
                }
                let cpu = d.decode();
                let kernel: std::result::Result<Vec<Vec<f32>>, ()> = (0..d.tiles())
                    .map(|k| emulate_tile(&d, &a, &d.scales, k))
                    .collect();
                assert_eq!(cpu.is_err(), kernel.is_err(), "{q} damage {i}");
                rejected += kernel.is_err() as usize;
            }
            assert!(rejected >= 30, "{q}: only {rejected} of 40 damages caught");
        }
    }

    #[test]
    fn rounding_matches_the_half_crate() {
        for v in [0.1f32, -3.75e-3, 65504.0, 65530.0, 1e-8, f32::MAX] {
            assert_eq!(
                LossyOut::Bf16.round(v).to_bits() >> 16,
                LossyOut::Bf16.bits(v)
            );
            assert_eq!(
                half::f16::from_f32(LossyOut::F16.round(v)).to_bits() as u32,
                LossyOut::F16.bits(v)
            );
        }
    }
}
