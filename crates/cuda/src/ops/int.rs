//! Integer codes with group scales on the device (`kernels/int.cu`, model form `int`: GGUF legacy
//! codes, GPTQ, AWQ, compressed-tensors pack-quantized). `int_mv` multiplies one vector by a
//! matrix of 2..8-bit codes (one warp [`ROWS`] rows), `int_dequant` writes it as BF16 for
//! prefill's GEMM. The host side — the kernels' code layout ([`Layout`], [`pack`]) and scale table —
//! is checked on the CPU by this module's tests; the kernels against the CPU form by
//! `int_selftest`.
//!
//! Tolerances: the dequantisation is bit-exact (the CPU form's f32 weights rounded to BF16); the
//! product is f32 sums in another order than the CPU's.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_model::forms::GroupScales;

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};
use rayon::prelude::*;
use std::sync::Mutex;

pub static INT: KernelSource = KernelSource {
    name: "int.cu",
    source: include_str!("../../kernels/int.cu"),
};

/// Warps a block of `int_mv`.
pub const WARPS: u32 = 4;
/// Rows a warp of `int_mv` (the activations' loads shared between them).
pub const ROWS: u32 = 2;
/// The code widths the kernels run.
pub const BITS: [u8; 6] = [2, 3, 4, 5, 6, 8];
/// Words past a matrix's codes its buffer holds (none are read; a margin against rounding).
const PAD: usize = 4;

/// How a weight is made of its code (`INT_KIND`): s·q, s·(q − o), s·(q − o) + m.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Scaled = 0,
    Offset = 1,
    Mins = 2,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Scaled, Kind::Offset, Kind::Mins];
}

/// The compiled module of `bits`-bit codes of `kind`, `rows` rows a warp.
pub fn variant(bits: u8, kind: Kind, rows: u32) -> KernelVariant {
    KernelVariant::new(
        &INT,
        vec![
            ("INT_BITS", bits as i64),
            ("INT_KIND", kind as i64),
            ("INT_ROWS", rows as i64),
        ],
    )
}

/// Every variant served (each width and kind, [`ROWS`] rows a warp).
pub fn all_variants() -> Vec<KernelVariant> {
    BITS.iter()
        .flat_map(|&b| Kind::ALL.map(|k| variant(b, k, ROWS)))
        .collect()
}

/// Where a row's codes sit: full superchunks of 1024 columns (32 lanes × 8 steps of 4 columns, a
/// lane's 32 codes in `bits` words), then a tail of `tail_steps` steps in `tail_words` words a
/// lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub bits: usize,
    pub cols: usize,
    pub full: usize,
    pub tail_steps: usize,
    pub tail_words: usize,
}

impl Layout {
    pub fn new(bits: u8, cols: usize) -> Layout {
        let bits = bits as usize;
        let full = cols / 1024;
        let tail_steps = (cols - 1024 * full).div_ceil(128);
        Layout {
            bits,
            cols,
            full,
            tail_steps,
            tail_words: (tail_steps * bits).div_ceil(8),
        }
    }

    pub fn row_words(&self) -> usize {
        32 * (self.full * self.bits + self.tail_words)
    }

    /// The word (within its row) and bit at which column `c`'s code starts.
    pub fn locate(&self, c: usize) -> (usize, usize) {
        let (step, lane, e) = (c / 128, (c % 128) / 4, c % 4);
        let (j, k) = (step / 8, step % 8);
        let base = match j < self.full {
            true => (j * 32 + lane) * self.bits,
            false => 32 * self.full * self.bits + lane * self.tail_words,
        };
        let bit = (4 * k + e) * self.bits;
        (base + bit / 32, bit % 32)
    }
}

/// `rows` rows of unsigned codes (`code(r, c)`, below 2^bits) in the kernels' layout.
pub fn pack(l: &Layout, rows: usize, code: impl Fn(usize, usize) -> u32 + Sync) -> Vec<u32> {
    let rw = l.row_words();
    let mut w = vec![0u32; rows * rw];
    w.par_chunks_mut(rw).enumerate().for_each(|(r, row)| {
        for c in 0..l.cols {
            let (i, sh) = l.locate(c);
            let v = code(r, c) as u64 & ((1u64 << l.bits) - 1);
            let both = (v << sh) as u128;
            row[i] |= both as u32;
            if sh + l.bits > 32 {
                row[i + 1] |= (both >> 32) as u32;
            }
        }
    });
    w
}

/// Code (r, c) of packed words (the kernels' reading, for tests).
pub fn unpack(l: &Layout, words: &[u32], r: usize, c: usize) -> u32 {
    let (i, sh) = l.locate(c);
    let row = &words[r * l.row_words()..];
    let lo = row[i] as u64 | (row.get(i + 1).copied().unwrap_or(0) as u64) << 32;
    ((lo >> sh) & ((1 << l.bits) - 1)) as u32
}

/// An integer matrix as the kernels read it, on the host: the packed codes (unsigned: signed
/// codes with their sign bit flipped, the offset raised to match) and the scale table.
#[derive(Clone, Debug, PartialEq)]
pub struct IntPacked {
    pub layout: Layout,
    pub rows: usize,
    pub kind: Kind,
    pub groups_per_row: usize,
    pub group_shift: u32,
    pub offset: f32,
    pub words: Vec<u32>,
    /// Per row and group: s, or (s, m) for [`Kind::Mins`].
    pub table: Vec<f32>,
}

impl IntPacked {
    /// `rows` × `cols` codes (row-major, one a byte; signed ones in two's complement of `bits`
    /// bits) with their groups. An error saying why where the kernels do not take the matrix:
    /// the code width, columns not a multiple of 4, groups neither a power of two nor whole rows,
    /// a signed matrix's offset not a small integer.
    pub fn new(
        bits: u8,
        rows: usize,
        cols: usize,
        codes: &[u8],
        g: &GroupScales,
    ) -> std::result::Result<IntPacked, String> {
        if !BITS.contains(&bits) {
            return Err(format!("no kernel for {bits}-bit codes"));
        }
        if rows == 0 || cols == 0 || cols % 4 != 0 || cols > i32::MAX as usize / 2 {
            return Err(format!("{cols} columns are not a multiple of 4"));
        }
        let gpr = cols.div_ceil(g.group.max(1));
        let group_shift = match (g.group.is_power_of_two() && g.group >= 4, gpr) {
            (true, _) => g.group.trailing_zeros(),
            (false, 1) => 31,
            _ => {
                return Err(format!(
                    "groups of {} columns (not a power of two)",
                    g.group
                ))
            }
        };
        if codes.len() != rows * cols
            || g.scales.len() != rows * gpr
            || g.mins.as_ref().is_some_and(|m| m.len() != rows * gpr)
        {
            return Err(format!(
                "{} codes and {} scales are not a {rows}×{cols} matrix of {gpr} groups a row",
                codes.len(),
                g.scales.len()
            ));
        }
        let half = 1u32 << (bits - 1);
        let (flip, offset) = match g.signed {
            true if g.offset.fract() == 0.0 && g.offset.abs() < 1e6 => {
                (half, g.offset + half as f32)
            }
            true => return Err(format!("signed codes with offset {}", g.offset)),
            false => (0, g.offset),
        };
        let kind = match (&g.mins, offset != 0.0) {
            (Some(_), _) => Kind::Mins,
            (None, true) => Kind::Offset,
            (None, false) => Kind::Scaled,
        };
        let layout = Layout::new(bits, cols);
        let words = pack(&layout, rows, |r, c| codes[r * cols + c] as u32 ^ flip);
        let table = match &g.mins {
            Some(m) => g.scales.iter().zip(m).flat_map(|(&s, &m)| [s, m]).collect(),
            None => g.scales.clone(),
        };
        Ok(IntPacked {
            layout,
            rows,
            kind,
            groups_per_row: gpr,
            group_shift,
            offset,
            words,
            table,
        })
    }

    /// Bytes a batch-1 product reads: the codes and the scale table.
    pub fn stored_bytes(&self) -> usize {
        4 * (self.words.len() + self.table.len())
    }
}

/// An integer matrix on the device.
pub struct GpuInt {
    pub bits: u8,
    pub kind: Kind,
    pub rows: usize,
    pub cols: usize,
    /// Rows a warp of its `int_mv` (the variant).
    pub rows_per_warp: u32,
    layout: Layout,
    groups_per_row: usize,
    group_shift: u32,
    offset: f32,
    stored: usize,
    words: CudaSlice<u32>,
    table: CudaSlice<f32>,
    /// Stored columns in another order (GPTQ's activation order): the original column of each,
    /// and the buffer the input is gathered into before a product.
    perm: Option<(CudaSlice<u32>, Mutex<CudaSlice<f32>>)>,
}

impl GpuInt {
    /// `p` on the device; `perm`: the original column of each stored column, if they differ.
    pub fn upload(dev: &GpuDevice, p: &IntPacked, perm: Option<&[u32]>) -> Result<GpuInt> {
        let what = || {
            format!(
                "uploading a {}×{} {}-bit matrix",
                p.rows, p.layout.cols, p.layout.bits
            )
        };
        let cols = p.layout.cols;
        if let Some(perm) = perm {
            let mut seen = vec![false; cols];
            let ok = perm.len() == cols
                && perm.iter().all(|&k| {
                    (k as usize) < cols && !std::mem::replace(&mut seen[k as usize], true)
                });
            if !ok {
                return Err(GpuError::invalid(
                    "int upload",
                    format!("the column order is not a permutation of {cols} columns"),
                ));
            }
        }
        let s = dev.stream();
        let perm = match perm {
            Some(k) => Some((
                s.clone_htod(k).while_(what)?,
                Mutex::new(s.alloc_zeros::<f32>(cols).while_(what)?),
            )),
            None => None,
        };
        let mut words = Vec::with_capacity(p.words.len() + PAD);
        words.extend_from_slice(&p.words);
        words.resize(p.words.len() + PAD, 0);
        Ok(GpuInt {
            bits: p.layout.bits as u8,
            kind: p.kind,
            rows: p.rows,
            cols: p.layout.cols,
            rows_per_warp: ROWS,
            layout: p.layout,
            groups_per_row: p.groups_per_row,
            group_shift: p.group_shift,
            offset: p.offset,
            stored: p.stored_bytes(),
            words: s.clone_htod(&words).while_(what)?,
            table: s.clone_htod(&p.table).while_(what)?,
            perm,
        })
    }

    /// Bytes a batch-1 product reads.
    pub fn stored_bytes(&self) -> usize {
        self.stored
    }

    /// Whether a product gathers its input into the stored column order first.
    pub fn gathers(&self) -> bool {
        self.perm.is_some()
    }

    pub fn device_bytes(&self) -> usize {
        4 * (self.words.len() + self.table.len())
            + self.perm.as_ref().map_or(0, |(k, _)| 8 * k.len())
    }

    /// A copy in new device memory (device-to-device).
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<GpuInt> {
        let what = || {
            format!(
                "copying a {}×{} {}-bit matrix",
                self.rows, self.cols, self.bits
            )
        };
        let s = dev.stream();
        let perm = match &self.perm {
            Some((k, _)) => Some((
                s.clone_dtod(k).while_(what)?,
                Mutex::new(s.alloc_zeros::<f32>(self.cols).while_(what)?),
            )),
            None => None,
        };
        Ok(GpuInt {
            words: s.clone_dtod(&self.words).while_(what)?,
            table: s.clone_dtod(&self.table).while_(what)?,
            perm,
            ..*self
        })
    }

    fn variant(&self) -> KernelVariant {
        variant(self.bits, self.kind, self.rows_per_warp)
    }
}

/// The kernels' `IntParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct IntParams {
    w: u64,
    sm: u64,
    x: u64,
    y: u64,
    out: u64,
    perm: u64,
    row_words: i64,
    rows: i32,
    cols: i32,
    groups_per_row: i32,
    group_shift: i32,
    full: i32,
    tail_steps: i32,
    tail_words: i32,
    offset: f32,
}

// SAFETY: plain-old-data with the C layout of the kernels' parameter struct.
unsafe impl DeviceRepr for IntParams {}

fn params<'a>(dev: &'a GpuDevice, m: &'a GpuInt) -> (IntParams, impl Drop + 'a, impl Drop + 'a) {
    let stream = dev.stream();
    let (w, gw) = m.words.device_ptr(stream);
    let (sm, gs) = m.table.device_ptr(stream);
    let p = IntParams {
        w,
        sm,
        row_words: m.layout.row_words() as i64,
        rows: m.rows as i32,
        cols: m.cols as i32,
        groups_per_row: m.groups_per_row as i32,
        group_shift: m.group_shift as i32,
        full: m.layout.full as i32,
        tail_steps: m.layout.tail_steps as i32,
        tail_words: m.layout.tail_words as i32,
        offset: m.offset,
        ..Default::default()
    };
    (p, gw, gs)
}

fn launch(
    dev: &GpuDevice,
    op: &'static str,
    m: &GpuInt,
    p: IntParams,
    lc: LaunchConfig,
) -> Result<()> {
    let f = dev.function(&m.variant(), op)?;
    let stream = dev.stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&p);
    // SAFETY: `p` matches the kernel's parameter struct; its pointers are live device buffers of
    // the sizes the callers checked against the matrix's shape.
    unsafe { b.launch(lc) }.while_(|| {
        format!(
            "launching {op} on a {}×{} {}-bit matrix",
            m.rows, m.cols, m.bits
        )
    })?;
    Ok(())
}

/// `y[at..at + rows] = W·x`.
pub fn launch_mv(
    dev: &GpuDevice,
    m: &GpuInt,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    at: usize,
) -> Result<()> {
    const OP: &str = "int_mv";
    super::check_len(OP, "x", x, m.cols)?;
    super::check_len(OP, "y", y, at + m.rows)?;
    let stream = dev.stream();
    let mut gathered = m
        .perm
        .as_ref()
        .map(|(k, xg)| (k, xg.lock().unwrap_or_else(|e| e.into_inner())));
    if let Some((k, xg)) = gathered.as_mut() {
        launch_gather(dev, m, x, k, xg)?;
    }
    let (mut p, _gw, _gs) = params(dev, m);
    let (xp, _gx) = match gathered.as_ref() {
        Some((_, xg)) => xg.device_ptr(stream),
        None => x.device_ptr(stream),
    };
    let (yp, _gy) = y.device_ptr_mut(stream);
    p.x = xp;
    p.y = yp + 4 * at as u64;
    let per_block = (WARPS * m.rows_per_warp) as usize;
    let lc = LaunchConfig {
        grid_dim: (m.rows.div_ceil(per_block) as u32, 1, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, OP, m, p, lc)
}

/// `xg[k] = x[perm[k]]`.
fn launch_gather(
    dev: &GpuDevice,
    m: &GpuInt,
    x: &CudaSlice<f32>,
    perm: &CudaSlice<u32>,
    xg: &mut CudaSlice<f32>,
) -> Result<()> {
    let f = dev.function(&m.variant(), "int_gather")?;
    let n = super::as_i32("int_gather", "cols", m.cols)?;
    let stream = dev.stream();
    let mut b = stream.launch_builder(&f);
    b.arg(x).arg(perm).arg(xg).arg(&n);
    let lc = LaunchConfig {
        grid_dim: (super::grid_for(m.cols, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x, perm and xg hold `cols` elements (checked by the caller and at upload), and
    // perm's entries are columns (checked at upload).
    unsafe { b.launch(lc) }.while_(|| format!("launching int_gather on {} columns", m.cols))?;
    Ok(())
}

/// `out[at..at + rows·cols]` = W's weights as BF16 bits, row-major in the original column order
/// (`at` a multiple of 4).
pub fn launch_dequant(
    dev: &GpuDevice,
    m: &GpuInt,
    out: &mut CudaSlice<u16>,
    at: usize,
) -> Result<()> {
    const OP: &str = "int_dequant";
    let n = m.rows * m.cols;
    if at % 4 != 0 {
        return Err(GpuError::invalid(
            OP,
            format!("output offset {at} is not a multiple of 4"),
        ));
    }
    super::check_len(OP, "out", out, at + n)?;
    let (mut p, _gw, _gs) = params(dev, m);
    let (o, _go) = out.device_ptr_mut(dev.stream());
    p.out = o + 2 * at as u64;
    let _gp = m.perm.as_ref().map(|(k, _)| {
        let (kp, g) = k.device_ptr(dev.stream());
        p.perm = kp;
        g
    });
    let lc = LaunchConfig {
        grid_dim: (super::grid_for(n / 4, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, OP, m, p, lc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_packs_every_code_once_and_reads_it_back() {
        let mut r = entrollm_codec::rng::SplitMix64::new(7);
        for bits in BITS {
            for cols in [4usize, 124, 128, 576, 1000, 1024, 1028, 2304, 4096, 5124] {
                let l = Layout::new(bits, cols);
                // Every code bit in the row is its own: the codes' bit ranges do not overlap and
                // stay inside the row.
                let mut used = vec![false; 32 * l.row_words()];
                for c in 0..cols {
                    let (i, sh) = l.locate(c);
                    for b in 0..bits as usize {
                        let at = 32 * i + sh + b;
                        assert!(!used[at], "bits {bits} cols {cols} col {c}");
                        used[at] = true;
                    }
                }
                let rows = 3;
                let codes: Vec<u32> = (0..rows * cols)
                    .map(|_| r.next_u64() as u32 & ((1 << bits) - 1))
                    .collect();
                let w = pack(&l, rows, |r, c| codes[r * cols + c]);
                assert_eq!(w.len(), rows * l.row_words());
                for r in 0..rows {
                    for c in 0..cols {
                        assert_eq!(unpack(&l, &w, r, c), codes[r * cols + c]);
                    }
                }
                // A lane's words of a full superchunk are its own run of `bits` words.
                if l.full > 0 {
                    assert_eq!(l.locate(4).0, bits as usize);
                }
            }
        }
    }

    #[test]
    fn signed_codes_flip_to_the_same_values() {
        // Signed 4-bit codes 0..16 (two's complement) with offset 1: q − o as the CPU computes it,
        // and as the packed unsigned code less the raised offset.
        let codes: Vec<u8> = (0..16).collect();
        let g = GroupScales {
            group: 8,
            scales: vec![0.5, 0.25],
            mins: None,
            offset: 1.0,
            signed: true,
        };
        let p = IntPacked::new(4, 1, 16, &codes, &g).unwrap();
        assert_eq!((p.kind, p.group_shift, p.offset), (Kind::Offset, 3, 9.0));
        for (c, &q) in codes.iter().enumerate() {
            let signed = if q >= 8 { q as f32 - 16.0 } else { q as f32 };
            let packed = unpack(&p.layout, &p.words, 0, c) as f32;
            assert_eq!(signed - 1.0, packed - p.offset);
        }
    }

    #[test]
    fn refuses_what_the_kernels_do_not_take() {
        let g = |group, n| GroupScales {
            group,
            scales: vec![1.0; n],
            mins: None,
            offset: 0.0,
            signed: false,
        };
        assert!(IntPacked::new(4, 1, 30, &[0; 30], &g(32, 1)).is_err());
        assert!(IntPacked::new(7, 1, 32, &[0; 32], &g(32, 1)).is_err());
        assert!(IntPacked::new(4, 1, 96, &[0; 96], &g(48, 2)).is_err());
        // Whole rows are one group whatever their width.
        let p = IntPacked::new(4, 2, 96, &[0; 192], &g(96, 2)).unwrap();
        assert_eq!((p.groups_per_row, p.kind), (1, Kind::Scaled));
        let mut m = g(32, 3);
        m.mins = Some(vec![0.0; 3]);
        let p = IntPacked::new(8, 1, 96, &[0; 96], &m).unwrap();
        assert_eq!((p.kind, p.table.len()), (Kind::Mins, 6));
    }
}
