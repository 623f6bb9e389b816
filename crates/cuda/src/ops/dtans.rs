//! dtANS-LLM kernels (`kernels/dtans_mvm.cu`): the fused decode-matvec `mvm` (several matrices that
//! share an input in one launch), `decode` to the source elements and `dequant` to BF16 weights (for
//! prefill GEMMs). Their selftest against the codec's CPU decoder and matvec is
//! `dtans_selftest`.
//!
//! Tolerances: decode and dequant are bit-exact; mvm is within 1e-5 of the codec's f64 matvec in L2
//! relative to the rows' Σ|w·x| (f32 accumulation in a different order; per-slice partial sums
//! added with f32 atomics).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_codec::dtans::{Coding, DtansTensor};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;

use crate::coded::GpuDtans;
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};

pub static DTANS: KernelSource = KernelSource {
    name: "dtans_mvm.cu",
    source: include_str!("../../kernels/dtans_mvm.cu"),
};

/// Most matrices in one launch (the kernel's `DT_MAXMATS`).
pub const MAX_MATS: usize = 4;

/// Dynamic shared memory one block may use on sm_80/sm_90 parts (227 KiB on the H100/H200).
pub const MAX_SHARED_BYTES: usize = 227 * 1024;

/// What a launch produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DtansOut {
    /// y = W·x (f32).
    Mvm,
    /// The source elements (u16 for 16-bit payloads, one code byte otherwise).
    Decode,
    /// BF16 weights (scales/mins applied).
    Dequant,
}

/// Launch tuning: warps (tiles, one 32-row band each) per block, and the resident warps per SM
/// the register allocation must allow (0: no cap; else `__launch_bounds__` caps registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DtansConfig {
    pub warps: u32,
    pub min_warps: u32,
    /// Interleaved copies of the decoding table in shared memory (a power of two, at most 128 bytes
    /// of copies per slot; 0: as many as fit in 32 KiB): lane l reads copy l mod rep, which spreads
    /// a warp's random lookups over the banks.
    pub rep: u32,
    /// Quartets per unrolled iteration (2, 4 or 8; 0: 8). Group dequantisation assumes 8.
    pub unroll: u32,
    /// Byte-permute table addressing and a 32-bit test of the accumulator's high word
    /// (about 10 fewer instructions per quartet).
    pub fast: bool,
    /// Bytes per shared-memory table entry (the kernel's `DT_EB`): 16 `{r, d, v0, v1}` (every
    /// payload), 4 (BF16: the codec's entry, one wavefront per warp lookup with 32 copies) or 8
    /// (BF16 Pair: two words with the exponents in place); 0: [`DtansConfig::entry_bytes`]'s default.
    pub entry: u32,
}

impl DtansConfig {
    pub const DEFAULT: DtansConfig = DtansConfig {
        warps: 4,
        min_warps: 0,
        rep: 0,
        unroll: 0,
        fast: false,
        entry: 0,
    };

    pub const fn warps(warps: u32) -> Self {
        DtansConfig {
            warps,
            min_warps: 0,
            rep: 0,
            unroll: 0,
            fast: false,
            entry: 0,
        }
    }

    /// Whether the kernel compiles for `kind` with this unroll (whole companion words and raw
    /// units per iteration), entry size and table copies.
    pub fn fits(&self, kind: &DtansKind) -> bool {
        let uq = if self.unroll == 0 { 8 } else { self.unroll };
        if ![2, 4, 8].contains(&uq) {
            return false;
        }
        let cbits = kind.log2_m as u32 - 8;
        let eb = self.entry_bytes(kind);
        let rep_ok = self.rep == 0 || (self.rep.is_power_of_two() && self.rep * eb <= 128);
        let entry_ok = match self.entry {
            0 | 16 => true,
            4 => kind.bf16,
            8 => kind.bf16 && kind.k == 2,
            _ => false,
        };
        rep_ok
            && entry_ok
            && (uq * 4 * cbits) % 32 == 0
            && (!kind.bf16 || (4 * kind.k * uq) % 16 == 0)
            && (kind.sc / kind.k / 4) % uq == 0
    }

    /// Whether this unroll applies group scales (`groups`): their epilogue runs once per 8
    /// quartets, the default unroll.
    pub fn fits_groups(&self, groups: bool) -> bool {
        !groups || self.unroll == 0 || self.unroll == 8
    }

    /// Bytes per shared table entry for `kind`: as configured, else 4 for BF16 Single (fewer
    /// shared-memory wavefronts per lookup: faster on the large Llama-8B launches, H200
    /// 2026-11-30) and 16 otherwise (BF16 Pair: 16 was faster than 4 and 8 on every launch).
    pub fn entry_bytes(&self, kind: &DtansKind) -> u32 {
        match self.entry {
            0 if kind.bf16 && kind.k == 1 => 4,
            0 => 16,
            e => e,
        }
    }

    /// The table copies for `kind`'s table of 2^log2_m entries: as configured, else as many as fit
    /// in 32 KiB up to 128 bytes per slot (32 copies of 4-byte entries: a bank per lane).
    pub fn table_copies(&self, kind: &DtansKind) -> u32 {
        if self.rep != 0 {
            return self.rep;
        }
        let eb = self.entry_bytes(kind);
        (32768u32 / (eb << kind.log2_m)).clamp(1, 128 / eb)
    }
}

impl std::fmt::Display for DtansConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}", self.warps)?;
        if self.min_warps > 0 {
            write!(f, "m{}", self.min_warps)?;
        }
        if self.rep > 0 {
            write!(f, "r{}", self.rep)?;
        }
        if self.unroll > 0 {
            write!(f, "u{}", self.unroll)?;
        }
        if self.fast {
            write!(f, "f")?;
        }
        if self.entry > 0 {
            write!(f, "e{}", self.entry)?;
        }
        Ok(())
    }
}

/// The compile-time shape of a kernel: everything in a tensor's coding the kernel specialises on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DtansKind {
    pub k: u32,
    pub log2_m: u8,
    pub sc: u32,
    pub bf16: bool,
    pub code_bits: u32,
    /// Groups smaller than a slice (compile-time group size), else 0.
    pub small_group: u32,
}

impl DtansKind {
    /// `group`: columns per dequantisation group, if any (a group of at least `cols` is one per row).
    pub fn of(payload: Payload, coding: &Coding, cols: usize, group: Option<usize>) -> Self {
        DtansKind {
            k: coding.mode.values_per_symbol() as u32,
            log2_m: coding.log2_m,
            sc: coding.sc,
            bf16: payload == Payload::Bf16,
            code_bits: payload.code_bits(),
            small_group: match group {
                Some(g) if g < coding.sc as usize && g < cols => g as u32,
                _ => 0,
            },
        }
    }

    pub fn of_tensor(t: &GpuDtans) -> Self {
        Self::of(
            t.payload,
            &t.coding,
            t.cols,
            t.groups.as_ref().map(|g| g.group),
        )
    }

    pub fn variant(&self, cfg: DtansConfig, out: DtansOut) -> KernelVariant {
        KernelVariant::new(
            &DTANS,
            vec![
                ("DT_K", self.k as i64),
                ("DT_LOG2M", self.log2_m as i64),
                ("DT_SC", self.sc as i64),
                ("DT_WARPS", cfg.warps as i64),
                ("DT_MINW", cfg.min_warps as i64),
                ("DT_REP", cfg.table_copies(self) as i64),
                ("DT_EB", cfg.entry_bytes(self) as i64),
                (
                    "DT_UQ",
                    if cfg.unroll == 0 {
                        8
                    } else {
                        cfg.unroll as i64
                    },
                ),
                ("DT_FAST", cfg.fast as i64),
                ("DT_BF16", self.bf16 as i64),
                ("DT_CB", self.code_bits as i64),
                ("DT_GS", self.small_group as i64),
                (
                    "DT_OUT",
                    match out {
                        DtansOut::Mvm => 0,
                        DtansOut::Decode => 1,
                        DtansOut::Dequant => 2,
                    },
                ),
            ],
        )
    }

    /// Dynamic shared memory of a launch: table, activation slice and group sums (mvm), two 1 KiB
    /// chunk buffers per warp, and (decode/dequant) a warp's staged outputs of one iteration: 32
    /// rows of `DT_SW` bytes plus one store unit of padding (the kernel's `DT_STAGE`).
    pub fn shared_bytes(&self, cfg: DtansConfig, out: DtansOut) -> usize {
        let table =
            ((cfg.entry_bytes(self) as usize) << self.log2_m) * cfg.table_copies(self) as usize;
        let uq = if cfg.unroll == 0 { 8 } else { cfg.unroll } as usize;
        let (act, stage) = match out {
            DtansOut::Mvm => {
                let groups = self.sc.checked_div(self.small_group).unwrap_or(1) as usize;
                (4 * self.sc as usize + 4 * groups.div_ceil(4) * 4, 0)
            }
            DtansOut::Decode | DtansOut::Dequant => {
                let es = if out == DtansOut::Dequant || self.bf16 {
                    2
                } else {
                    1
                };
                let row = 4 * self.k as usize * uq * es;
                (0, 32 * (row + row.min(16)))
            }
        };
        table + act + (2048 + stage) * cfg.warps as usize
    }
}

/// The kernel's `DtMat` (layout must match `kernels/dtans_mvm.cu`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct DtMat {
    entries: u64,
    lut: u64,
    tiles: u64,
    stream: u64,
    companion: u64,
    raw: u64,
    scales: u64,
    mins: u64,
    out: u64,
    stream_len: u64,
    rows: i32,
    bands: i32,
    block0: i32,
    offset: f32,
}

/// The kernel's `DtParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct DtParams {
    x: u64,
    err: u64,
    cols: i32,
    slices: i32,
    n_mats: i32,
    group: i32,
    m: [DtMat; MAX_MATS],
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for DtParams {}

/// Checks that `mats` can share one launch: 1..=4 of them, same payload, mode, table size, slice
/// width, columns and group layout.
fn check_launch(op: &'static str, mats: &[&GpuDtans]) -> Result<DtansKind> {
    let first = mats
        .first()
        .ok_or_else(|| GpuError::invalid(op, "no matrices to launch"))?;
    if mats.len() > MAX_MATS {
        return Err(GpuError::invalid(
            op,
            format!("{} matrices in one launch (at most {MAX_MATS})", mats.len()),
        ));
    }
    let kind = DtansKind::of_tensor(first);
    let group = |t: &GpuDtans| t.groups.as_ref().map(|g| g.group);
    for t in &mats[1..] {
        if DtansKind::of_tensor(t) != kind
            || t.payload != first.payload
            || t.cols != first.cols
            || group(t) != group(first)
        {
            return Err(GpuError::invalid(
                op,
                format!(
                    "matrices of one launch must share payload, mode, M, sc, columns and groups: \
                     {:?} {:?} {}×{} vs {:?} {:?} {}×{}",
                    first.payload,
                    first.coding,
                    first.rows,
                    first.cols,
                    t.payload,
                    t.coding,
                    t.rows,
                    t.cols
                ),
            ));
        }
    }
    Ok(kind)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &GpuDevice,
    op: &'static str,
    cfg: DtansConfig,
    out_kind: DtansOut,
    mats: &[&GpuDtans],
    x: Option<&CudaSlice<f32>>,
    outs: &[u64],
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    let kind = check_launch(op, mats)?;
    if cfg.warps == 0
        || cfg.warps > 32
        || cfg.min_warps > 64
        || !cfg.fits(&kind)
        || !cfg.fits_groups(mats[0].groups.is_some())
    {
        return Err(GpuError::invalid(
            op,
            format!("launch configuration {cfg} does not fit {kind:?}"),
        ));
    }
    let first = mats[0];
    let stream = dev.stream();
    let mut p = DtParams {
        cols: first.cols as i32,
        slices: first.cols.div_ceil(first.coding.sc as usize) as i32,
        n_mats: mats.len() as i32,
        group: first.groups.as_ref().map_or(0, |g| g.group as i32),
        ..Default::default()
    };
    let (x_ptr, _gx) = match x {
        Some(x) => {
            let (p, g) = x.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    p.x = x_ptr;
    let mut guards = Vec::new();
    let mut blocks = 0usize;
    for (i, t) in mats.iter().enumerate() {
        let bands = t.rows.div_ceil(32);
        let (e, g1) = t.entries.device_ptr(stream);
        let (l, g2) = t.lut.device_ptr(stream);
        let (ti, g3) = t.tiles.device_ptr(stream);
        let (s, g4) = t.stream.device_ptr(stream);
        let (c, g5) = t.companion.device_ptr(stream);
        let (r, g6) = t.raw.device_ptr(stream);
        guards.extend([g1, g2, g3, g4, g5, g6]);
        let (sc, mn) = match &t.groups {
            Some(g) => {
                let (a, ga) = g.scales.device_ptr(stream);
                guards.push(ga);
                let m = match &g.mins {
                    Some(m) => {
                        let (b, gb) = m.device_ptr(stream);
                        guards.push(gb);
                        b
                    }
                    None => 0,
                };
                (a, m)
            }
            None => (0, 0),
        };
        p.m[i] = DtMat {
            entries: e,
            lut: l,
            tiles: ti,
            stream: s,
            companion: c,
            raw: r,
            scales: sc,
            mins: mn,
            out: outs[i],
            stream_len: t.stream_len as u64,
            rows: t.rows as i32,
            bands: bands as i32,
            block0: blocks as i32,
            offset: t.groups.as_ref().map_or(0.0, |g| g.offset),
        };
        blocks += bands.div_ceil(cfg.warps as usize);
    }
    if blocks > i32::MAX as usize || p.slices > 65_535 {
        return Err(GpuError::invalid(
            op,
            format!("grid of {blocks}×{} blocks is too large", p.slices),
        ));
    }
    let (err_ptr, _ge) = match err {
        Some(e) => {
            if e.is_empty() {
                return Err(GpuError::invalid(op, "error word buffer is empty"));
            }
            let (p, g) = e.device_ptr_mut(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    p.err = err_ptr;
    let variant = kind.variant(cfg, out_kind);
    let f = dev.function(&variant, "dtans_kernel")?;
    let shared = kind.shared_bytes(cfg, out_kind);
    if shared > MAX_SHARED_BYTES {
        return Err(GpuError::invalid(
            op,
            format!(
                "launch configuration {cfg} needs {shared} bytes of shared memory per block \
                 (at most {MAX_SHARED_BYTES}): fewer warps or table copies"
            ),
        ));
    }
    if shared > 48 * 1024 {
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .while_(|| format!("allowing {shared} bytes of shared memory for {op}"))?;
    }
    let lc = LaunchConfig {
        grid_dim: (blocks as u32, p.slices as u32, 1),
        block_dim: (cfg.warps * 32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&p);
    // SAFETY: `p` matches the kernel's parameter struct; every pointer is a live device buffer whose
    // size was checked against the tensors' geometry (GpuDtans::upload and the callers).
    unsafe { b.launch(lc) }.while_(|| {
        format!(
            "launching {op} {:?} k{} M2^{} sc{} w{} on {} matrices",
            first.payload,
            kind.k,
            kind.log2_m,
            kind.sc,
            cfg.warps,
            mats.len()
        )
    })?;
    drop(guards);
    Ok(())
}

/// `ys[i][..rows_i] = mats[i] · x` for up to four matrices with the same coding and input, in one
/// launch. `err`, if given, gets 1 OR-ed in when a stream is inconsistent (corrupt data).
pub fn launch_mvm(
    dev: &GpuDevice,
    cfg: DtansConfig,
    mats: &[&GpuDtans],
    x: &CudaSlice<f32>,
    ys: &mut [&mut CudaSlice<f32>],
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans mvm";
    check_launch(OP, mats)?;
    if ys.len() != mats.len() {
        return Err(GpuError::invalid(
            OP,
            format!("{} outputs for {} matrices", ys.len(), mats.len()),
        ));
    }
    super::check_len(OP, "x", x, mats[0].cols)?;
    let slices = mats[0].cols.div_ceil(mats[0].coding.sc as usize);
    let stream = dev.stream();
    let mut outs = Vec::with_capacity(ys.len());
    for (t, y) in mats.iter().zip(ys.iter_mut()) {
        super::check_len(OP, "y", y, t.rows)?;
        if slices > 1 {
            stream
                .memset_zeros(&mut y.slice_mut(0..t.rows))
                .while_(|| "zeroing y".into())?;
        }
        outs.push(y.device_ptr_mut(stream).0);
    }
    launch(dev, OP, cfg, DtansOut::Mvm, mats, Some(x), &outs, err)
}

/// `y[off_i .. off_i + rows_i] = mats[i] · x` with the matrices' outputs stacked in one buffer
/// (`off_i` = the rows before matrix i): q/k/v or [gate; up] stored as separate tensors, in one
/// launch.
pub fn launch_mvm_stacked(
    dev: &GpuDevice,
    cfg: DtansConfig,
    mats: &[&GpuDtans],
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans mvm (stacked)";
    check_launch(OP, mats)?;
    super::check_len(OP, "x", x, mats[0].cols)?;
    let total: usize = mats.iter().map(|t| t.rows).sum();
    super::check_len(OP, "y", y, total)?;
    let stream = dev.stream();
    if mats[0].cols.div_ceil(mats[0].coding.sc as usize) > 1 {
        stream
            .memset_zeros(&mut y.slice_mut(0..total))
            .while_(|| "zeroing y".into())?;
    }
    let base = y.device_ptr_mut(stream).0;
    let mut outs = Vec::with_capacity(mats.len());
    let mut off = 0u64;
    for t in mats {
        outs.push(base + 4 * off);
        off += t.rows as u64;
    }
    launch(dev, OP, cfg, DtansOut::Mvm, mats, Some(x), &outs, err)
}

/// Materialises `t` as BF16 weights into `out` starting at element `offset` (rows of a stacked
/// matrix), for prefill GEMMs.
pub fn launch_dequant_at(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u16>,
    offset: usize,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans dequant";
    super::check_len(OP, "out", out, offset + t.rows * t.cols)?;
    let o = out.device_ptr_mut(dev.stream()).0 + 2 * offset as u64;
    launch(dev, OP, cfg, DtansOut::Dequant, &[t], None, &[o], err)
}

/// Decodes `t` into its source elements (`t.decoded_bytes()` bytes: little-endian u16 for 16-bit
/// payloads, one code byte otherwise), row-major.
pub fn launch_decode(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u8>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans decode";
    super::check_len(OP, "out", out, t.decoded_bytes())?;
    let o = out.device_ptr_mut(dev.stream()).0;
    launch(dev, OP, cfg, DtansOut::Decode, &[t], None, &[o], err)
}

/// Materialises `t` as BF16 weights [rows × cols] (scales and mins applied), for prefill GEMMs.
pub fn launch_dequant(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u16>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans dequant";
    super::check_len(OP, "out", out, t.rows * t.cols)?;
    let o = out.device_ptr_mut(dev.stream()).0;
    launch(dev, OP, cfg, DtansOut::Dequant, &[t], None, &[o], err)
}

/// The BF16 weights the CPU reference gives (`dequant` semantics) for `t` under `dq`.
pub fn dequant_ref(t: &DtansTensor, dq: &Dequant) -> Result<Vec<u16>> {
    let bytes = t
        .decode()
        .map_err(|e| GpuError::invalid("dtans dequant_ref", e.to_string()))?;
    let eb = t.payload.element_bytes();
    Ok((0..t.rows * t.cols)
        .map(|i| {
            let (code, raw) = if eb == 2 {
                t.payload
                    .split_element(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
            } else {
                (bytes[i], 0)
            };
            let v = t.payload.to_f32(code, raw);
            if t.payload == Payload::Bf16 && matches!(dq, Dequant::None) {
                return u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            }
            let w = dq.apply(t.payload, i / t.cols, i % t.cols, t.cols, v);
            half::bf16::from_f32(w).to_bits()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<DtMat>(), 96);
        assert_eq!(std::mem::size_of::<DtParams>(), 32 + 4 * 96);
        assert_eq!(std::mem::align_of::<DtParams>(), 8);
    }

    #[test]
    fn entry_sizes_follow_the_payload() {
        let kind = |bf16, k, log2_m| DtansKind {
            k,
            log2_m,
            sc: 1024,
            bf16,
            code_bits: 8,
            small_group: 0,
        };
        let (single, pair, int) = (kind(true, 1, 8), kind(true, 2, 8), kind(false, 2, 8));
        let d = DtansConfig::DEFAULT;
        for (k, eb, copies) in [(single, 4, 32), (pair, 16, 8), (int, 16, 8)] {
            assert_eq!(d.entry_bytes(&k), eb);
            assert_eq!(d.table_copies(&k), copies);
            assert_eq!(
                k.shared_bytes(d, DtansOut::Mvm),
                32768 + 4 * 1024 + 16 + 2048 * 4
            );
            assert!(d.fits(&k));
        }
        assert_eq!(d.table_copies(&kind(true, 1, 12)), 2);
        assert!(!DtansConfig { entry: 4, ..d }.fits(&int));
        assert!(!DtansConfig { entry: 8, ..d }.fits(&single));
        assert!(!DtansConfig { entry: 5, ..d }.fits(&pair));
        assert!(!DtansConfig {
            entry: 16,
            rep: 16,
            ..d
        }
        .fits(&pair));
        assert!(!DtansConfig {
            entry: 4,
            rep: 3,
            ..d
        }
        .fits(&pair));
        assert!(DtansConfig {
            entry: 4,
            rep: 32,
            ..d
        }
        .fits(&pair));
    }
}
