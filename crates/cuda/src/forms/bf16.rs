//! Dense BF16 (model form `dense:bf16`): the values as stored, q/k/v stacked and gate/up
//! interleaved; the products are our GEMV (decode) and cuBLASLt (prefill).

use super::{stack, GpuForm, Upload};
use crate::engine_coded::LoadReport;
use crate::error::Result;
use crate::linear::GpuLinear;
use entrollm_model::weights::{Bf16, Dense, Linear};
use std::borrow::Cow;

pub struct Bf16Form;
pub static BF16: Bf16Form = Bf16Form;

impl GpuForm for Bf16Form {
    fn name(&self) -> &'static str {
        "bf16"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        _report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        fn held(p: &dyn Linear) -> Option<Cow<'_, [u16]>> {
            let d = p.as_any().downcast_ref::<Dense<Bf16>>()?;
            Some(d.data().into())
        }
        let Some((rows, cols, bits)) = stack(parts, halves, held) else {
            return Ok(None);
        };
        GpuLinear::dense_from_host(up.dev, rows, cols, &bits).map(Some)
    }
}
