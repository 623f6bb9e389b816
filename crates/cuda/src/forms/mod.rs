//! Weight forms on the GPU: each module takes the host matrices of its form (`entrollm_model`'s
//! [`forms`](entrollm_model::forms)) to the device as one launch's [`GpuLinear`]. The model
//! builder ([`crate::GpuModel::upload_served`]) and the tuner's timer ask [`upload`], which asks
//! each form in [`all`]'s order; a launch no form takes is served as BF16 by the builder (rounded
//! where its values are not BF16), and left out by the tuner.
//!
//! A launch is one or more row-stacked parts (q/k/v; gate and up, which `halves` interleaves row
//! by row as the fused SwiGLU epilogue reads them). Load policies ([`Upload`]) let a form take
//! matrices held in another: FP8 codes palette-packed at load (`--fp8`), BF16 matrices
//! palette-packed (`--bf16 palette`) or dtANS-coded at load (`--code-at-load`). Lossy-coded
//! matrices (`compress --bits`) are served coded where the model holds them so (`--keep-coded`),
//! a quantised GGUF's blocks as the file stores them, integer codes (GPTQ, AWQ,
//! compressed-tensors) as their codes.

pub mod bf16;
pub mod dtans;
pub mod fp8;
pub mod ggml;
pub mod int;
pub mod lossy;
pub mod pal_bf16;
pub mod report;
mod stacked;

pub use dtans::check_kernels;
pub(crate) use dtans::exact_bf16;
pub use fp8::{fp8_palette, is_fp8};

use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::forms::report::{Encoder, LoadReport};
use crate::linear::{DtansScratch, Fp8Serving, GpuLinear, SharedScratch};
use crate::ops::forward::GemvFusion;
use crate::plan::MatvecLaunch;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use entrollm_codec::dtans::Coding;
use entrollm_model::weights::Linear;

/// What an upload may do beyond keeping each matrix in the form it is held in.
#[derive(Clone, Copy, Debug, Default)]
pub struct Policy {
    /// How FP8 codes held dense are kept (palette-packed at load, or as stored).
    pub fp8: Fp8Serving,
    /// BF16-valued matrices (held dense, or any other value rounded to BF16 as the dense upload
    /// rounds it) palette-packed losslessly where that packs.
    pub bf16_palette: bool,
    /// Matrices with BF16 values dtANS-coded at load: the coding (None: the coder's choice) and
    /// who encodes.
    pub code: Option<(Option<Coding>, Encoder)>,
}

impl Policy {
    /// Every matrix exactly as it is held (the tuner times the forms themselves).
    pub const AS_HELD: Policy = Policy {
        fp8: Fp8Serving::Dense,
        bf16_palette: false,
        code: None,
    };
}

/// One launch's upload: the device, the coded matrices' shared scratch and the policy.
pub struct Upload<'a> {
    pub dev: &'a GpuDevice,
    pub scratch: &'a SharedScratch,
    pub policy: Policy,
    /// The launch, for messages (`layer 3 qkv`).
    pub what: &'a str,
}

/// One weight form's GPU side.
pub trait GpuForm: Sync {
    /// The name in reports.
    fn name(&self) -> &'static str;
    /// `parts` as one device matrix when this form takes every one of them (held in it, or by the
    /// policy); None otherwise, or when its kernels do not take the shape (the next form is
    /// asked). What it did is counted in `report`.
    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>>;
    /// A mixture of experts' stack: each expert's `parts` (gate and up as `halves`, or down)
    /// row-stacked and the experts after one another, as one device matrix whose gathered
    /// product (`GpuMatrix::gathered`) runs the routed experts in one launch; None when this form
    /// does not hold every expert or has no gathered product.
    fn upload_experts(
        &self,
        _up: &Upload<'_>,
        _experts: &[Vec<&dyn Linear>],
        _halves: bool,
        _report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        Ok(None)
    }
}

/// The GPU forms, in the order a launch is offered to them: forms held as such first (a coded
/// matrix stays coded, FP8 codes, GGUF blocks and integer codes stay as stored), then the load policies that change a BF16 matrix's
/// form, then dense BF16.
pub fn all() -> &'static [&'static dyn GpuForm] {
    static ALL: [&dyn GpuForm; 8] = [
        &dtans::HELD,
        &lossy::HELD,
        &ggml::HELD,
        &int::HELD,
        &fp8::FP8,
        &dtans::AT_LOAD,
        &pal_bf16::PAL_BF16,
        &bf16::BF16,
    ];
    &ALL
}

/// Whether `kernel` is one of the forms' product kernels that call `pdl_wait()` before touching
/// anything an earlier kernel wrote or reads (kernels/common.cuh), so that an edge into it may be
/// programmatic (`plan::programmatic_into`); `dense_fp8`: the dense FP8 GEMVs too.
pub fn pdl_kernel(kernel: &str, dense_fp8: bool) -> bool {
    [
        bf16::PDL_KERNELS,
        fp8::PDL_KERNELS,
        pal_bf16::PDL_KERNELS,
        ggml::PDL_KERNELS,
    ]
    .iter()
    .any(|ks| ks.contains(&kernel))
        || dense_fp8 && fp8::PDL_DENSE_KERNELS.contains(&kernel)
}

/// `parts` as the first form of [`all`] that takes them uploads them; None when none does.
pub fn upload(
    up: &Upload<'_>,
    parts: &[&dyn Linear],
    halves: bool,
    report: &mut LoadReport,
) -> Result<Option<GpuLinear>> {
    for f in all() {
        if let Some(l) = f.upload(up, parts, halves, report)? {
            return Ok(Some(l));
        }
    }
    Ok(None)
}

/// A mixture of experts' stack ([`GpuForm::upload_experts`]) in the first form of [`all`] that
/// gathers them all (ggml blocks as the file stores them), else dense BF16, rounded where the
/// values are not BF16: the forms whose gathered product runs the routed experts in one launch.
/// (Experts held in another form, or a plan's other forms for them, are served as BF16.)
pub fn upload_experts(
    up: &Upload<'_>,
    experts: &[Vec<&dyn Linear>],
    halves: bool,
    report: &mut LoadReport,
) -> Result<GpuLinear> {
    for f in all() {
        if let Some(l) = f.upload_experts(up, experts, halves, report)? {
            return Ok(l);
        }
    }
    bf16::experts_rounded(up.dev, experts, halves)
}

/// The parts' values row-stacked (`halves`: the two parts' rows interleaved), each part's values
/// given by `values`; None when the parts' columns differ, or `halves` is asked of other than two
/// parts of equal rows.
pub(crate) fn stack<T: Copy>(
    parts: &[&dyn Linear],
    halves: bool,
    values: impl Fn(&dyn Linear) -> Option<std::borrow::Cow<'_, [T]>>,
) -> Option<(usize, usize, Vec<T>)> {
    let cols = parts.first()?.cols();
    if parts.iter().any(|p| p.cols() != cols)
        || (halves && (parts.len() != 2 || parts[0].rows() != parts[1].rows()))
    {
        return None;
    }
    let vals = parts
        .iter()
        .map(|p| values(*p))
        .collect::<Option<Vec<_>>>()?;
    let rows: usize = parts.iter().map(|p| p.rows()).sum();
    let mut out = Vec::with_capacity(rows * cols);
    if halves {
        for (g, u) in vals[0].chunks(cols).zip(vals[1].chunks(cols)) {
            out.extend_from_slice(g);
            out.extend_from_slice(u);
        }
    } else {
        for v in &vals {
            out.extend_from_slice(v);
        }
    }
    Some((rows, cols, out))
}

/// Errors unless the shared scratch takes products of `rows` outputs and `cols` inputs (a held
/// matrix's upload, `what` naming it).
pub(crate) fn check_scratch(
    what: &'static str,
    scratch: &SharedScratch,
    (rows, cols): (usize, usize),
) -> Result<()> {
    let s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    if s.y.len() < rows || s.xn.len() < cols {
        return Err(GpuError::invalid(
            what,
            format!(
                "scratch of {} outputs / {} inputs is too small for {rows}×{cols}",
                s.y.len(),
                s.xn.len()
            ),
        ));
    }
    Ok(())
}

/// Prefill of a matrix held in a form without a GEMM of its own: `decode` writes its `rows × cols`
/// BF16 weights into the shared workspace (given the scratch), then the dense GEMM multiplies them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn workspace_matmul(
    what: &'static str,
    scratch: &SharedScratch,
    (rows, cols): (usize, usize),
    gemm: &crate::gemm::Gemm,
    x: &impl DevicePtr<u16>,
    y: &mut impl DevicePtrMut<f32>,
    m: usize,
    accumulate: bool,
    decode: impl FnOnce(&mut DtansScratch) -> Result<()>,
) -> Result<()> {
    let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    if s.w.len() < rows * cols {
        return Err(GpuError::invalid(
            what,
            format!(
                "the dequantisation workspace holds {} weights, a {rows}×{cols} matrix needs {}",
                s.w.len(),
                rows * cols
            ),
        ));
    }
    decode(&mut s)?;
    gemm.matmul(&s.w, x, y, m, rows, cols, accumulate)
}

/// A coded matrix's batch-1 product with the decode step's fusions, on the model's shared scratch:
/// the RMSNorm of x into the scratch input (`norm`), `product(input, out, err)` into y itself when
/// plain, else into the scratch output, then SwiGLU of the (gate, up) rows (`halves`: [gate; up],
/// else interleaved) or the residual add into y. So the step still captures into one CUDA graph with
/// no allocation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_product(
    dev: &GpuDevice,
    what: &'static str,
    scratch: &mut DtansScratch,
    (rows, cols): (usize, usize),
    halves: bool,
    x: &CudaSlice<f32>,
    norm: Option<(&CudaSlice<f32>, f32)>,
    fusion: GemvFusion,
    y: &mut CudaSlice<f32>,
    product: impl FnOnce(&CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<u32>) -> Result<()>,
) -> Result<()> {
    use crate::ops::elementwise::{launch_residual_add, launch_swiglu, launch_swiglu_pairs};
    use crate::ops::forward::{launch_rmsnorm_f32w, NormOut};
    if fusion.swiglu && (rows % 2 != 0 || fusion.accumulate) {
        return Err(GpuError::invalid(
            what,
            format!("SwiGLU needs (gate, up) row pairs and no accumulation ({rows} rows)"),
        ));
    }
    let DtansScratch { y: sy, xn, err, .. } = scratch;
    let input = match norm {
        Some((w, eps)) => {
            launch_rmsnorm_f32w(dev, x, w, NormOut::F32(xn), 1, cols, eps)?;
            &*xn
        }
        None => x,
    };
    if !fusion.accumulate && !fusion.swiglu {
        return product(input, y, err);
    }
    product(input, sy, err)?;
    if fusion.swiglu && halves {
        launch_swiglu(dev, sy, y, 1, rows / 2)
    } else if fusion.swiglu {
        launch_swiglu_pairs(dev, sy, y, rows / 2)
    } else {
        launch_residual_add(dev, y, sy, rows)
    }
}

/// The launches [`fused_product`] makes, for the decode step's plan: `kernel` with `line` (given
/// the input and output buffer names) between the norm and the epilogue.
pub(crate) fn fused_product_launches(
    m: &MatvecLaunch<'_>,
    halves: bool,
    push: &mut dyn FnMut(&'static str, String),
    product: impl FnOnce(&str, &str, &mut dyn FnMut(&'static str, String)),
) {
    let x = match m.norm {
        Some(n) => {
            push("rmsnorm_f32w", format!("{n} {}->xn", m.input));
            "xn".to_string()
        }
        None => m.input.to_string(),
    };
    let plain = !m.fusion.accumulate && !m.fusion.swiglu;
    let y = if plain {
        m.out.to_string()
    } else {
        "ys".into()
    };
    product(&x, &y, push);
    let o = m.out;
    if m.fusion.swiglu && halves {
        push("swiglu", format!("ys->{o}"));
    } else if m.fusion.swiglu {
        push("swiglu_pairs", format!("ys->{o}"));
    } else if m.fusion.accumulate {
        push("residual_add", format!("ys->{o}"));
    }
}
