//! BF16 palette-packed losslessly (model form `pal-bf16`; codec `PaletteBf16`: 12 bits a weight
//! plus escapes), batch-1 products by `gemv_pal4_bf16`, prefill through a BF16 copy in the shared
//! workspace. A launch's parts are packed as one matrix (one palette for the stacked rows). With
//! [`Policy::bf16_palette`](super::Policy) any other matrix is packed from its BF16 rounding (the
//! dense upload's), where that packs small enough.

use super::bf16::host_bf16;
use super::{stack, GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::forms::report::LoadReport;
use crate::gemm::Gemm;
use crate::linear::{
    launch_names, pick_launch, GpuLinear, GpuMatrix, SharedScratch, PAL_BF16_MAX_RATIO,
};
use crate::ops::forward::GemvFusion;
use crate::ops::gemv::GemvConfig;
use crate::ops::gemv_fp8::{
    check_gemv_pal4_shape, launch_gemv_pal_bf16, launch_pal_bf16_rows_to_bf16, GpuPalBf16,
};
use crate::ops::gemv_fp8::{pal_bf16_config_for, PAL_BF16_CANDIDATES};
use crate::plan::{LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::CudaSlice;
use entrollm_codec::palette::PaletteBf16;
use entrollm_model::forms::palette::PalLinear;
use entrollm_model::weights::Linear;
use std::borrow::Cow;
use std::sync::Arc;

/// This form's GEMVs that call `pdl_wait()` first ([`super::pdl_kernel`]).
pub const PDL_KERNELS: &[&str] = &["gemv_pal4_bf16", "gemv_pal4_bf16_norm"];

pub struct PalBf16Form;
pub static PAL_BF16: PalBf16Form = PalBf16Form;

impl GpuForm for PalBf16Form {
    fn name(&self) -> &'static str {
        "bf16-palette"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        fn packed(p: &dyn Linear) -> Option<&PaletteBf16> {
            p.as_any().downcast_ref::<PalLinear>()?.bf16()
        }
        // One part held packed: its packing as it is.
        if let [p] = parts {
            if let Some(pal) = packed(*p) {
                report.took(self.name());
                return GpuLinear::pal_bf16_packed(up.dev, pal, Arc::clone(up.scratch)).map(Some);
            }
        }
        fn held(p: &dyn Linear) -> Option<Cow<'_, [u16]>> {
            let pal = p.as_any().downcast_ref::<PalLinear>()?.bf16()?;
            Some(pal.decode().into())
        }
        let (stacked, required) = match stack(parts, halves, held) {
            Some(s) => (s, true),
            None if up.policy.bf16_palette => {
                match stack(parts, halves, |p| Some(host_bf16(p).into())) {
                    Some(s) => (s, false),
                    None => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        let (rows, cols, bits) = stacked;
        let l = GpuLinear::pal_bf16_from_host(
            up.dev,
            rows,
            cols,
            &bits,
            Arc::clone(up.scratch),
            required,
        )?;
        if l.is_some() {
            report.took(self.name());
        }
        Ok(l)
    }
}

/// A BF16 matrix palette-packed on the device, and the workspace its prefill copy to BF16 uses.
pub struct PalBf16Linear {
    pub p: GpuPalBf16,
    scratch: SharedScratch,
}

impl GpuLinear {
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
        Ok(GpuLinear::new(PalBf16Linear {
            p: GpuPalBf16::upload(dev, p)?,
            scratch,
        }))
    }
}

impl GpuMatrix for PalBf16Linear {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            PalBf16Launch { gemv: self.p.gemv },
            self.p.rows,
            self.p.cols,
        )
    }

    fn stored_bytes(&self) -> usize {
        self.p.stored_bytes()
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        Ok(GpuLinear::new(PalBf16Linear {
            p: self.p.duplicate(dev)?,
            scratch: Arc::clone(&self.scratch),
        }))
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        launch_gemv_pal_bf16(dev, self.p.gemv, fusion, &self.p, x, norm, y)
    }

    fn matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        launch_pal_bf16_rows_to_bf16(dev, &self.p, &mut s.w)?;
        gemm.matmul(&s.w, x, y, m, self.p.rows, self.p.cols, accumulate)
    }

    fn launch_configs(&self) -> Vec<String> {
        launch_names(self.p.gemv, PAL_BF16_CANDIDATES)
    }

    fn set_launch_config(&mut self, config: &str) -> Result<()> {
        self.p.gemv = pick_launch("pal-bf16", config, &PAL_BF16_CANDIDATES)?;
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A BF16 matrix palette-packed losslessly in the decode step (`gemv_pal4_bf16*`, the norm inside
/// the GEMV).
#[derive(Debug)]
pub struct PalBf16Launch {
    pub gemv: GemvConfig,
}

/// A BF16 matrix palette-packed on a GPU of `sms` SMs ([`GpuPalBf16::upload`]).
pub fn desc(rows: usize, cols: usize, sms: u32) -> LinearDesc {
    LinearDesc::new(
        PalBf16Launch {
            gemv: pal_bf16_config_for(rows, sms),
        },
        rows,
        cols,
    )
}

impl LaunchForm for PalBf16Launch {
    fn name(&self) -> &'static str {
        "bf16-palette"
    }
    fn norm_in_gemv(&self) -> bool {
        true
    }
    fn gemv(&self) -> Option<GemvConfig> {
        Some(self.gemv)
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        let kernel = match m.norm {
            Some(_) => "gemv_pal4_bf16_norm",
            None => "gemv_pal4_bf16",
        };
        push(kernel, m.gemv_line(self.gemv));
    }
}
