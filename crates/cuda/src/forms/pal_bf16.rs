//! BF16 palette-packed losslessly (model form `pal-bf16`; codec `PaletteBf16`: 12 bits a weight
//! plus escapes), batch-1 products by `gemv_pal4_bf16`, prefill through a BF16 copy in the shared
//! workspace. A launch's parts are packed as one matrix (one palette for the stacked rows). With
//! [`Policy::bf16_palette`](super::Policy) any other matrix is packed from its BF16 rounding (the
//! dense upload's), where that packs small enough.

use super::{stack, GpuForm, Upload};
use crate::engine::host_bf16;
use crate::engine_coded::LoadReport;
use crate::error::Result;
use crate::linear::GpuLinear;
use entrollm_codec::palette::PaletteBf16;
use entrollm_model::forms::palette::PalLinear;
use entrollm_model::weights::Linear;
use std::borrow::Cow;
use std::sync::Arc;

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
                report.bf16_palette += 1;
                return GpuLinear::pal_bf16_packed(up.dev, pal, Arc::clone(up.scratch)).map(Some);
            }
        }
        fn held(p: &dyn Linear) -> Option<Cow<'_, [u16]>> {
            let pal = p.as_any().downcast_ref::<PalLinear>()?.bf16()?;
            Some(pal.decode().into())
        }
        fn rounded(p: &dyn Linear) -> Option<Cow<'_, [u16]>> {
            Some(host_bf16(p).into())
        }
        let (stacked, required) = match stack(parts, halves, held) {
            Some(s) => (s, true),
            None if up.policy.bf16_palette => match stack(parts, halves, rounded) {
                Some(s) => (s, false),
                None => return Ok(None),
            },
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
            report.bf16_palette += 1;
        }
        Ok(l)
    }
}
