//! Batch-1 dense FP8 E4M3 GEMV with per-row scales (`gemv_fp8` in `kernels/gemv.cu`):
//! `y[r] = s[r] · Σ_c fp8(W[r, c]) x[c]`, W row-major [n, k] bytes (k % 16 == 0), s f32 [n], x and
//! y f32; the epilogues of the BF16 GEMV (residual add, interleaved SwiGLU, RMSNorm of x on the
//! fly). The kernels share the BF16 GEMV's compiled modules ([`gemv_fused_variant`]). CPU
//! reference: the model crate's `RowScaled(DenseFp8)` matvec ([`gemv_fp8_ref`]). Also the FP8 → BF16
//! materialisation of a matrix for prefill GEMMs (`fp8_rows_to_bf16`, [`fp8_rows_to_bf16_ref`]).
//!
//! The codes travel in one of two forms (`forms::fp8::Fp8Codes`, with their launchers): as stored
//! (`gemv_fp8`), or palette-packed
//! (codec `palette::Palette4`, `gemv_pal4`: 4-bit indices into 16 codes plus escapes, half the
//! bytes, for low-entropy checkpoints; the products on the tensor cores, with x in two BF16
//! halves). Same epilogues, same references: the packed form decodes to the same codes.
//!
//! The palette kernel also takes BF16 matrices losslessly ([`GpuPalBf16`], codec [`PaletteBf16`]:
//! the high bytes as 4-bit indices, the low bytes as stored, 12 bits a weight; `gemv_pal4_bf16`,
//! PAL4_BF16): what an FP8 checkpoint's BF16 LM head is served as when its FP8 matrices are
//! palette-packed. CPU reference: the dense BF16 product of the decoded values.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
use entrollm_codec::palette::{Palette4, PaletteBf16, BLOCK_COLS, TILE_ROWS};
use entrollm_codec::payload::fp8_e4m3_to_f32;
use entrollm_model::weights::{DenseFp8, RowScaled};
use entrollm_model::Linear;

use super::check_len;
use super::forward::{check_swiglu_rows, gemv_fused_variant, GemvFusion};
use super::gemv::{check_chunked_shape, GemvConfig};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::KernelVariant;

/// Checks a dense FP8 GEMV shape: k a multiple of 16 (16-byte aligned rows of one-byte weights).
pub fn check_gemv_fp8_shape(n: usize, k: usize) -> Result<()> {
    check_chunked_shape("gemv_fp8", n, k, 16)
}

/// A palette-packed FP8 matrix on the device (codec [`Palette4`]): indices (tiles of 16 rows ×
/// cols / 2 bytes), the 16 palette codes (kernel arguments, not device memory), escape offsets
/// [rows + 1] and escapes (never empty: one unused entry when there are none).
pub struct GpuPal4 {
    pub idx: CudaSlice<u8>,
    pub codes: Pal4Codes,
    pub esc_ptr: CudaSlice<u32>,
    pub esc: CudaSlice<u32>,
    /// Escaped weights.
    pub escapes: usize,
}

/// The 16 palette codes as a kernel argument: four little-endian words (the kernel's `uint4`).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug)]
pub struct Pal4Codes([u32; 4]);

// SAFETY: plain data with the size and alignment of the kernel's `uint4` parameter.
unsafe impl DeviceRepr for Pal4Codes {}

impl Pal4Codes {
    pub fn new(codes: &[u8; 16]) -> Self {
        Pal4Codes(std::array::from_fn(|i| {
            u32::from_le_bytes([
                codes[4 * i],
                codes[4 * i + 1],
                codes[4 * i + 2],
                codes[4 * i + 3],
            ])
        }))
    }
}

impl GpuPal4 {
    pub fn upload(dev: &GpuDevice, p: &Palette4) -> Result<Self> {
        check_gemv_pal4_shape(p.rows(), p.cols())?;
        let s = dev.stream();
        let what = || {
            format!(
                "uploading a [{}, {}] palette-packed FP8 matrix",
                p.rows(),
                p.cols()
            )
        };
        let esc: &[u32] = if p.escapes().is_empty() {
            &[0]
        } else {
            p.escapes()
        };
        Ok(GpuPal4 {
            idx: s.clone_htod(p.indices()).while_(what)?,
            codes: Pal4Codes::new(p.palette()),
            esc_ptr: s.clone_htod(p.row_ptr()).while_(what)?,
            esc: s.clone_htod(esc).while_(what)?,
            escapes: p.escapes().len(),
        })
    }

    /// A device copy.
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<Self> {
        let s = dev.stream();
        let what = || "copying a palette-packed FP8 matrix".to_string();
        Ok(GpuPal4 {
            idx: s.clone_dtod(&self.idx).while_(what)?,
            codes: self.codes,
            esc_ptr: s.clone_dtod(&self.esc_ptr).while_(what)?,
            esc: s.clone_dtod(&self.esc).while_(what)?,
            escapes: self.escapes,
        })
    }
}

/// A BF16 matrix palette-packed losslessly on the device (codec [`PaletteBf16`]): high-byte
/// indices in the FP8 palette layout, the 16 high bytes (kernel argument), escape offsets and
/// escapes (never empty), and the low bytes.
pub struct GpuPalBf16 {
    pub rows: usize,
    pub cols: usize,
    pub idx: CudaSlice<u8>,
    pub codes: Pal4Codes,
    pub esc_ptr: CudaSlice<u32>,
    pub esc: CudaSlice<u32>,
    pub lo: CudaSlice<u8>,
    /// Escaped weights.
    pub escapes: usize,
    pub gemv: GemvConfig,
}

impl GpuPalBf16 {
    pub fn upload(dev: &GpuDevice, p: &PaletteBf16) -> Result<Self> {
        let (rows, cols) = (p.rows(), p.cols());
        check_gemv_pal4_shape(rows, cols)?;
        let s = dev.stream();
        let what = || format!("uploading a [{rows}, {cols}] palette-packed BF16 matrix");
        let esc: &[u32] = if p.escapes().is_empty() {
            &[0]
        } else {
            p.escapes()
        };
        Ok(GpuPalBf16 {
            rows,
            cols,
            idx: s.clone_htod(p.indices()).while_(what)?,
            codes: Pal4Codes::new(p.palette()),
            esc_ptr: s.clone_htod(p.row_ptr()).while_(what)?,
            esc: s.clone_htod(esc).while_(what)?,
            lo: s.clone_htod(p.low()).while_(what)?,
            escapes: p.escapes().len(),
            gemv: pal_bf16_config_for(rows, dev.info().sm_count),
        })
    }

    /// Bytes a batch-1 product reads: indices, low bytes, palette, escape offsets and escapes.
    pub fn stored_bytes(&self) -> usize {
        self.idx.len() + self.lo.len() + 16 + 4 * (self.esc_ptr.len() + self.escapes)
    }

    /// A device copy.
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<Self> {
        let s = dev.stream();
        let what = || {
            format!(
                "copying a [{}, {}] palette-packed BF16 matrix",
                self.rows, self.cols
            )
        };
        Ok(GpuPalBf16 {
            rows: self.rows,
            cols: self.cols,
            idx: s.clone_dtod(&self.idx).while_(what)?,
            codes: self.codes,
            esc_ptr: s.clone_dtod(&self.esc_ptr).while_(what)?,
            esc: s.clone_dtod(&self.esc).while_(what)?,
            lo: s.clone_dtod(&self.lo).while_(what)?,
            escapes: self.escapes,
            gemv: self.gemv,
        })
    }
}

/// Checks a palette-packed GEMV shape: k a multiple of 64 (whole column blocks of the tiles), and
/// x small enough to sit in shared memory beside the lookup table in every configuration (k ≤ 40 128).
pub fn check_gemv_pal4_shape(n: usize, k: usize) -> Result<()> {
    check_chunked_shape("gemv_pal4", n, k, BLOCK_COLS)?;
    if PAL4_CANDIDATES
        .iter()
        .any(|&c| pal4_shared_bytes(c, k).is_none())
    {
        return Err(GpuError::invalid(
            "gemv_pal4",
            format!("k = {k}: x does not fit in shared memory beside the lookup table"),
        ));
    }
    Ok(())
}

/// Bytes of a palette-packed matrix's indices: rows rounded up to whole 16-row tiles.
pub fn pal4_index_bytes(rows: usize, cols: usize) -> usize {
    rows.div_ceil(TILE_ROWS) * TILE_ROWS * cols / 2
}

/// Dynamic shared memory of `gemv_pal4` in configuration `cfg` (kernels/gemv.cu, PAL4_BASE): the
/// pair table (256 entries × 256 bytes), the warps' and groups' sums and x's two BF16 halves; None
/// past the 227 KiB a block may have.
fn pal4_shared_bytes(cfg: GemvConfig, k: usize) -> Option<usize> {
    let (warps, groups) = (cfg.warps as usize, cfg.rows as usize);
    let sums = ((2 * (warps + groups) * 2 * TILE_ROWS + warps) * 4).next_multiple_of(16);
    let bytes = 256 * 256 + sums + 4 * k;
    (bytes <= 227 * 1024).then_some(bytes)
}

/// The launch configuration for an FP8 shape. A 16-byte chunk holds 16 weights (8 for BF16), so
/// rows have half the chunks of BF16 ones: more rows per warp keep as many bytes in flight, except
/// on matrices too short to give every SM several warps. Rows per warp stay even (SwiGLU pairs).
pub fn gemv_fp8_config_for(rows: usize, cols: usize) -> GemvConfig {
    let (r, unroll) = if cols >= 8192 || rows < 4096 {
        (2, 4)
    } else {
        (4, 2)
    };
    GemvConfig {
        warps: 4,
        rows: r,
        unroll,
    }
}

/// The palette launch for `rows` rows on a GPU of `sms` SMs: the fewest tile-pair groups a block
/// (1, 2, 4, 7 or 8) that need at most one block an SM — each block fills its lookup table and x's
/// halves first, so fewer blocks on a short matrix do less of that; 7 groups (of two warps: 14 a
/// block) where 8 would leave SMs idle (the Llama-8B gate/up projection: 896 pairs on 128 SMs
/// instead of 112) — with two column blocks in flight a warp; where even 8 groups need more blocks
/// than SMs, one column block (registers for two blocks an SM). Short launches stay at one block an
/// SM on purpose: in the decode graph (programmatic dependent launch) a launch starts while its
/// predecessor's blocks finish, and blocks that could sit two to an SM pile onto the SMs that free
/// first — with one column block in flight everywhere (64 registers, two blocks an SM) the 8B FP8
/// decode measured 357 tok/s under PDL and 414 without (bench/RESULTS.md, session 7).
pub fn pal4_config_for(rows: usize, sms: u32, swiglu: bool) -> GemvConfig {
    let pairs = rows.div_ceil(2 * TILE_ROWS);
    let groups = [1, 2, 4, 7, 8]
        .into_iter()
        .find(|&g| pairs.div_ceil(g) <= sms as usize)
        .unwrap_or(8);
    let unroll = if pairs.div_ceil(groups) > sms as usize && !swiglu {
        1
    } else {
        2
    };
    match groups {
        7 => PAL4_W14R7,
        g => pal4(g as u32, unroll),
    }
}

/// A launch configuration of palette-packed matrices: 16 warps a (persistent) block, in `rows`
/// groups that each work on a pair of 16-row tiles at a time, each warp with `unroll` column
/// blocks of both tiles (2 × 16 × 64 weights) in flight.
const fn pal4(rows: u32, unroll: u32) -> GemvConfig {
    GemvConfig {
        warps: 16,
        rows,
        unroll,
    }
}

/// Seven groups of two warps, two column blocks in flight.
const PAL4_W14R7: GemvConfig = GemvConfig {
    warps: 14,
    rows: 7,
    unroll: 2,
};

/// The launch for a BF16 palette-packed matrix: [`pal4_config_for`]'s groups with one column
/// block in flight a warp (the low bytes triple what a block holds in registers).
pub fn pal_bf16_config_for(rows: usize, sms: u32) -> GemvConfig {
    GemvConfig {
        unroll: 1,
        ..pal4_config_for(rows, sms, false)
    }
}

/// Every configuration [`pal_bf16_config_for`] gives (compiled by CI, covered by the selftest).
pub const PAL_BF16_CANDIDATES: [GemvConfig; 5] = [
    pal4(1, 1),
    pal4(2, 1),
    pal4(4, 1),
    GemvConfig {
        warps: 14,
        rows: 7,
        unroll: 1,
    },
    pal4(8, 1),
];

/// The module of `gemv_pal4_bf16` in configuration `cfg` with `fusion`'s epilogue.
pub fn pal_bf16_variant(cfg: GemvConfig, fusion: GemvFusion) -> KernelVariant {
    let mut v = gemv_fused_variant(cfg, fusion);
    v.defines.push(("PAL4_BF16", 1));
    v
}

/// The palette GEMV's configurations the timing sweep and the selftest cover (compiled with every
/// epilogue they allow: `ops::forward::all_variants`).
pub const PAL4_CANDIDATES: [GemvConfig; 7] = [
    pal4(1, 2),
    pal4(2, 2),
    pal4(4, 2),
    pal4(8, 2),
    pal4(8, 1),
    pal4(2, 1),
    PAL4_W14R7,
];

/// The palette and FP8 GEMVs' arguments after x: the norm weight (with `norm`), y, n, k, then eps
/// (with `norm`); the norm weight's length checked against k.
pub(crate) fn push_norm_y<'a>(
    op: &'static str,
    b: &mut cudarc::driver::LaunchArgs<'a>,
    norm: &'a Option<(&'a CudaSlice<f32>, f32)>,
    y: &'a mut CudaSlice<f32>,
    n: &'a i32,
    k: &'a i32,
) -> Result<()> {
    if let Some((g, _)) = norm {
        check_len(op, "norm weight", *g, *k as usize)?;
        b.arg(*g);
    }
    b.arg(y).arg(n).arg(k);
    if let Some((_, eps)) = norm {
        b.arg(eps);
    }
    Ok(())
}

/// The launch of a palette kernel `f` (`gemv_pal4*`): persistent blocks over the 16-row tiles
/// (each builds a 64 KiB lookup table first), as many as fit at once, with the shared memory
/// [`pal4_shared_bytes`] gives.
pub(crate) fn pal4_launch(
    dev: &GpuDevice,
    f: &cudarc::driver::CudaFunction,
    kernel: &str,
    cfg: GemvConfig,
    n: usize,
    k: usize,
) -> Result<cudarc::driver::LaunchConfig> {
    let shared = pal4_shared_bytes(cfg, k).ok_or_else(|| {
        GpuError::invalid(
            "gemv_pal4",
            format!("{cfg}: k = {k} does not fit in shared memory beside the table"),
        )
    })?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shared as i32,
    )
    .while_(|| format!("allowing {shared} bytes of shared memory for {kernel}"))?;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(cfg.warps * 32, shared, None)
        .while_(|| format!("querying the occupancy of {kernel} {cfg}"))?;
    let pairs = n.div_ceil(2 * TILE_ROWS);
    let blocks = pairs.div_ceil(cfg.rows as usize) as u32;
    let mut launch = cfg.launch(n);
    launch.grid_dim.0 = blocks.min(per_sm.max(1) * dev.info().sm_count);
    launch.shared_mem_bytes = shared as u32;
    Ok(launch)
}

/// `y = W · rmsnorm(x; g, eps)` (when `norm` is given, else `W x`) with `fusion`'s epilogue, W a
/// BF16 palette-packed [`GpuPalBf16`] [n, k], x f32 [k], y f32 [n] (n/2 with swiglu); in
/// configuration `cfg` (one of [`PAL_BF16_CANDIDATES`]; the matrix's own is `w.gemv`).
pub fn launch_gemv_pal_bf16(
    dev: &GpuDevice,
    cfg: GemvConfig,
    fusion: GemvFusion,
    w: &GpuPalBf16,
    x: &CudaSlice<f32>,
    norm: Option<(&CudaSlice<f32>, f32)>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "gemv_pal4_bf16";
    let (n, k) = (w.rows, w.cols);
    check_gemv_pal4_shape(n, k)?;
    check_len(OP, "indices", &w.idx, pal4_index_bytes(n, k))?;
    check_len(OP, "low bytes", &w.lo, 2 * pal4_index_bytes(n, k))?;
    check_len(OP, "escape offsets", &w.esc_ptr, n + 1)?;
    check_len(OP, "escapes", &w.esc, w.escapes.max(1))?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, if fusion.swiglu { n / 2 } else { n })?;
    check_swiglu_rows(OP, fusion, n)?;
    if cfg.unroll != 1 || cfg.rows > 15 || cfg.warps % cfg.rows != 0 {
        return Err(GpuError::invalid(
            OP,
            format!(
                "{cfg}: the BF16 palette GEMV needs one column block in flight and whole groups"
            ),
        ));
    }
    let kernel = if norm.is_some() {
        "gemv_pal4_bf16_norm"
    } else {
        "gemv_pal4_bf16"
    };
    let f = dev.function(&pal_bf16_variant(cfg, fusion), kernel)?;
    let launch = pal4_launch(dev, &f, kernel, cfg, n, k)?;
    let (n_i, k_i) = (n as i32, k as i32);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&w.idx)
        .arg(&w.codes)
        .arg(&w.esc_ptr)
        .arg(&w.esc)
        .arg(&w.lo)
        .arg(x);
    push_norm_y(OP, &mut b, &norm, y, &n_i, &k_i)?;
    // SAFETY: argument types and counts match the kernel chosen above; sizes were checked.
    unsafe { b.launch(launch) }.while_(|| format!("launching {kernel} {cfg} [{n}, {k}]"))?;
    Ok(())
}

/// What the copies of a matrix to BF16 for prefill share: the output's size checked, their module,
/// and the launch of a grid-stride loop over `units` (enough blocks to fill any GPU, no more).
pub(crate) fn bf16_copy_launch(
    op: &'static str,
    out: &CudaSlice<u16>,
    rows: usize,
    cols: usize,
) -> Result<(
    KernelVariant,
    impl Fn(usize) -> cudarc::driver::LaunchConfig,
)> {
    if out.len() < rows * cols {
        return Err(GpuError::invalid(
            op,
            format!("output holds {} elements, needs {}", out.len(), rows * cols),
        ));
    }
    let variant = gemv_fused_variant(GemvConfig::CANDIDATES[0], GemvFusion::default());
    let grid = |units: usize| cudarc::driver::LaunchConfig {
        grid_dim: (units.div_ceil(256).min(132 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((variant, grid))
}

/// `out = W`: a BF16 palette-packed matrix's values (BF16 bits, [rows, cols], bit for bit the
/// codec's `PaletteBf16::decode`), materialised for the prefill GEMM.
pub fn launch_pal_bf16_rows_to_bf16(
    dev: &GpuDevice,
    w: &GpuPalBf16,
    out: &mut CudaSlice<u16>,
) -> Result<()> {
    const OP: &str = "pal4_bf16_rows_to_bf16";
    let (rows, cols) = (w.rows, w.cols);
    check_len(OP, "indices", &w.idx, pal4_index_bytes(rows, cols))?;
    check_len(OP, "low bytes", &w.lo, 2 * pal4_index_bytes(rows, cols))?;
    let (variant, grid) = bf16_copy_launch(OP, out, rows, cols)?;
    let what = |k: &str| format!("launching {k} [{rows}, {cols}]");
    let words = (pal4_index_bytes(rows, cols) / 4) as i64;
    let (r_i, c_i) = (rows as i32, cols as i32);
    let f = dev.function(&variant, OP)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&w.idx)
        .arg(&w.codes)
        .arg(&w.lo)
        .arg(&mut *out)
        .arg(&words)
        .arg(&r_i)
        .arg(&c_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(grid(words as usize)) }.while_(|| what(OP))?;
    if w.escapes > 0 {
        let f = dev.function(&variant, "pal4_bf16_escapes_to_bf16")?;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&w.esc_ptr)
            .arg(&w.esc)
            .arg(&mut *out)
            .arg(&r_i)
            .arg(&c_i);
        // SAFETY: as above.
        unsafe { b.launch(grid(rows)) }.while_(|| what("pal4_bf16_escapes_to_bf16"))?;
    }
    Ok(())
}

/// CPU reference of `forms::fp8::launch_fp8_rows_to_bf16`: each
/// weight's f32 value times its row's scale,
/// rounded to BF16 (nearest even).
pub fn fp8_rows_to_bf16_ref(w: &[u8], scales: &[f32], cols: usize) -> Vec<u16> {
    w.chunks(cols)
        .zip(scales)
        .flat_map(|(row, &s)| {
            row.iter()
                .map(move |&c| half::bf16::from_f32(fp8_e4m3_to_f32(c) * s).to_bits())
        })
        .collect()
}

/// CPU reference: the model crate's row-scaled dense FP8 matrix, `y = diag(s) · W x`.
pub fn gemv_fp8_ref(w: &[u8], scales: &[f32], x: &[f32], n: usize, k: usize) -> Result<Vec<f32>> {
    if x.len() != k {
        return Err(GpuError::invalid(
            "gemv_fp8_ref",
            format!("x has {} elements, the matrix {k} columns", x.len()),
        ));
    }
    let dense = DenseFp8::new("gemv_fp8_ref", n, k, w.to_vec())
        .map_err(|e| GpuError::invalid("gemv_fp8_ref", e.to_string()))?;
    let m = RowScaled::new("gemv_fp8_ref", Arc::new(dense), scales.to_vec())
        .map_err(|e| GpuError::invalid("gemv_fp8_ref", e.to_string()))?;
    let mut y = vec![0f32; n];
    m.matvec(x, &mut y);
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_shapes_are_checked() {
        assert!(check_gemv_fp8_shape(4096, 4096).is_ok());
        assert!(check_gemv_fp8_shape(4096, 4104).is_err());
        assert!(check_gemv_fp8_shape(0, 16).is_err());
        assert!(check_gemv_fp8_shape(1 << 31, 16).is_err());
    }

    #[test]
    fn fp8_ref_applies_row_scales() {
        // 0x38 = 1.0, 0x40 = 2.0, 0xC0 = -2.0 in E4M3.
        let w = [0x38u8, 0x40, 0xC0, 0x38].repeat(4);
        let x = vec![1.0f32; 8];
        let y = gemv_fp8_ref(&w, &[0.5, 2.0], &x, 2, 8).unwrap();
        assert!(gemv_fp8_ref(&w, &[0.5, 2.0], &x[..7], 2, 8).is_err());
        assert_eq!(y, vec![0.5 * 4.0, 2.0 * 4.0]);
    }

    #[test]
    fn pal4_shared_memory_rule() {
        // 16 warps in 4 groups: 5184 bytes of sums; two blocks an SM at k = 4096, Llama-70B's
        // 28 672 fits.
        assert_eq!(
            pal4_shared_bytes(pal4(4, 1), 4096),
            Some(65_536 + 5184 + 16_384)
        );
        assert!(2 * pal4_shared_bytes(pal4(8, 1), 4096).unwrap() <= 227 * 1024);
        assert!(check_gemv_pal4_shape(8192, 28_672).is_ok());
        assert!(check_gemv_pal4_shape(8192, 40_128).is_ok());
        assert!(check_gemv_pal4_shape(8192, 40_192).is_err());
        assert!(check_gemv_pal4_shape(64, 4128).is_err(), "k % 64");
        assert_eq!(pal4_index_bytes(17, 128), 32 * 64);
    }

    #[test]
    fn palette_codes_pack_little_endian() {
        let codes: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        let p = Pal4Codes::new(&codes);
        assert_eq!(p.0[0], 0x3322_1100);
        assert_eq!(p.0[3], 0xffee_ddcc);
        assert_eq!(std::mem::size_of::<Pal4Codes>(), 16);
        assert_eq!(std::mem::align_of::<Pal4Codes>(), 16);
    }

    #[test]
    fn pal4_configs_fill_the_gpu() {
        // Llama-8B on 132 SMs: qkv 2 groups, o and down 1, gate_up 7 (128 blocks), lm_head 8 with
        // one column block in flight (two blocks an SM).
        assert_eq!(pal4_config_for(128_256, 132, false).unroll, 1);
        assert_eq!(pal4_config_for(28_672, 132, true).unroll, 2);
        assert_eq!(pal4_config_for(6144, 132, false).rows, 2);
        assert_eq!(pal4_config_for(4096, 132, false).rows, 1);
        assert_eq!(pal4_config_for(4096, 132, true).rows, 1);
        assert_eq!(pal4_config_for(28_672, 132, true), PAL4_W14R7);
        assert_eq!(pal4_config_for(128_256, 132, false).rows, 8);
        for rows in [1, 16, 1000, 28_672, 1 << 20] {
            for swiglu in [false, true] {
                let c = pal4_config_for(rows, 132, swiglu);
                assert!(PAL4_CANDIDATES.contains(&c), "{c}");
            }
        }
    }

    #[test]
    fn pal_bf16_configs_are_compiled_candidates() {
        for rows in [1, 16, 4096, 28_672, 128_256, 1 << 20] {
            let c = pal_bf16_config_for(rows, 132);
            assert!(PAL_BF16_CANDIDATES.contains(&c), "{c}");
            assert_eq!(c.unroll, 1);
        }
        assert_eq!(pal_bf16_config_for(128_256, 132).rows, 8);
    }

    #[test]
    fn fp8_configs_fit_swiglu() {
        for (n, k) in [(28_672, 4096), (6144, 4096), (4096, 14_336), (64, 4096)] {
            assert_eq!(gemv_fp8_config_for(n, k).rows % 2, 0);
        }
    }
}
