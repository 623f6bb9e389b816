//! Weight matrices on the GPU. Every linear of the forward pass is a [`GpuLinear`]: a device
//! matrix of one of the GPU forms (`crate::forms`, one module each: dense BF16, FP8 as stored or
//! palette-packed, BF16 palette-packed, dtANS-coded), behind the [`GpuMatrix`] trait. Batch-1
//! products (decode) run the form's GEMV or decode-matvec with the decode step's fusions, batched
//! products (prefill) a cuBLASLt GEMM. This module holds what the forms share: the trait, the
//! coded matrices' scratch, the serving options and the launch configurations by shape.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use entrollm_codec::dtans::Coding;
use entrollm_codec::Payload;

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::gemm::Gemm;
use crate::ops::dtans::MAX_SHARED_BYTES;
use crate::ops::dtans::{DtansConfig, DtansKind, DtansOut};
use crate::ops::forward::{DenseWeights, Gather, GemvFusion};
use crate::ops::gemv::GemvConfig;
use crate::ops::gemv_fp8::{gemv_fp8_config_for, pal4_config_for};
use crate::plan::LinearDesc;
use crate::tuned::tuned_launches;

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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Serving {
    pub fp8: Fp8Serving,
    pub bf16_palette: bool,
    /// Every matrix as dense BF16, whatever form it is held in (decoded; rounded where its values
    /// are not BF16): the reference the selftests compare the forms against.
    pub decoded: bool,
    /// Launch configurations a plan chose (from its tune file), by launch id.
    pub launches: LaunchChoices,
}

/// Launch configurations by launch id (`layers.3.qkv`, `lm_head`: a tune file's ids), each as
/// its form spells it ([`GpuMatrix::launch_configs`]); launches it does not name keep their form's
/// default for their shape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchChoices(Option<Arc<std::collections::BTreeMap<String, String>>>);

impl LaunchChoices {
    pub fn get(&self, id: &str) -> Option<&str> {
        self.0.as_ref()?.get(id).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FromIterator<(String, String)> for LaunchChoices {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(it: I) -> Self {
        let m: std::collections::BTreeMap<_, _> = it.into_iter().collect();
        LaunchChoices((!m.is_empty()).then(|| Arc::new(m)))
    }
}

impl Serving {
    /// Every matrix in the form it is held in (a plan's choice, made on the host): FP8 codes as
    /// stored unless held palette-packed, nothing packed at load.
    pub const AS_HELD: Serving = Serving {
        fp8: Fp8Serving::Dense,
        bf16_palette: false,
        decoded: false,
        launches: LaunchChoices(None),
    };

    /// [`Serving::decoded`].
    pub const DECODED: Serving = Serving {
        fp8: Fp8Serving::Dense,
        bf16_palette: false,
        decoded: true,
        launches: LaunchChoices(None),
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

/// One weight matrix W [rows (outputs), cols (inputs)] of the GPU forward pass, in one of the GPU
/// forms (`crate::forms`: each module implements [`GpuMatrix`] for its device type).
pub struct GpuLinear(Box<dyn GpuMatrix>);

/// What a GPU form's device matrix does: its description for the decode plan, its size, and its
/// products. Batch-1 products (decode) are the form's GEMV or decode-matvec with the decode step's
/// fusions; batched products (prefill) a cuBLASLt GEMM, on the weights or on a BF16 copy.
pub trait GpuMatrix: Send + Sync {
    /// Form, shape and launch configuration (plain data: `crate::plan`).
    fn desc(&self) -> LinearDesc;
    /// Bytes of device memory the matrix occupies (and reads per batch-1 product).
    fn stored_bytes(&self) -> usize;
    /// Bytes of device memory allocated for it (its arrays' allocations may round up).
    fn device_bytes(&self) -> usize {
        self.stored_bytes()
    }
    /// Whether its values are entropy-coded (counted apart from the dense matrices in
    /// [`crate::GpuModel::coded_summary`]).
    fn entropy_coded(&self) -> bool {
        false
    }
    /// `y = W x` (or `y += W x` with `accumulate`); x f32 [cols], y f32 [rows].
    fn matvec(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let fusion = GemvFusion {
            accumulate,
            swiglu: false,
        };
        self.matvec_fused(dev, x, None, fusion, y)
    }
    /// Batch-1 product with the decode step's fusions: `norm` = (weight, eps) normalises x on the
    /// fly (RMSNorm), `accumulate` adds into y (residual), `swiglu` treats the rows as (gate, up)
    /// pairs and writes silu(gate)·up (rows / 2 outputs).
    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()>;
    /// `Y = X Wᵀ` (or `Y += X Wᵀ`) for `m` BF16 input rows; Y f32 [m, rows].
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// Gathered batch-1 products over this matrix as a stack of `g.n_experts` equal matrices
    /// (expert e's rows from e · rows / n_experts: a mixture of experts' gate/up or down): slot s
    /// of `g` multiplies its expert by input row s / x_group into `y[s · out ..]`, out an expert's
    /// rows, or half of them with `swiglu` ((gate, up) rows as the form stacks them). The expert
    /// indices are read on the device (the router's top-k), so the step needs no host sync. An
    /// error for a form without a gathered product.
    fn gathered(
        &self,
        _dev: &GpuDevice,
        _g: Gather<'_>,
        _x: &CudaSlice<f32>,
        _swiglu: bool,
        _y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Err(no_experts(self.desc().form_name()))
    }
    /// Prefill: `Y = X W_eᵀ` for expert `e` of the stack ([`GpuMatrix::gathered`]), X BF16
    /// `[m, cols]`, Y f32 `[m, expert rows]`.
    #[allow(clippy::too_many_arguments)]
    fn expert_matmul(
        &self,
        _dev: &GpuDevice,
        _gemm: &Gemm,
        _n_experts: usize,
        _e: usize,
        _x: &CudaView<'_, u16>,
        _y: &mut CudaViewMut<'_, f32>,
        _m: usize,
    ) -> Result<()> {
        Err(no_experts(self.desc().form_name()))
    }
    /// The matrix, when it is stored dense BF16 (the q/k/v GEMV with RoPE in its epilogue, and
    /// embedding lookups, take it).
    fn as_dense(&self) -> Option<&DenseBf16> {
        None
    }
    /// The matrix as the chained-norm GEMVs take it (`launch_gemv_prenorm`,
    /// `launch_gemv_accum_norm`).
    fn chainable(&self) -> Option<ChainLinear<'_>> {
        None
    }
    /// Whether gate/up rows are stored as halves [gate; up] rather than interleaved: prefill then
    /// applies SwiGLU to halves.
    fn gate_up_halves(&self) -> bool {
        false
    }
    /// A device copy in the same launch configuration (the builder copies a launch whose host
    /// matrices an earlier layer shares).
    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear>;
    /// The launch configurations this matrix's batch-1 product may run in (warps per block, rows
    /// or tiles per warp, resident blocks per SM), as the form spells them: every one compiled
    /// with each fusion the decode step asks of the form (CI compiles them all), the current one
    /// first. The tuner times each; serving applies a plan's choice
    /// ([`GpuMatrix::set_launch_config`]). Empty: one launch.
    fn launch_configs(&self) -> Vec<String> {
        Vec::new()
    }
    /// Runs the batch-1 products in `config`, one of [`GpuMatrix::launch_configs`].
    fn set_launch_config(&mut self, config: &str) -> Result<()> {
        Err(unknown_launch(self.desc().form_name(), config, &[]))
    }
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The error for a form without a gathered product over experts.
fn no_experts(form: &str) -> GpuError {
    GpuError::invalid(
        "experts",
        format!("a {form} matrix has no gathered product over experts"),
    )
}

/// The error for a launch configuration a form does not have.
fn unknown_launch(form: &str, config: &str, known: &[String]) -> GpuError {
    GpuError::invalid(
        "launch config",
        match known {
            [] => format!("a {form} matrix has one launch, not `{config}`"),
            k => format!(
                "a {form} matrix of this shape launches as {}, not `{config}` (a tune file made \
                 for another model or entrollm version? re-run `entrollm tune`)",
                k.join(", ")
            ),
        },
    )
}

/// `config` as the one of `candidates` whose name it is (see [`GpuMatrix::set_launch_config`]).
pub(crate) fn pick_launch<T: Copy + std::fmt::Display>(
    form: &str,
    config: &str,
    candidates: &[T],
) -> Result<T> {
    candidates
        .iter()
        .find(|c| c.to_string() == config)
        .copied()
        .ok_or_else(|| {
            let known: Vec<String> = candidates.iter().map(|c| c.to_string()).collect();
            unknown_launch(form, config, &known)
        })
}

/// The names of `current` and then the other `candidates` (see [`GpuMatrix::launch_configs`]).
pub(crate) fn launch_names<T: PartialEq + std::fmt::Display>(
    current: T,
    candidates: impl IntoIterator<Item = T>,
) -> Vec<String> {
    let mut v = vec![current.to_string()];
    v.extend(
        candidates
            .into_iter()
            .filter(|c| *c != current)
            .map(|c| c.to_string()),
    );
    v
}

impl GpuLinear {
    pub fn new(m: impl GpuMatrix + 'static) -> Self {
        GpuLinear(Box::new(m))
    }

    /// See [`GpuMatrix::launch_configs`].
    pub fn launch_configs(&self) -> Vec<String> {
        self.0.launch_configs()
    }

    /// See [`GpuMatrix::set_launch_config`].
    pub fn set_launch_config(&mut self, config: &str) -> Result<()> {
        self.0.set_launch_config(config)
    }

    /// The form's own device type, for code that knows it (its form module, selftests).
    pub fn matrix(&self) -> &dyn GpuMatrix {
        &*self.0
    }

    pub fn rows(&self) -> usize {
        self.0.desc().rows
    }

    pub fn cols(&self) -> usize {
        self.0.desc().cols
    }

    /// See [`GpuMatrix::desc`].
    pub fn desc(&self) -> LinearDesc {
        self.0.desc()
    }

    /// Whether the decode step normalises x inside this matrix's GEMV ([`LinearDesc::norm_in_gemv`]).
    pub fn norm_in_gemv(&self) -> bool {
        self.desc().norm_in_gemv()
    }

    /// See [`GpuMatrix::entropy_coded`].
    pub fn entropy_coded(&self) -> bool {
        self.0.entropy_coded()
    }

    pub fn stored_bytes(&self) -> usize {
        self.0.stored_bytes()
    }

    pub fn device_bytes(&self) -> usize {
        self.0.device_bytes()
    }

    pub fn matvec(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        self.0.matvec(dev, x, y, accumulate)
    }

    pub fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.0.matvec_fused(dev, x, norm, fusion, y)
    }

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
        self.0.matmul(dev, gemm, x, y, m, accumulate)
    }

    /// See [`GpuMatrix::gathered`].
    pub fn gathered(
        &self,
        dev: &GpuDevice,
        g: Gather<'_>,
        x: &CudaSlice<f32>,
        swiglu: bool,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.0.gathered(dev, g, x, swiglu, y)
    }

    /// See [`GpuMatrix::expert_matmul`].
    #[allow(clippy::too_many_arguments)]
    pub fn expert_matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        n_experts: usize,
        e: usize,
        x: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        m: usize,
    ) -> Result<()> {
        self.0.expert_matmul(dev, gemm, n_experts, e, x, y, m)
    }

    pub fn as_dense(&self) -> Option<&DenseBf16> {
        self.0.as_dense()
    }

    pub fn chainable(&self) -> Option<ChainLinear<'_>> {
        self.0.chainable()
    }

    /// The dense BF16 weights, when the matrix is stored that way (embedding lookups).
    pub fn dense_weights(&self) -> Option<&CudaSlice<u16>> {
        self.0.as_dense().map(|d| &d.w)
    }

    pub fn gate_up_halves(&self) -> bool {
        self.0.gate_up_halves()
    }

    pub fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        self.0.duplicate(dev)
    }

    /// The matrix as its form's device type `T`, when it is one.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref()
    }
}

pub use crate::forms::bf16::DenseBf16;
pub use crate::forms::dtans::DtansLinear;
pub use crate::forms::fp8::Fp8Linear;
pub use crate::forms::pal_bf16::PalBf16Linear;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_choices_name_launches_by_id() {
        let c: LaunchChoices = [("layers.0.qkv", "w4r1u8"), ("lm_head", "w8r2u4")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .into_iter()
            .collect();
        assert_eq!(c.get("layers.0.qkv"), Some("w4r1u8"));
        assert_eq!(c.get("layers.1.qkv"), None);
        assert_eq!(c.len(), 2);
        let none: LaunchChoices = std::iter::empty().collect();
        assert!(none.is_empty() && none == LaunchChoices::default());
        // Every GEMV candidate by name; the current one first, once.
        let cur = gemv_config_for(6144, 4096);
        let names = launch_names(cur, GemvConfig::CANDIDATES);
        assert_eq!(names[0], cur.to_string());
        assert_eq!(names.len(), GemvConfig::CANDIDATES.len());
        for n in &names {
            let c = pick_launch("bf16", n, &GemvConfig::CANDIDATES).unwrap();
            assert_eq!(&c.to_string(), n);
        }
        assert!(pick_launch("bf16", "w5r1u1", &GemvConfig::CANDIDATES).is_err());
    }

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
