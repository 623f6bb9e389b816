//! GGUF quantised blocks on the device (`kernels/ggml.cu`, model form `ggml`): `ggml_mv`
//! multiplies one vector by a matrix of one ggml type's blocks as the file stores them (one warp a
//! row), `ggml_dequant` writes the matrix as BF16 for prefill's GEMM. One module per type. Their
//! selftest against the CPU form (`GgmlLinear`'s product and `gguf::dequantize`) is
//! `ggml_selftest`.
//!
//! Tolerances: the dequantisation is bit-exact (the CPU's f32 weights rounded to BF16); the
//! product is f32 sums in another order than the CPU's.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_model::gguf::GgmlType;

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};

pub static GGML: KernelSource = KernelSource {
    name: "ggml.cu",
    source: include_str!("../../kernels/ggml.cu"),
};

/// Rows (warps) a block of `ggml_mv`.
pub const WARPS: u32 = 4;
/// Bytes past a matrix's blocks its buffer holds: `load8` reads whole aligned words.
const PAD: usize = 16;

/// The types the kernels run: the quant-type table's `gpu` rows.
pub fn types() -> &'static [GgmlType] {
    &entrollm_format::qtype::GPU
}

/// Rows a warp of `ggml_mv`: two for the types whose kernel shares the activations' loads
/// between a pair of rows (Q4_K, Q5_K, Q6_K), else one.
pub fn rows_per_warp(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 2,
        _ => 1,
    }
}

/// The types with a q8 product (`ggml_mv_q8`: activations as 8-bit codes per 32, by
/// `ggml_q8x`; `--activations q8`).
pub fn q8_types() -> &'static [GgmlType] {
    &[GgmlType::Q4_K]
}

/// Whether `ty`'s `ggml_mv` keeps the activations' sums over each sub-block of 32 in shared
/// memory (`GGML_XSUMS`: Q4_K's and Q5_K's offsets).
fn xsums(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K)
}

/// Shared memory of a `ggml_mv` block over `cols` columns of `ty` ([`xsums`]).
fn mv_smem(ty: GgmlType, cols: usize) -> u32 {
    if xsums(ty) {
        (cols / 32 * 4) as u32
    } else {
        0
    }
}

/// The most columns a matrix of `ty` may have: [`mv_smem`] within the 48 KiB a block gets
/// without opting in.
fn max_cols(ty: GgmlType) -> usize {
    if xsums(ty) {
        48 * 1024 / 4 * 32
    } else {
        i32::MAX as usize
    }
}

/// Warps (log2) that share a row pair of `ty`'s two-row `ggml_mv` (`q8`: `ggml_mv_q8`) over
/// `cols` columns, `pairs` row pairs in the launch: as many as keep the launch near `SPLIT_WARPS`
/// warps in all (a matrix of few rows leaves most of the device idle otherwise), each with two
/// blocks or more. Not for the f32 products with [`xsums`]: each block of threads sums all the
/// activations first, which made Q4_K's and Q5_K's split products slower where Q6_K's got up to
/// twice as fast (bench/RESULTS.md).
fn split_log2(ty: GgmlType, pairs: usize, cols: usize, q8: bool) -> i32 {
    const SPLIT_WARPS: usize = 8192;
    if rows_per_warp(ty) != 2 || (xsums(ty) && !q8) {
        return 0;
    }
    let blocks = cols / ty.block_layout().0;
    let mut s = 0;
    while (1u32 << (s + 1)) <= WARPS && pairs << s < SPLIT_WARPS && blocks >> (s + 1) >= 2 {
        s += 1;
    }
    s
}

/// Blocks of `ggml_mv` for `rows` rows of `ty`, `split_log2` warps a row pair.
fn mv_blocks(ty: GgmlType, rows: usize, split_log2: i32) -> u32 {
    let per_block = (WARPS >> split_log2) * rows_per_warp(ty);
    rows.div_ceil(per_block as usize) as u32
}

/// The compiled module of `ty`'s kernels.
pub fn variant(ty: GgmlType) -> KernelVariant {
    KernelVariant::new(
        &GGML,
        vec![
            ("GGML_TYPE", ty.id() as i64),
            ("GGML_WARPS", WARPS as i64),
            ("GGML_ROWS", rows_per_warp(ty) as i64),
        ],
    )
}

/// Every variant (one a type).
pub fn all_variants() -> Vec<KernelVariant> {
    types().iter().map(|&t| variant(t)).collect()
}

/// One ggml type's row-major blocks on the device.
pub struct GpuGgml {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    bytes: CudaSlice<u8>,
}

impl GpuGgml {
    /// `rows` rows of whole `ty` blocks of `cols` elements on the device, given as the row-stacked
    /// parts' bytes in order (copied once, into the padded buffer uploaded). An error when the
    /// kernels do not run `ty` or the bytes are not that shape.
    pub fn upload(
        dev: &GpuDevice,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        parts: &[&[u8]],
    ) -> Result<GpuGgml> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let (bs, ts) = ty.block_layout();
        if !types().contains(&ty) {
            return Err(GpuError::invalid(
                "ggml upload",
                format!("no GPU kernel for ggml type {ty}"),
            ));
        }
        let row_bytes = cols / bs * ts;
        if rows == 0
            || cols == 0
            || cols % bs != 0
            || len != rows * row_bytes
            || rows > i32::MAX as usize
            || cols > max_cols(ty)
        {
            return Err(GpuError::invalid(
                "ggml upload",
                format!(
                    "{len} bytes are not {rows} rows of {cols} {ty} weights (blocks of {bs} in {ts} bytes, at most {} a row)",
                    max_cols(ty)
                ),
            ));
        }
        let mut padded = Vec::with_capacity(len + PAD);
        for p in parts {
            padded.extend_from_slice(p);
        }
        padded.resize(len + PAD, 0);
        let what = || format!("uploading a {rows}×{cols} {ty} matrix");
        Ok(GpuGgml {
            ty,
            rows,
            cols,
            row_bytes,
            bytes: dev.stream().clone_htod(&padded).while_(what)?,
        })
    }

    /// Bytes of the blocks (what a batch-1 product reads).
    pub fn stored_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    pub fn device_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// A copy in new device memory (device-to-device).
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<GpuGgml> {
        let what = || format!("copying a {}×{} {} matrix", self.rows, self.cols, self.ty);
        Ok(GpuGgml {
            bytes: dev.stream().clone_dtod(&self.bytes).while_(what)?,
            ..*self
        })
    }
}

/// The kernels' `GgmlParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct GgmlParams {
    w: u64,
    x: u64,
    y: u64,
    out: u64,
    row_bytes: i64,
    rows: i32,
    cols: i32,
    split_log2: i32,
}

// SAFETY: plain-old-data with the C layout of the kernels' parameter struct.
unsafe impl DeviceRepr for GgmlParams {}

/// The parameters and launch shape of a product over `rows` rows of `m` (an expert's, where
/// `slots` experts are gathered) from the device pointers (w, x, y), row pairs split by `split`
/// ([`split_log2`]), with `smem` bytes of dynamic shared memory ([`mv_smem`]).
fn mv_launch(
    m: &GpuGgml,
    (w, x, y): (u64, u64, u64),
    rows: usize,
    split: i32,
    slots: u32,
    smem: u32,
) -> (GgmlParams, LaunchConfig) {
    let p = GgmlParams {
        w,
        x,
        y,
        out: 0,
        row_bytes: m.row_bytes as i64,
        rows: rows as i32,
        cols: m.cols as i32,
        split_log2: split,
    };
    let lc = LaunchConfig {
        grid_dim: (mv_blocks(m.ty, rows, split), slots, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: smem,
    };
    (p, lc)
}

fn launch(
    dev: &GpuDevice,
    op: &'static str,
    m: &GpuGgml,
    p: GgmlParams,
    lc: LaunchConfig,
) -> Result<()> {
    let f = dev.function(&variant(m.ty), op)?;
    let stream = dev.stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&p);
    // SAFETY: `p` matches the kernel's parameter struct; its pointers are live device buffers of
    // the sizes the callers checked against the matrix's shape.
    unsafe { b.launch(lc) }
        .while_(|| format!("launching {op} on a {}×{} {} matrix", m.rows, m.cols, m.ty))?;
    Ok(())
}

/// `y[at..at + rows] = W·x`.
pub fn launch_mv(
    dev: &GpuDevice,
    m: &GpuGgml,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    at: usize,
) -> Result<()> {
    const OP: &str = "ggml_mv";
    super::check_len(OP, "x", x, m.cols)?;
    super::check_len(OP, "y", y, at + m.rows)?;
    let stream = dev.stream();
    let (w, _gw) = m.bytes.device_ptr(stream);
    let (xp, _gx) = x.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let split = split_log2(m.ty, m.rows.div_ceil(2), m.cols, false);
    let y = yp + 4 * at as u64;
    let (p, lc) = mv_launch(m, (w, xp, y), m.rows, split, 1, mv_smem(m.ty, m.cols));
    launch(dev, OP, m, p, lc)
}

/// A vector of activations as `ggml_q8x` writes it for the q8 products: 8-bit codes, and each
/// 32's (d, d·Σq).
pub struct Q8Acts {
    q: CudaSlice<u8>,
    ds: CudaSlice<f32>,
    cols: usize,
}

impl Q8Acts {
    /// Buffers for vectors of `cols` activations (a multiple of 32).
    pub fn new(dev: &GpuDevice, cols: usize) -> Result<Q8Acts> {
        if cols == 0 || cols % 32 != 0 {
            return Err(GpuError::invalid(
                "q8 activations",
                format!("{cols} columns are not whole blocks of 32"),
            ));
        }
        let s = dev.stream();
        let what = || format!("allocating q8 activations of {cols} columns");
        Ok(Q8Acts {
            q: s.alloc_zeros::<u8>(cols).while_(what)?,
            ds: s.alloc_zeros::<f32>(cols / 16).while_(what)?,
            cols,
        })
    }
}

/// `acts` = x as 8-bit codes per 32 (`ggml_q8x`), for the q8 products of `ty`.
pub fn launch_q8x(
    dev: &GpuDevice,
    ty: GgmlType,
    x: &CudaSlice<f32>,
    acts: &mut Q8Acts,
) -> Result<()> {
    const OP: &str = "ggml_q8x";
    super::check_len(OP, "x", x, acts.cols)?;
    if !q8_types().contains(&ty) {
        return Err(GpuError::invalid(OP, format!("no q8 product for {ty}")));
    }
    let f = dev.function(&variant(ty), OP)?;
    let stream = dev.stream();
    let cols = acts.cols as i32;
    let mut b = stream.launch_builder(&f);
    b.arg(x).arg(&mut acts.q).arg(&mut acts.ds).arg(&cols);
    let lc = LaunchConfig {
        grid_dim: (acts.cols.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; x holds cols values (checked), q and
    // ds were allocated for cols.
    unsafe { b.launch(lc) }.while_(|| format!("launching {OP} on {cols} activations"))?;
    Ok(())
}

/// `y[at..at + rows] = W·x` with x as `acts` ([`launch_q8x`]): the dequantised weights' product
/// with the quantised activations, in f32.
pub fn launch_mv_q8(
    dev: &GpuDevice,
    m: &GpuGgml,
    acts: &Q8Acts,
    y: &mut CudaSlice<f32>,
    at: usize,
) -> Result<()> {
    const OP: &str = "ggml_mv_q8";
    if !q8_types().contains(&m.ty) || acts.cols != m.cols {
        return Err(GpuError::invalid(
            OP,
            format!(
                "a {}×{} {} matrix by q8 activations of {} columns",
                m.rows, m.cols, m.ty, acts.cols
            ),
        ));
    }
    super::check_len(OP, "y", y, at + m.rows)?;
    let stream = dev.stream();
    let (w, _gw) = m.bytes.device_ptr(stream);
    let (xp, _gx) = acts.q.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let split = split_log2(m.ty, m.rows.div_ceil(2), m.cols, true);
    let (p, lc) = mv_launch(m, (w, xp, yp + 4 * at as u64), m.rows, split, 1, 0);
    let f = dev.function(&variant(m.ty), OP)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&p).arg(&acts.ds);
    // SAFETY: `p` matches the kernel's parameter struct; its pointers are live device buffers of
    // the sizes checked above (acts: the matrix's columns).
    unsafe { b.launch(lc) }
        .while_(|| format!("launching {OP} on a {}×{} {} matrix", m.rows, m.cols, m.ty))?;
    Ok(())
}

/// The gathered `ggml_mv` over `m` as a stack of `g.n_experts` equal matrices (expert e's rows
/// from e · rows / n_experts): slot s of `g` writes its expert's product with input row
/// s / x_group to `y[at + s · stride ..]`, an expert's rows from there. One launch for every
/// slot. Reference: each slot's expert through the CPU form's product.
pub fn launch_mv_experts(
    dev: &GpuDevice,
    m: &GpuGgml,
    g: super::forward::Gather<'_>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    at: usize,
    stride: usize,
) -> Result<()> {
    const OP: &str = "ggml_mv_experts";
    let experts = g
        .experts
        .ok_or_else(|| GpuError::invalid(OP, "no expert indices"))?;
    if g.n_experts == 0 || m.rows % g.n_experts != 0 || at + m.rows / g.n_experts > stride {
        return Err(GpuError::invalid(
            OP,
            format!(
                "{} rows as {} experts into rows {at}.. of {stride}",
                m.rows, g.n_experts
            ),
        ));
    }
    g.check(OP, x, m.cols, y, stride)?;
    let rows = m.rows / g.n_experts;
    let stream = dev.stream();
    let (w, _gw) = m.bytes.device_ptr(stream);
    let (xp, _gx) = x.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let split = split_log2(m.ty, rows.div_ceil(2) * g.slots, m.cols, false);
    let smem = mv_smem(m.ty, m.cols);
    let (p, lc) = mv_launch(
        m,
        (w, xp, yp + 4 * at as u64),
        rows,
        split,
        g.slots as u32,
        smem,
    );
    let f = dev.function(&variant(m.ty), OP)?;
    let mut b = stream.launch_builder(&f);
    let (e_i, xg_i, s_i) = (g.n_experts as i32, g.x_group as i32, stride as i32);
    b.arg(&p).arg(experts).arg(&e_i).arg(&xg_i).arg(&s_i);
    // SAFETY: the arguments match the kernel's signature; the buffers were checked above.
    unsafe { b.launch(lc) }
        .while_(|| format!("launching {OP} on a {}×{} {} matrix", m.rows, m.cols, m.ty))?;
    Ok(())
}

/// `out[at..at + rows·cols]` = W's weights as BF16 bits, row-major (`at` a multiple of 8).
pub fn launch_dequant(
    dev: &GpuDevice,
    m: &GpuGgml,
    out: &mut CudaSlice<u16>,
    at: usize,
) -> Result<()> {
    launch_dequant_rows(dev, m, 0..m.rows, out, at)
}

/// [`launch_dequant`] of W's rows `rows` only (one expert of a stack).
pub fn launch_dequant_rows(
    dev: &GpuDevice,
    m: &GpuGgml,
    rows: std::ops::Range<usize>,
    out: &mut CudaSlice<u16>,
    at: usize,
) -> Result<()> {
    const OP: &str = "ggml_dequant";
    if rows.end > m.rows || rows.is_empty() {
        return Err(GpuError::invalid(
            OP,
            format!("rows {rows:?} of {}", m.rows),
        ));
    }
    let n = rows.len() * m.cols;
    if at % 8 != 0 {
        return Err(GpuError::invalid(
            OP,
            format!("output offset {at} is not a multiple of 8"),
        ));
    }
    super::check_len(OP, "out", out, at + n)?;
    let stream = dev.stream();
    let (w, _gw) = m.bytes.device_ptr(stream);
    let (o, _go) = out.device_ptr_mut(stream);
    let p = GgmlParams {
        w: w + (rows.start * m.row_bytes) as u64,
        out: o + 2 * at as u64,
        row_bytes: m.row_bytes as i64,
        rows: rows.len() as i32,
        cols: m.cols as i32,
        ..Default::default()
    };
    let lc = LaunchConfig {
        grid_dim: (super::grid_for(n / 8, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, OP, m, p, lc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q6_k_row_pairs_are_split_only_where_the_launch_is_small_and_each_share_has_two_blocks() {
        use GgmlType::*;
        // Llama-3.1-8B's matrices: 14336 rows are 7168 pairs, 4096 rows 2048.
        assert_eq!(split_log2(Q6_K, 7168, 4096, false), 1);
        assert_eq!(split_log2(Q6_K, 2048, 14336, false), 2);
        assert_eq!(split_log2(Q6_K, 2048, 4096, false), 2);
        assert_eq!(split_log2(Q6_K, 8192, 4096, false), 0);
        // Shares of two blocks or more: 4 blocks split in two, 3 blocks not at all.
        assert_eq!(split_log2(Q6_K, 10, 1024, false), 1);
        assert_eq!(split_log2(Q6_K, 10, 768, false), 0);
        // The f32 products summing the activations first, and the one-row types, never; the
        // q8 products (their sums come with the codes) as Q6_K's.
        assert_eq!(split_log2(Q4_K, 2048, 14336, false), 0);
        assert_eq!(split_log2(Q4_K, 2048, 14336, true), 2);
        assert_eq!(split_log2(Q4_K, 7168, 4096, true), 1);
        assert_eq!(split_log2(Q5_K, 10, 1024, false), 0);
        assert_eq!(split_log2(Q8_0, 10, 4096, false), 0);
        // A block of WARPS warps holds whole row pairs, ragged counts of rows included.
        assert_eq!(mv_blocks(Q4_K, 4096, 2), 2048);
        assert_eq!(mv_blocks(Q4_K, 4097, 1), 1025);
        assert_eq!(mv_blocks(Q4_K, 17, 0), 3);
        assert_eq!(mv_blocks(Q8_0, 17, 0), 5);
    }
}
