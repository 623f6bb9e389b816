//! `lossy`: a float matrix coded lossily in the lattice tiles (`compress --bits`); it decodes to its
//! reconstruction, not to the source.

use super::{Arrays, Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::lossy::LossyTensor;
use entrollm_codec::CodecError;
use serde_json::{json, Value};
use std::borrow::Cow;

pub const LOSSY: &str = "lossy";

pub(super) const KIND: CoderKind = CoderKind { name: LOSSY, load };

/// A lossy reconstruction as bytes of `dtype`: rounded to nearest, saturated to the dtype's range
/// (a point can land past the largest finite half).
pub(super) fn reconstruction_bytes(dtype: Dtype, v: &[f32]) -> entrollm_codec::Result<Vec<u8>> {
    Ok(match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|&x| saturated_f16(x).to_bits().to_le_bytes())
            .collect(),
        d => {
            return Err(CodecError::Unsupported(format!(
                "a lossy matrix decodes to F32, BF16 or F16, not {d:?}"
            )))
        }
    })
}

/// `x` as the nearest half, saturated at ±65504 (a lossy point can land past the largest one).
fn saturated_f16(x: f32) -> half::f16 {
    half::f16::from_f32(x.clamp(-65504.0, 65504.0))
}

/// A lossy-coded matrix and the float dtype it decodes to.
#[derive(Clone, Debug)]
pub struct LossyCoded {
    pub dtype: Dtype,
    pub tensor: LossyTensor,
}

impl LossyCoded {
    /// The dtypes a lossy matrix decodes to.
    pub fn decodes_to(dtype: Dtype) -> bool {
        matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
    }

    /// The matrix as f32 values.
    pub fn weights(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
        let h = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        Some(match dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(h(b)).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(h(b)).to_f32())
                .collect(),
            _ => return None,
        })
    }

    /// A decoded weight as the value `dtype` holds ([`Self::decode`]'s rounding), as f32.
    pub fn served(&self, x: f32) -> f32 {
        Self::served_as(self.dtype, x)
    }

    /// [`Self::served`] of every value in place (the dtype matched once, not per value).
    pub fn serve_all(&self, v: &mut [f32]) {
        match self.dtype {
            Dtype::BF16 => v
                .iter_mut()
                .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
            Dtype::F16 => v.iter_mut().for_each(|x| *x = saturated_f16(*x).to_f32()),
            _ => {}
        }
    }

    /// [`Self::served`] for a matrix of `dtype`.
    pub fn served_as(dtype: Dtype, x: f32) -> f32 {
        match dtype {
            Dtype::BF16 => half::bf16::from_f32(x).to_f32(),
            Dtype::F16 => saturated_f16(x).to_f32(),
            _ => x,
        }
    }

    /// The reconstruction as bytes of `dtype`: rounded to nearest, saturated to the dtype's range
    /// (a point can land past the largest finite half).
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        reconstruction_bytes(self.dtype, &self.tensor.decode()?)
    }
}

impl Coder for LossyCoded {
    fn name(&self) -> &'static str {
        LOSSY
    }
    fn params(&self) -> Value {
        json!({
            "quantizer": self.tensor.quantizer.to_string(),
            "rows": self.tensor.rows,
            "cols": self.tensor.cols,
            "bits_per_weight": self.tensor.bits_per_weight(),
        })
    }
    fn arrays(&self) -> Arrays<'_> {
        vec![(
            "data".to_string(),
            ArrayDtype::U8,
            Cow::Owned(self.tensor.to_bytes()),
        )]
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        LossyCoded::decode(self)
    }
    fn stored_bytes(&self) -> usize {
        self.tensor.stored_bytes()
    }
    fn reconstructs(&self) -> bool {
        true
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    let (dtype, shape) = (s.dtype, s.shape);
    if !LossyCoded::decodes_to(dtype) {
        return Err(err(format!(
            "a lossy matrix decodes to F32, BF16 or F16, not {dtype:?}"
        )));
    }
    let tensor = LossyTensor::from_bytes(s.array("data", ArrayDtype::U8)?)
        .map_err(|e| err(e.to_string()))?;
    if shape != [tensor.rows, tensor.cols] {
        return Err(err(format!(
            "coded as {}×{} but its shape is {shape:?}",
            tensor.rows, tensor.cols
        )));
    }
    Ok(LossyCoded { dtype, tensor }.into())
}
