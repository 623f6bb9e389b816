//! `dense`: the values as they are, row-major (`bf16`, `f16`, `fp8`, `f32`), or widened to f32
//! (`f32` from any float or integer source: exact, twice to four times the bytes, the fastest
//! product where conversion costs more than bandwidth).

use super::{Candidate, DeviceKind, Form, Source, Values};
use crate::error::{ModelError, Result};
use crate::weights::{Bf16, Dense, DenseElement, Linear, F16, F32};

use std::sync::Arc;

pub struct DenseForm;
pub static DENSE: DenseForm = DenseForm;

/// The values widened to f32 exactly (integer codes through their group scales).
pub(crate) fn to_f32(src: &Source) -> Vec<f32> {
    match &src.values {
        Values::F32(v) => v.clone(),
        Values::Bf16(v) => v.iter().map(|&b| Bf16::to_f32(b)).collect(),
        Values::F16(v) => v.iter().map(|&b| F16::to_f32(b)).collect(),
        Values::Fp8(v) => v
            .iter()
            .map(|&b| crate::weights::FP8_E4M3_TO_F32[b as usize])
            .collect(),
        Values::Int {
            payload,
            codes,
            groups,
        } => {
            let d = groups.dequant();
            let cols = src.cols;
            codes
                .iter()
                .enumerate()
                .map(|(i, &c)| d.apply(*payload, i / cols, i % cols, cols, payload.to_f32(c, 0)))
                .collect()
        }
        Values::Ggml { ty, bytes } => super::ggml::to_f32(*ty, bytes),
    }
}

fn element_bytes(v: &Values) -> usize {
    match v {
        Values::F32(_) => 4,
        Values::Bf16(_) | Values::F16(_) => 2,
        Values::Fp8(_) => 1,
        Values::Int { .. } | Values::Ggml { .. } => 4,
    }
}

impl Form for DenseForm {
    fn name(&self) -> &'static str {
        "dense"
    }
    fn describe(&self) -> &'static str {
        "values as stored (bf16, f16, fp8, f32), or widened to f32"
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        true
    }
    fn accepts(&self, _src: &Source) -> bool {
        true
    }
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        let mut out = Vec::new();
        if !matches!(
            src.values,
            Values::Int { .. } | Values::Ggml { .. } | Values::F32(_)
        ) {
            out.push(Candidate {
                variant: src.values.kind().to_string(),
                predicted_bytes: (src.weights() * element_bytes(&src.values)) as f64,
            });
        }
        out.push(Candidate {
            variant: "f32".into(),
            predicted_bytes: (src.weights() * 4) as f64,
        });
        Ok(out)
    }
    /// The values as they are where that is a variant, else widened.
    fn default_variant(&self, src: &Source) -> Result<Option<String>> {
        Ok(self.variants(src)?.into_iter().next().map(|c| c.variant))
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        self.variants(src)?
            .into_iter()
            .find(|c| c.variant == variant)
            .map(|c| c.predicted_bytes)
            .ok_or_else(|| bad_variant(src, variant))
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        let (r, c) = (src.rows, src.cols);
        let name = "dense";
        if variant == "f32" {
            return Ok(Arc::new(Dense::<F32>::new(name, r, c, to_f32(src))?));
        }
        if variant != src.values.kind() {
            return Err(bad_variant(src, variant));
        }
        Ok(match &src.values {
            Values::Bf16(v) => Arc::new(Dense::<Bf16>::new(name, r, c, v.clone())?),
            Values::F16(v) => Arc::new(Dense::<F16>::new(name, r, c, v.clone())?),
            Values::Fp8(v) => Arc::new(crate::weights::DenseFp8::new(name, r, c, v.clone())?),
            Values::F32(_) | Values::Int { .. } | Values::Ggml { .. } => {
                return Err(bad_variant(src, variant))
            }
        })
    }
    /// The stored dtype is a plain tensor; widening (`f32` from a 16-bit or integer source) is
    /// done at load, so the container keeps the smaller source.
    fn stored(&self, variant: &str, values: &str) -> Result<Option<super::Stored>> {
        Ok((variant == values).then_some(super::Stored::Raw))
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + match device {
                DeviceKind::Cpu => weights as f64 * 0.05e-3,
                DeviceKind::Cuda => 0.0,
            }
    }
}

fn bad_variant(src: &Source, variant: &str) -> ModelError {
    ModelError::Config(format!(
        "dense variant '{variant}' does not hold a {} matrix (variants: {}f32)",
        src.values.kind(),
        match src.values {
            Values::Int { .. } | Values::Ggml { .. } | Values::F32(_) => String::new(),
            _ => format!("{}, ", src.values.kind()),
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;

    #[test]
    fn every_float_kind_round_trips_and_multiplies() {
        let mut rng = Rng::new(7);
        for (rows, cols) in [(1, 1), (3, 70), (33, 129), (64, 64)] {
            let b = bf16_source(&mut rng, rows, cols, 0.02);
            check_all_forms(&b, &mut rng);
            let Values::Bf16(v) = &b.values else {
                unreachable!()
            };
            let f16: Vec<u16> = v
                .iter()
                .map(|&x| half::f16::from_f32(half::bf16::from_bits(x).to_f32()).to_bits())
                .collect();
            check_all_forms(
                &Source::new(rows, cols, Values::F16(f16)).unwrap(),
                &mut rng,
            );
            let fp8: Vec<u8> = (0..rows * cols)
                .map(|_| (rng.next() % 256) as u8)
                .map(|b| if b & 0x7F == 0x7F { 0 } else { b })
                .collect();
            check_all_forms(
                &Source::new(rows, cols, Values::Fp8(fp8)).unwrap(),
                &mut rng,
            );
            let f32s: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
            check_all_forms(
                &Source::new(rows, cols, Values::F32(f32s)).unwrap(),
                &mut rng,
            );
        }
    }

    #[test]
    fn unknown_variants_are_named() {
        let mut rng = Rng::new(1);
        let b = bf16_source(&mut rng, 2, 2, 1.0);
        let e = super::DENSE.encode(&b, "fp8").err().unwrap().to_string();
        assert!(e.contains("variants: bf16, f32"), "{e}");
    }
}
