//! The CPU reference of the fused decode-matvec `y = W·x`. Each coded form has its own entry point
//! (`DtansTensor::matvec`, `Df11Tensor::matvec`); this module holds what they share: how decoded
//! values become weights (group scales and mins, applied per group as the GPU epilogue does).

use crate::{CodecError, Payload, Result};

/// How a decoded element becomes a weight.
#[derive(Clone, Copy, Debug)]
pub enum Dequant<'a> {
    /// The element is the weight (BF16, FP16, FP8, FP4 values).
    None,
    /// `w = scale[row·G + g]·(q − offset) + min[row·G + g]` for column group `g = col / group`
    /// (G groups per row), where `q` is the element's value (integer codes are read as two's
    /// complement when `signed`). FP8 per-row scales are one group per row.
    Groups {
        group: usize,
        scales: &'a [f32],
        mins: Option<&'a [f32]>,
        offset: f32,
        signed: bool,
    },
}

impl Dequant<'_> {
    pub fn check(&self, rows: usize, cols: usize) -> Result<()> {
        if let Dequant::Groups {
            group,
            scales,
            mins,
            ..
        } = *self
        {
            if group == 0 {
                return Err(CodecError::Shape(
                    "dequantisation group of 0 columns".into(),
                ));
            }
            let want = rows * cols.div_ceil(group);
            if scales.len() != want || mins.is_some_and(|m| m.len() != want) {
                return Err(CodecError::Shape(format!(
                    "{rows}×{cols} with groups of {group} needs {want} scales (and mins), got {}",
                    scales.len()
                )));
            }
        }
        Ok(())
    }

    /// The weight at (row, col) of a matrix with `cols` columns whose decoded element value is `v`.
    #[inline]
    pub fn apply(&self, payload: Payload, row: usize, col: usize, cols: usize, v: f32) -> f32 {
        match *self {
            Dequant::None => v,
            Dequant::Groups {
                group,
                scales,
                mins,
                offset,
                signed,
            } => {
                let q = match payload {
                    Payload::Int(bits) if signed && v >= (1u32 << (bits - 1)) as f32 => {
                        v - (1u32 << bits) as f32
                    }
                    _ => v,
                };
                let gi = row * cols.div_ceil(group) + col / group;
                scales[gi] * (q - offset) + mins.map_or(0.0, |m| m[gi])
            }
        }
    }
}
