//! Weight matrices on the GPU. Every linear of the forward pass is a [`GpuLinear`]: batch-1
//! products (decode) run a GEMV, batched products (prefill) a cuBLASLt GEMM. Variants are the
//! storage formats; the dense BF16 one is here, entropy-coded variants add their own arm (their
//! decode-matvec kernel for `matvec`, decode-then-GEMM for `matmul`).
//!
//! [`GpuLinear::Dtans`]: a dtANS-LLM coded matrix ([`GpuDtans`]). Batch 1 runs the fused
//! decode-matvec (`ops::dtans::launch_mvm`); the decode step's fusions are small kernels around it
//! on buffers preallocated in a [`DtansScratch`] shared by all coded matrices of a model (RMSNorm
//! into a scratch input, the product into a scratch output, then residual add or interleaved
//! SwiGLU into the caller's buffer), so the step still captures into one CUDA graph with no
//! allocation. Prefill dequantises the matrix into the scratch's BF16 workspace (one matrix, the
//! largest of the layers) and runs the same cuBLASLt GEMM as the dense path.
//!
//! [`GpuLinear::PalBf16`]: a BF16 matrix palette-packed losslessly ([`GpuPalBf16`], 12 bits a
//! weight): an FP8 checkpoint's LM head when its FP8 matrices are palette-packed. Batch-1
//! products only (the LM head's: decode, and the last prompt token's logits).

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::Coding;
use entrollm_codec::palette::{Palette4, PaletteBf16};
use entrollm_codec::Payload;

use crate::coded::GpuDtans;
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::gemm::Gemm;
use crate::ops::dtans::MAX_SHARED_BYTES;
use crate::ops::dtans::{
    launch_dequant, launch_dequant_at, launch_mvm, launch_mvm_stacked, DtansConfig, DtansKind,
    DtansOut,
};
use crate::ops::elementwise::{launch_residual_add, launch_swiglu, launch_swiglu_pairs};
use crate::ops::forward::{
    launch_gemv_accum, launch_gemv_fused, launch_rmsnorm_f32w, DenseWeights, GemvFusion, NormOut,
};
use crate::ops::gemv::{check_gemv_shape, launch_gemv, GemvConfig};
use crate::ops::gemv_fp8::{
    check_gemv_fp8_shape, check_gemv_pal4_shape, gemv_fp8_config_for, launch_fp8_rows_to_bf16,
    launch_gemv_fp8, launch_gemv_pal_bf16, launch_pal_bf16_rows_to_bf16, pal4_config_for, Fp8Codes,
    GpuPal4, GpuPalBf16,
};
use crate::plan::{Form, LinearDesc};
use crate::tuned::tuned_launches;

/// A row-major BF16 matrix [rows, cols] in device memory and the GEMV configuration of its shape.
pub struct DenseBf16 {
    pub rows: usize,
    pub cols: usize,
    pub w: CudaSlice<u16>,
    pub gemv: GemvConfig,
}

/// Device buffers the coded matrices of one model share (the stream serialises their use): the
/// product before its epilogue, the normalised input, the BF16 dequantisation workspace of
/// prefill, and the kernels' error word (non-zero after an inconsistent stream).
pub struct DtansScratch {
    pub y: CudaSlice<f32>,
    pub xn: CudaSlice<f32>,
    pub w: CudaSlice<u16>,
    pub err: CudaSlice<u32>,
}

impl DtansScratch {
    /// Buffers for products of up to `rows` outputs and `cols` inputs, and a dequantisation
    /// workspace of `weights` BF16 elements (0: no prefill of coded matrices).
    pub fn new(dev: &GpuDevice, rows: usize, cols: usize, weights: usize) -> Result<Self> {
        let s = dev.stream();
        let what = || {
            format!(
                "allocating coded-matrix scratch ({rows} outputs, {cols} inputs, {:.3} GB \
                 dequantisation workspace)",
                weights as f64 * 2e-9
            )
        };
        Ok(DtansScratch {
            y: s.alloc_zeros::<f32>(rows.max(1)).while_(what)?,
            xn: s.alloc_zeros::<f32>(cols.max(1)).while_(what)?,
            w: s.alloc_zeros::<u16>(weights.max(1)).while_(what)?,
            err: s.alloc_zeros::<u32>(1).while_(what)?,
        })
    }

    pub fn bytes(&self) -> usize {
        (self.y.len() + self.xn.len() + self.err.len()) * 4 + self.w.len() * 2
    }
}

/// Scratch shared by the coded matrices of a model.
pub type SharedScratch = Arc<Mutex<DtansScratch>>;

/// A dtANS-LLM coded matrix (one tensor, or row-stacked parts that share a coding: q/k/v, gate and
/// up of a container, run as one multi-matrix launch) and its launch configurations.
pub struct DtansLinear {
    /// The row blocks of the matrix, in order (one for a tensor coded whole).
    pub parts: Vec<GpuDtans>,
    /// (gate, up) stored as halves [gate; up] instead of interleaved rows (SwiGLU epilogue and
    /// prefill read them so).
    pub halves: bool,
    /// Launch of the batch-1 decode-matvec.
    pub mvm: DtansConfig,
    /// Launch of the dequantisation (prefill).
    pub dequant: DtansConfig,
    scratch: SharedScratch,
}

/// An FP8 E4M3 matrix with per-row scales (an FP8 checkpoint's weights), its codes as stored or
/// palette-packed: batch-1 products by the FP8 GEMV, prefill through a BF16 copy in the shared
/// workspace and the GEMM.
pub struct Fp8Linear {
    pub rows: usize,
    pub cols: usize,
    pub codes: Fp8Codes,
    pub scales: CudaSlice<f32>,
    pub gemv: GemvConfig,
    scratch: SharedScratch,
}

/// A dense matrix (BF16, or FP8 codes as stored) with its GEMV configuration: what the decode step
/// chains RMSNorms through.
#[derive(Clone, Copy)]
pub struct ChainLinear<'a> {
    pub w: DenseWeights<'a>,
    pub gemv: GemvConfig,
    pub rows: usize,
    pub cols: usize,
}

/// How a checkpoint's matrices are kept on the device: FP8 ones as `fp8` says; BF16 ones as stored,
/// or with `bf16_palette` palette-packed losslessly ([`GpuLinear::pal_bf16_from_host`]: 12 bits a
/// weight) wherever that packs, the untied LM head too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Serving {
    pub fp8: Fp8Serving,
    pub bf16_palette: bool,
    /// Every matrix as dense BF16, whatever form it is held in (decoded; rounded where its values
    /// are not BF16): the reference the selftests compare the forms against.
    pub decoded: bool,
}

impl Serving {
    /// Every matrix in the form it is held in (a plan's choice, made on the host): FP8 codes as
    /// stored unless held palette-packed, nothing packed at load.
    pub const AS_HELD: Serving = Serving {
        fp8: Fp8Serving::Dense,
        bf16_palette: false,
        decoded: false,
    };

    /// [`Serving::decoded`].
    pub const DECODED: Serving = Serving {
        fp8: Fp8Serving::Dense,
        bf16_palette: false,
        decoded: true,
    };
}

impl From<Fp8Serving> for Serving {
    fn from(fp8: Fp8Serving) -> Self {
        Serving {
            fp8,
            ..Serving::default()
        }
    }
}

/// How an FP8 checkpoint's matrices are kept on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Serving {
    /// Palette-packed where that takes at most [`PALETTE_MAX_RATIO`] of the codes' bytes (a
    /// low-entropy checkpoint: few codes, few escapes) and the columns are a multiple of 32; as
    /// stored otherwise.
    #[default]
    Auto,
    /// The codes as stored.
    Dense,
    /// Palette-packed (an error for a matrix whose columns are not a multiple of 64).
    Palette,
}

/// [`Fp8Serving::Auto`] packs a matrix when the packed form is at most this fraction of its codes'
/// bytes (4 bits a weight is 0.5; each escape adds 4 bytes).
pub const PALETTE_MAX_RATIO: f64 = 0.6;

impl Fp8Serving {
    /// The forms and their names on the command line.
    const NAMES: [(Fp8Serving, &'static str); 3] = [
        (Fp8Serving::Auto, "auto"),
        (Fp8Serving::Dense, "dense"),
        (Fp8Serving::Palette, "palette"),
    ];
}

impl std::str::FromStr for Fp8Serving {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(f, _)| *f)
            .ok_or_else(|| format!("`{s}`: expected auto, dense or palette"))
    }
}

impl std::fmt::Display for Fp8Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = Self::NAMES
            .iter()
            .find(|(s, _)| s == self)
            .map_or("?", |(_, n)| n);
        f.write_str(name)
    }
}

/// One weight matrix W [rows (outputs), cols (inputs)] of the GPU forward pass.
pub enum GpuLinear {
    Dense(DenseBf16),
    Dtans(Box<DtansLinear>),
    Fp8(Box<Fp8Linear>),
    /// A BF16 matrix palette-packed losslessly, and the workspace its prefill copy to BF16 uses.
    PalBf16(Box<GpuPalBf16>, SharedScratch),
}

/// [`GpuLinear::pal_bf16_from_host`] packs a BF16 matrix when the packed form is at most this
/// fraction of its bytes (12 bits a weight is 0.75; each escape adds 4 bytes).
pub const PAL_BF16_MAX_RATIO: f64 = 0.8;

/// A launch configuration of the dtANS kernels for a coded matrix: the tuned one when the shape
/// and coding are in the measured Llama-8B table, else the first of 8/4 warps × unroll 8/4/2 the
/// kernel compiles for (whole companion words per iteration) whose shared memory fits.
pub fn dtans_config_for(
    payload: Payload,
    coding: &Coding,
    rows: usize,
    cols: usize,
    group: Option<usize>,
    out: DtansOut,
) -> Result<DtansConfig> {
    if out == DtansOut::Mvm && group.is_none() {
        if let Some(t) = tuned_launches()
            .into_iter()
            .find(|t| t.1 == rows && t.2 == cols && t.3 == *coding)
        {
            return Ok(t.4);
        }
    }
    let kind = DtansKind::of(payload, coding, cols, group);
    let unrolls: &[u32] = if group.is_some() { &[0] } else { &[0, 4, 2] };
    for warps in [8, 4] {
        for &unroll in unrolls {
            let cfg = DtansConfig {
                unroll,
                ..DtansConfig::warps(warps)
            };
            if cfg.fits(&kind) && kind.shared_bytes(cfg, out) <= MAX_SHARED_BYTES {
                return Ok(cfg);
            }
        }
    }
    Err(GpuError::invalid(
        "dtans linear",
        format!("no kernel launch fits {payload:?} coding {coding} on a {rows}×{cols} matrix"),
    ))
}

/// The GEMV configuration for a shape: the fastest of the measured candidates on the H200 for the
/// Llama-8B launches (bench/RESULTS.md: qkv and down w4r1u8, o and lm_head w4r2u2, gate_up w4r2u4),
/// extended by size to other shapes.
pub fn gemv_config_for(rows: usize, cols: usize) -> GemvConfig {
    let pick = |warps, r, unroll| GemvConfig {
        warps,
        rows: r,
        unroll,
    };
    if cols >= 8192 {
        pick(4, 1, 8) // long rows (down)
    } else if rows >= 65_536 {
        pick(4, 2, 2) // vocabulary-sized (lm_head)
    } else if rows >= 16_384 {
        pick(4, 2, 4) // gate_up
    } else if rows > cols {
        pick(4, 1, 8) // qkv
    } else {
        pick(4, 2, 2) // o and other square-ish shapes
    }
}

/// The GEMV configuration for SwiGLU pairs (a warp holds whole (gate, up) pairs).
pub fn swiglu_config(cfg: GemvConfig) -> GemvConfig {
    if cfg.rows % 2 == 0 {
        cfg
    } else {
        GemvConfig {
            warps: 4,
            rows: 2,
            unroll: 4,
        }
    }
}

/// The GEMV configuration of an FP8 matrix [rows, cols] on a GPU of `sms` SMs, codes as stored or
/// palette-packed, with or without the SwiGLU epilogue.
pub fn fp8_gemv_config(
    palette: bool,
    rows: usize,
    cols: usize,
    sms: u32,
    swiglu: bool,
) -> GemvConfig {
    match (palette, swiglu) {
        (true, _) => pal4_config_for(rows, sms, swiglu),
        (false, true) => swiglu_config(gemv_fp8_config_for(rows, cols)),
        (false, false) => gemv_fp8_config_for(rows, cols),
    }
}

impl GpuLinear {
    /// Uploads a row-major BF16 matrix.
    pub fn dense_from_host(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        bits: &[u16],
    ) -> Result<Self> {
        check_gemv_shape(rows, cols)?;
        if bits.len() != rows * cols {
            return Err(GpuError::invalid(
                "linear",
                format!(
                    "[{rows}, {cols}] needs {} elements, got {}",
                    rows * cols,
                    bits.len()
                ),
            ));
        }
        let w = dev
            .stream()
            .clone_htod(bits)
            .while_(|| format!("uploading a [{rows}, {cols}] BF16 matrix"))?;
        Ok(Self::dense(w, rows, cols))
    }

    /// Wraps a device buffer holding a row-major BF16 matrix.
    pub fn dense(w: CudaSlice<u16>, rows: usize, cols: usize) -> Self {
        GpuLinear::Dense(DenseBf16 {
            rows,
            cols,
            w,
            gemv: gemv_config_for(rows, cols),
        })
    }

    /// Uploads an FP8 E4M3 matrix (row-major codes) with its per-row scales, kept as `form` says;
    /// `scratch` must hold its rows, columns and, for prefill, its weights as BF16.
    pub fn fp8_from_host(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        codes: &[u8],
        scales: &[f32],
        form: Fp8Serving,
        scratch: SharedScratch,
    ) -> Result<Self> {
        check_gemv_fp8_shape(rows, cols)?;
        if codes.len() != rows * cols || scales.len() != rows {
            return Err(GpuError::invalid(
                "fp8 linear",
                format!(
                    "[{rows}, {cols}] needs {} codes and {rows} scales, got {} and {}",
                    rows * cols,
                    codes.len(),
                    scales.len()
                ),
            ));
        }
        let s = dev.stream();
        let what = || format!("uploading a [{rows}, {cols}] FP8 matrix");
        let packed = crate::forms::fp8_palette(codes, rows, cols, form)?;
        let codes = match packed {
            Some(p) => return Self::fp8_packed(dev, &p, scales, scratch),
            None => Fp8Codes::Dense(s.clone_htod(codes).while_(what)?),
        };
        Self::fp8_codes(dev, rows, cols, codes, scales, scratch)
    }

    /// Uploads palette-packed FP8 codes with their per-row scales (see [`Self::fp8_from_host`]).
    pub fn fp8_packed(
        dev: &GpuDevice,
        p: &Palette4,
        scales: &[f32],
        scratch: SharedScratch,
    ) -> Result<Self> {
        check_gemv_pal4_shape(p.rows(), p.cols())?;
        let codes = Fp8Codes::Palette(GpuPal4::upload(dev, p)?);
        Self::fp8_codes(dev, p.rows(), p.cols(), codes, scales, scratch)
    }

    fn fp8_codes(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        codes: Fp8Codes,
        scales: &[f32],
        scratch: SharedScratch,
    ) -> Result<Self> {
        if scales.len() != rows {
            return Err(GpuError::invalid(
                "fp8 linear",
                format!("[{rows}, {cols}] needs {rows} scales, got {}", scales.len()),
            ));
        }
        let s = dev.stream();
        let what = || format!("uploading a [{rows}, {cols}] FP8 matrix's scales");
        let palette = matches!(codes, Fp8Codes::Palette(_));
        let gemv = fp8_gemv_config(palette, rows, cols, dev.info().sm_count, false);
        Ok(GpuLinear::Fp8(Box::new(Fp8Linear {
            rows,
            cols,
            codes,
            gemv,
            scales: s.clone_htod(scales).while_(what)?,
            scratch,
        })))
    }

    /// A BF16 matrix (row-major bits) palette-packed losslessly, or None where its shape does
    /// not pack (columns not a multiple of 64, or 2^16 or more) or, unless `required`, the packed
    /// form is larger than [`PAL_BF16_MAX_RATIO`] of the dense one (high bytes spread over many
    /// values).
    pub fn pal_bf16_from_host(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        bits: &[u16],
        scratch: SharedScratch,
        required: bool,
    ) -> Result<Option<Self>> {
        if check_gemv_pal4_shape(rows, cols).is_err() || bits.len() != rows * cols {
            return Ok(None);
        }
        let p = match PaletteBf16::encode(bits, rows, cols) {
            Ok(p) => p,
            Err(_) => return Ok(None),
        };
        if !required && p.stored_bytes() as f64 > PAL_BF16_MAX_RATIO * (2 * bits.len()) as f64 {
            return Ok(None);
        }
        Self::pal_bf16_packed(dev, &p, scratch).map(Some)
    }

    /// Uploads a palette-packed BF16 matrix.
    pub fn pal_bf16_packed(
        dev: &GpuDevice,
        p: &PaletteBf16,
        scratch: SharedScratch,
    ) -> Result<Self> {
        check_gemv_pal4_shape(p.rows(), p.cols())?;
        Ok(GpuLinear::PalBf16(
            Box::new(GpuPalBf16::upload(dev, p)?),
            scratch,
        ))
    }

    pub fn rows(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.rows,
            GpuLinear::Dtans(c) => c.rows(),
            GpuLinear::Fp8(f) => f.rows,
            GpuLinear::PalBf16(p, _) => p.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.cols,
            GpuLinear::Dtans(c) => c.cols(),
            GpuLinear::Fp8(f) => f.cols,
            GpuLinear::PalBf16(p, _) => p.cols,
        }
    }

    /// What the decode step needs to know of the matrix: its form, shape and launch configuration
    /// (plain data: `crate::plan`).
    pub fn desc(&self) -> LinearDesc {
        let form = match self {
            GpuLinear::Dense(d) => Form::DenseBf16 { gemv: d.gemv },
            GpuLinear::Fp8(f) => match f.codes {
                Fp8Codes::Dense(_) => Form::DenseFp8 { gemv: f.gemv },
                Fp8Codes::Palette(_) => Form::PaletteFp8 { gemv: f.gemv },
            },
            GpuLinear::PalBf16(p, _) => Form::PaletteBf16 { gemv: p.gemv },
            GpuLinear::Dtans(c) => Form::Dtans {
                payload: c.parts[0].payload,
                coding: c.parts[0].coding,
                mvm: c.mvm,
                parts: c.parts.len(),
                halves: c.halves,
            },
        };
        LinearDesc {
            form,
            rows: self.rows(),
            cols: self.cols(),
        }
    }

    /// Whether the decode step normalises x inside this matrix's GEMV ([`LinearDesc::norm_in_gemv`]).
    pub fn norm_in_gemv(&self) -> bool {
        self.desc().norm_in_gemv()
    }

    /// Bytes of device memory the matrix occupies (and reads per batch-1 product).
    pub fn stored_bytes(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.rows * d.cols * 2,
            GpuLinear::Dtans(c) => c.parts.iter().map(|t| t.stored_bytes).sum(),
            GpuLinear::Fp8(f) => f.codes.stored_bytes() + 4 * f.rows,
            GpuLinear::PalBf16(p, _) => p.stored_bytes(),
        }
    }

    /// `y = W x` (or `y += W x` with `accumulate`); x f32 [cols], y f32 [rows].
    pub fn matvec(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) if accumulate => {
                launch_gemv_accum(dev, d.gemv, &d.w, x, y, d.rows, d.cols)
            }
            GpuLinear::Dense(d) => launch_gemv(dev, d.gemv, &d.w, x, y, d.rows, d.cols),
            GpuLinear::Dtans(_) | GpuLinear::Fp8(_) | GpuLinear::PalBf16(..) => {
                let fusion = GemvFusion {
                    accumulate,
                    swiglu: false,
                };
                self.matvec_fused(dev, x, None, fusion, y)
            }
        }
    }

    /// Batch-1 product with the decode step's fusions: `norm` = (weight, eps) normalises x on the
    /// fly (RMSNorm), `accumulate` adds into y (residual), `swiglu` treats the rows as interleaved
    /// (gate, up) pairs and writes silu(gate)·up (rows / 2 outputs).
    pub fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) => {
                let cfg = if fusion.swiglu {
                    swiglu_config(d.gemv)
                } else {
                    d.gemv
                };
                launch_gemv_fused(dev, cfg, fusion, &d.w, x, norm, y, d.rows, d.cols)
            }
            GpuLinear::Dtans(c) => c.matvec_fused(dev, x, norm, fusion, y),
            GpuLinear::Fp8(f) => {
                let cfg = if fusion.swiglu {
                    let palette = matches!(f.codes, Fp8Codes::Palette(_));
                    fp8_gemv_config(palette, f.rows, f.cols, dev.info().sm_count, true)
                } else {
                    f.gemv
                };
                launch_gemv_fp8(
                    dev, cfg, fusion, &f.codes, &f.scales, x, norm, y, f.rows, f.cols,
                )
            }
            GpuLinear::PalBf16(p, _) => launch_gemv_pal_bf16(dev, p.gemv, fusion, p, x, norm, y),
        }
    }

    /// `Y = X Wᵀ` (or `Y += X Wᵀ`) for `m` BF16 input rows; Y f32 [m, rows].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) => gemm.matmul(&d.w, x, y, m, d.rows, d.cols, accumulate),
            GpuLinear::Dtans(c) => {
                let mut s = c.lock();
                let s = &mut *s;
                let (rows, cols) = (c.rows(), c.cols());
                if s.w.len() < rows * cols {
                    return Err(GpuError::invalid(
                        "dtans matmul",
                        format!(
                            "the dequantisation workspace holds {} weights, a {rows}×{cols} \
                             matrix needs {}",
                            s.w.len(),
                            rows * cols
                        ),
                    ));
                }
                if let [t] = &c.parts[..] {
                    launch_dequant(dev, c.dequant, t, &mut s.w, Some(&mut s.err))?;
                } else {
                    let mut off = 0;
                    for t in &c.parts {
                        launch_dequant_at(dev, c.dequant, t, &mut s.w, off, Some(&mut s.err))?;
                        off += t.rows * t.cols;
                    }
                }
                gemm.matmul(&s.w, x, y, m, rows, cols, accumulate)
            }
            GpuLinear::Fp8(f) => {
                let mut s = f.scratch.lock().unwrap_or_else(|e| e.into_inner());
                launch_fp8_rows_to_bf16(dev, &f.codes, &f.scales, &mut s.w, f.rows, f.cols)?;
                gemm.matmul(&s.w, x, y, m, f.rows, f.cols, accumulate)
            }
            GpuLinear::PalBf16(p, scratch) => {
                let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
                launch_pal_bf16_rows_to_bf16(dev, p, &mut s.w)?;
                gemm.matmul(&s.w, x, y, m, p.rows, p.cols, accumulate)
            }
        }
    }

    /// The matrix, when it is stored dense.
    pub fn as_dense(&self) -> Option<&DenseBf16> {
        match self {
            GpuLinear::Dense(d) => Some(d),
            _ => None,
        }
    }

    /// The matrix as the chained-norm GEMVs take it (`launch_gemv_prenorm`,
    /// `launch_gemv_accum_norm`): dense BF16, or FP8 codes as stored.
    pub fn chainable(&self) -> Option<ChainLinear<'_>> {
        match self {
            GpuLinear::Dense(d) => Some(ChainLinear {
                w: DenseWeights::Bf16(&d.w),
                gemv: d.gemv,
                rows: d.rows,
                cols: d.cols,
            }),
            GpuLinear::Fp8(f) => match &f.codes {
                Fp8Codes::Dense(codes) => Some(ChainLinear {
                    w: DenseWeights::Fp8 {
                        codes,
                        scales: &f.scales,
                    },
                    gemv: f.gemv,
                    rows: f.rows,
                    cols: f.cols,
                }),
                Fp8Codes::Palette(_) => None,
            },
            _ => None,
        }
    }

    /// The dense BF16 weights, when the matrix is stored that way (embedding lookups).
    pub fn dense_weights(&self) -> Option<&CudaSlice<u16>> {
        match self {
            GpuLinear::Dense(d) => Some(&d.w),
            _ => None,
        }
    }

    /// The coded tensor, when the matrix is dtANS-coded.
    pub fn dtans(&self) -> Option<&DtansLinear> {
        match self {
            GpuLinear::Dtans(c) => Some(c),
            _ => None,
        }
    }

    /// Wraps an uploaded coded matrix with launch configurations for its shape and coding; the
    /// products use `scratch` (which must hold its rows, columns and, for prefill, its weights).
    pub fn coded(t: GpuDtans, scratch: SharedScratch) -> Result<Self> {
        Self::coded_parts(vec![t], false, scratch)
    }

    /// A matrix of row-stacked coded parts (q/k/v; gate and up with `halves`) that share payload,
    /// coding, columns and groups, so that one launch serves them all.
    pub fn coded_parts(parts: Vec<GpuDtans>, halves: bool, scratch: SharedScratch) -> Result<Self> {
        let t = parts
            .first()
            .ok_or_else(|| GpuError::invalid("dtans linear", "no parts"))?;
        let group = t.groups().map(|g| g.group);
        let (p, c, k) = (t.payload, t.coding, t.cols);
        let r: usize = parts.iter().map(|t| t.rows).sum();
        for u in &parts[1..] {
            if u.payload != p
                || u.coding != c
                || u.cols != k
                || u.groups().map(|g| g.group) != group
            {
                return Err(GpuError::invalid(
                    "dtans linear",
                    format!(
                        "stacked parts must share payload, coding, columns and groups: {p:?} {c} \
                         ×{k} vs {:?} {} ×{}",
                        u.payload, u.coding, u.cols
                    ),
                ));
            }
        }
        if parts.len() > crate::ops::dtans::MAX_MATS || (halves && parts.len() != 2) {
            return Err(GpuError::invalid(
                "dtans linear",
                format!("{} stacked parts (halves: {halves})", parts.len()),
            ));
        }
        let mvm = dtans_config_for(p, &c, r, k, group, DtansOut::Mvm)?;
        let dequant = dtans_config_for(p, &c, r, k, group, DtansOut::Dequant)?;
        {
            let s = scratch.lock().unwrap_or_else(|e| e.into_inner());
            if s.y.len() < r || s.xn.len() < k {
                return Err(GpuError::invalid(
                    "dtans linear",
                    format!(
                        "scratch of {} outputs / {} inputs is too small for {r}×{k}",
                        s.y.len(),
                        s.xn.len()
                    ),
                ));
            }
        }
        Ok(GpuLinear::Dtans(Box::new(DtansLinear {
            parts,
            halves,
            mvm,
            dequant,
            scratch,
        })))
    }

    /// Whether gate/up rows are stored as halves [gate; up] (a container's separate tensors)
    /// rather than interleaved: prefill then applies SwiGLU to halves.
    pub fn gate_up_halves(&self) -> bool {
        matches!(self, GpuLinear::Dtans(c) if c.halves)
    }
}

impl DtansLinear {
    pub fn rows(&self) -> usize {
        self.parts.iter().map(|t| t.rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.parts[0].cols
    }

    /// Other coded parts of the same shapes and coding with these launches and scratch.
    pub fn with_parts(&self, parts: Vec<GpuDtans>) -> DtansLinear {
        DtansLinear {
            parts,
            halves: self.halves,
            mvm: self.mvm,
            dequant: self.dequant,
            scratch: Arc::clone(&self.scratch),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DtansScratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mvm_into(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        err: &mut CudaSlice<u32>,
    ) -> Result<()> {
        if let [t] = &self.parts[..] {
            launch_mvm(dev, self.mvm, &[t], x, &mut [y], Some(err))
        } else {
            let mats: Vec<&GpuDtans> = self.parts.iter().collect();
            launch_mvm_stacked(dev, self.mvm, &mats, x, y, Some(err))
        }
    }

    /// The batch-1 product with the engine's fusions (see [`GpuLinear::matvec_fused`]).
    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (rows, cols) = (self.rows(), self.cols());
        if fusion.swiglu && rows % 2 != 0 {
            return Err(GpuError::invalid(
                "dtans matvec",
                format!("SwiGLU needs (gate, up) row pairs, the matrix has {rows} rows"),
            ));
        }
        let mut guard = self.lock();
        let DtansScratch { y: sy, xn, err, .. } = &mut *guard;
        let input: &CudaSlice<f32> = match norm {
            Some((w, eps)) => {
                launch_rmsnorm_f32w(dev, x, w, NormOut::F32(xn), 1, cols, eps)?;
                xn
            }
            None => x,
        };
        let plain = !fusion.accumulate && !fusion.swiglu;
        if plain {
            return self.mvm_into(dev, input, y, err);
        }
        if fusion.accumulate && fusion.swiglu {
            return Err(GpuError::invalid(
                "dtans matvec",
                "accumulating a SwiGLU output is not supported",
            ));
        }
        self.mvm_into(dev, input, sy, err)?;
        if fusion.swiglu && self.halves {
            launch_swiglu(dev, sy, y, 1, rows / 2)
        } else if fusion.swiglu {
            launch_swiglu_pairs(dev, sy, y, rows / 2)
        } else {
            launch_residual_add(dev, y, sy, rows)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama8b_shapes_get_their_measured_configs() {
        let s = |r, c| gemv_config_for(r, c).to_string();
        assert_eq!(s(6144, 4096), "w4r1u8");
        assert_eq!(s(4096, 4096), "w4r2u2");
        assert_eq!(s(28_672, 4096), "w4r2u4");
        assert_eq!(s(4096, 14_336), "w4r1u8");
        assert_eq!(s(128_256, 4096), "w4r2u2");
    }
}
