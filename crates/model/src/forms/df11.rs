//! `df11`: DFloat11's layout (Huffman-coded BF16 exponents, sign and mantissa bytes as they are;
//! codec `df11`). The product decodes block by block (codec `Df11Tensor::matvec`). Its size
//! follows from the exponents' histogram (the Huffman code's lengths), without coding.

use super::{Candidate, DeviceKind, Form, Source, StoredMatrix, Values};
use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::df11::Df11Tensor;
use entrollm_format::coded::Coded;
use std::sync::Arc;

pub struct Df11Form;
pub static DF11: Df11Form = Df11Form;

pub struct Df11Linear {
    rows: usize,
    cols: usize,
    t: Df11Tensor,
}

impl Df11Linear {
    /// A `rows × cols` matrix held as the DFloat11 tensor `t` (as a container stores it).
    pub fn new(rows: usize, cols: usize, t: Df11Tensor) -> Result<Self> {
        if rows.checked_mul(cols) != Some(t.n_elements) {
            return Err(ModelError::Unsupported(format!(
                "a {rows}×{cols} matrix cannot hold a DFloat11 tensor of {} values",
                t.n_elements
            )));
        }
        Ok(Df11Linear { rows, cols, t })
    }
}

impl Linear for Df11Linear {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        // Coded here or verified at load; decoding is deterministic.
        self.t
            .matvec(self.rows, self.cols, x, y)
            .expect("a DFloat11 matrix verified at load decodes");
    }
    /// Decodes the whole matrix: DFloat11's blocks do not start at rows.
    fn row(&self, r: usize, out: &mut [f32]) {
        let all = self
            .t
            .decode()
            .expect("a DFloat11 matrix verified at load decodes");
        for (o, &b) in out.iter_mut().zip(&all[r * self.cols..(r + 1) * self.cols]) {
            *o = f32::from_bits((b as u32) << 16);
        }
    }
    fn stored_bytes(&self) -> usize {
        self.t.stored_bytes()
    }
    fn form(&self) -> super::FormId {
        super::FormId {
            form: "df11",
            variant: String::new(),
        }
    }
    fn source(&self) -> Result<Source> {
        let v = self
            .t
            .decode()
            .map_err(|e| ModelError::Unsupported(format!("df11 decode: {e}")))?;
        Source::new(self.rows, self.cols, Values::Bf16(v))
    }
    fn values_kind(&self) -> &'static str {
        "bf16"
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The coded size of `src` from its exponents' histogram, without coding it (codec
/// `Df11Tensor::predict_bytes`: exact, or 4 bytes over).
fn predicted(src: &Source) -> Result<f64> {
    let Values::Bf16(v) = &src.values else {
        return Err(ModelError::Unsupported(format!(
            "df11 codes BF16 matrices only, not {}",
            src.values.kind()
        )));
    };
    let mut hist = [0u64; 256];
    for &w in v {
        hist[((w >> 7) & 0xFF) as usize] += 1;
    }
    Df11Tensor::predict_bytes(&hist, v.len())
        .map(|b| b as f64)
        .map_err(|e| ModelError::Unsupported(format!("df11: {e}")))
}

fn code(src: &Source) -> Result<Df11Linear> {
    let Values::Bf16(v) = &src.values else {
        return Err(ModelError::Unsupported(format!(
            "df11 codes BF16 matrices only, not {}",
            src.values.kind()
        )));
    };
    let t = Df11Tensor::encode(v).map_err(|e| ModelError::Unsupported(format!("df11: {e}")))?;
    Ok(Df11Linear {
        rows: src.rows,
        cols: src.cols,
        t,
    })
}

impl Form for Df11Form {
    fn name(&self) -> &'static str {
        "df11"
    }
    fn describe(&self) -> &'static str {
        "DFloat11 layout: Huffman-coded BF16 exponents"
    }
    fn runs_on(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Cpu
    }
    fn accepts(&self, src: &Source) -> bool {
        matches!(src.values, Values::Bf16(_))
    }
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        // Exponents DFloat11 cannot code (|w| ≥ 2^113, inf, NaN) leave it out.
        let Ok(bytes) = predicted(src) else {
            return Ok(Vec::new());
        };
        Ok((bytes < 2.0 * src.weights() as f64)
            .then(|| Candidate {
                variant: String::new(),
                predicted_bytes: bytes,
            })
            .into_iter()
            .collect())
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        check_variant(variant)?;
        predicted(src)
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        check_variant(variant)?;
        Ok(Arc::new(code(src)?))
    }
    fn loads(&self, coded: &Coded, t: &StoredMatrix<'_>) -> bool {
        !t.in_gguf && t.shape.len() == 2 && coded.downcast_ref::<Df11Tensor>().is_some()
    }
    fn load(&self, coded: Coded, t: &StoredMatrix<'_>) -> Result<Arc<dyn Linear>> {
        let coded = coded.downcast::<Df11Tensor>().map_err(|c| {
            ModelError::tensor(
                t.name,
                format!("the df11 form does not serve {}", c.coder()),
            )
        })?;
        let m = Df11Linear::new(t.shape[0], t.shape[1], coded)
            .map_err(|e| ModelError::tensor(t.name, e.to_string()))?;
        Ok(Arc::new(m))
    }
    fn coded_only_when_asked(&self) -> bool {
        true
    }
    fn stored(&self, variant: &str, values: &str) -> Result<Option<super::Stored>> {
        check_variant(variant)?;
        Ok((values == "bf16").then_some(super::Stored::Coded {
            coder: entrollm_format::coded::DF11,
            coding: None,
        }))
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + weights as f64
                * match device {
                    DeviceKind::Cpu => 8.0e-3,
                    DeviceKind::Cuda => 2.0e-7,
                }
    }
}

fn check_variant(variant: &str) -> Result<()> {
    super::no_variants("df11", variant)
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;

    #[test]
    fn bf16_round_trips_and_multiplies() {
        let mut rng = Rng::new(13);
        for (rows, cols) in [(1, 7), (9, 300), (64, 129)] {
            check_all_forms(&bf16_source(&mut rng, rows, cols, 0.05), &mut rng);
        }
    }
}
