//! Lossy-coded matrices (model form `lossy`, `compress --bits`, held coded with `--keep-coded`):
//! batch-1 products by the fused tile decode-matvec (`lossy_mv`, `kernels/lossy.cu`), prefill by
//! decoding the tiles into the shared BF16 workspace (`lossy_decode`) and the dense path's GEMM. A
//! launch's parts (q/k/v; gate and up as halves) decode in one product launch, each into its rows
//! of the output; the decode step's fusions are small kernels around the product on the model's
//! shared scratch (`forms::fused_product`, as for the dtANS form).

use super::stacked::Stacked;
use super::{GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::forms::report::LoadReport;
use crate::gemm::Gemm;
use crate::linear::{GpuLinear, GpuMatrix, SharedScratch};
use crate::ops::forward::GemvFusion;
use crate::ops::lossy::{is_e8, launch_decode, launch_mv, GpuLossy, LossyOut, MAX_PARTS};
use crate::plan::{LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::CudaSlice;
use entrollm_codec::lossy::Quantizer;
use entrollm_model::forms::lossy::LossyLinear;
use entrollm_model::weights::Linear;
use std::sync::Arc;

/// Matrices held lossy-coded, served as they are.
pub struct Held;
pub static HELD: Held = Held;

impl GpuForm for Held {
    fn name(&self) -> &'static str {
        "lossy"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        let mut coded = Vec::with_capacity(parts.len());
        for p in parts {
            match p.as_any().downcast_ref::<LossyLinear>() {
                Some(l) => coded.push(l.coded()),
                None => return Ok(None),
            }
        }
        let (cols, e8) = (coded[0].tensor.cols, is_e8(coded[0].tensor.quantizer));
        let Some(round) = LossyOut::of(coded[0].dtype) else {
            return Ok(None);
        };
        // One launch takes the parts: same columns, precision and quantiser kind.
        if coded.len() > MAX_PARTS
            || coded.iter().any(|c| {
                c.tensor.cols != cols
                    || LossyOut::of(c.dtype) != Some(round)
                    || is_e8(c.tensor.quantizer) != e8
            })
            || (halves && (coded.len() != 2 || coded[0].tensor.rows != coded[1].tensor.rows))
        {
            return Ok(None);
        }
        let parts = coded
            .iter()
            .map(|c| GpuLossy::upload(up.dev, &c.tensor))
            .collect::<Result<Vec<_>>>()?;
        let l = LossyGpuLinear::new(parts, halves, round, Arc::clone(up.scratch))?;
        report.took(self.name());
        Ok(Some(GpuLinear::new(l)))
    }
}

/// A lossy-coded matrix of row-stacked parts on the device.
pub struct LossyGpuLinear {
    st: Stacked<GpuLossy>,
    /// The container's precision: the product rounds each weight to it.
    round: LossyOut,
}

super::stacked::part!(GpuLossy);

impl LossyGpuLinear {
    fn new(
        parts: Vec<GpuLossy>,
        halves: bool,
        round: LossyOut,
        scratch: SharedScratch,
    ) -> Result<Self> {
        Ok(LossyGpuLinear {
            st: Stacked::new("lossy linear", parts, halves, scratch, 1)?,
            round,
        })
    }
}

impl GpuMatrix for LossyGpuLinear {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            LossyLaunch {
                quantizer: self.st.parts[0].quantizer,
                parts: self.st.parts.len(),
                halves: self.st.halves,
            },
            self.st.rows(),
            self.st.cols(),
        )
    }

    fn stored_bytes(&self) -> usize {
        self.st.stored_bytes()
    }

    fn device_bytes(&self) -> usize {
        self.st.device_bytes()
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.st.fused(
            dev,
            "lossy matvec",
            x,
            norm,
            fusion,
            y,
            |input, out, err| {
                let parts: Vec<&GpuLossy> = self.st.parts.iter().collect();
                launch_mv(dev, &parts, self.round, input, out, Some(err))
            },
        )
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
        self.st
            .matmul("lossy matmul", gemm, x, y, m, accumulate, |p, s, at| {
                launch_decode(dev, p, LossyOut::Bf16, &mut s.w, at, Some(&mut s.err))
            })
    }

    fn gate_up_halves(&self) -> bool {
        self.st.halves
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        Ok(GpuLinear::new(LossyGpuLinear {
            st: self.st.duplicate(dev)?,
            round: self.round,
        }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A lossy-coded matrix in the decode step: `parts` row-stacked products (`lossy_mv`), gate/up as
/// `halves`.
#[derive(Debug)]
pub struct LossyLaunch {
    pub quantizer: Quantizer,
    pub parts: usize,
    pub halves: bool,
}

impl LaunchForm for LossyLaunch {
    fn name(&self) -> &'static str {
        "lossy"
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        // LossyGpuLinear::matvec_fused: the parts' product in one launch inside the fusions.
        super::fused_product_launches(m, self.halves, push, |x, y, push| {
            push(
                "lossy_mv",
                format!(
                    "{} {} parts={}{} {x}->{y}",
                    m.label,
                    self.quantizer,
                    self.parts,
                    if self.halves { " halves" } else { "" }
                ),
            )
        });
    }
}
