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
//! matrices (`compress --bits`) are served coded where the model holds them so (`--keep-coded`).

pub mod bf16;
pub mod dtans;
pub mod fp8;
pub mod lossy;
pub mod pal_bf16;

pub use dtans::check_kernels;
pub(crate) use dtans::exact_bf16;
pub use fp8::{fp8_palette, is_fp8};

use crate::device::GpuDevice;
use crate::engine_coded::{Encoder, LoadReport};
use crate::error::Result;
use crate::linear::{Fp8Serving, GpuLinear, SharedScratch};
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
}

/// The GPU forms, in the order a launch is offered to them: forms held as such first (a coded
/// matrix stays coded, FP8 codes stay FP8), then the load policies that change a BF16 matrix's
/// form, then dense BF16.
pub fn all() -> &'static [&'static dyn GpuForm] {
    static ALL: [&dyn GpuForm; 6] = [
        &dtans::HELD,
        &lossy::HELD,
        &fp8::FP8,
        &dtans::AT_LOAD,
        &pal_bf16::PAL_BF16,
        &bf16::BF16,
    ];
    &ALL
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
