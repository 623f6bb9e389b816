//! `df11`: a BF16 tensor in the DFloat11 layout.

use super::{to_u32, u32_bytes, Arrays, Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::df11::Df11Tensor;
use serde_json::{json, Value};
use std::borrow::Cow;

pub const DF11: &str = "df11";

pub(super) const KIND: CoderKind = CoderKind { name: DF11, load };

impl Coder for Df11Tensor {
    fn name(&self) -> &'static str {
        DF11
    }
    fn params(&self) -> Value {
        json!({ "n_elements": self.n_elements })
    }
    fn arrays(&self) -> Arrays<'_> {
        let a = |n: &str, d, b| (n.to_string(), d, b);
        vec![
            a("luts", ArrayDtype::U8, Cow::Borrowed(&self.luts[..])),
            a(
                "encoded_exponent",
                ArrayDtype::U8,
                Cow::Borrowed(&self.encoded_exponent[..]),
            ),
            a(
                "sign_mantissa",
                ArrayDtype::U8,
                Cow::Borrowed(&self.sign_mantissa[..]),
            ),
            a(
                "output_positions",
                ArrayDtype::U32,
                u32_bytes(&self.output_positions),
            ),
            a("gaps", ArrayDtype::U8, Cow::Borrowed(&self.gaps[..])),
        ]
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        Ok(Df11Tensor::decode(self)?
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect())
    }
    fn stored_bytes(&self) -> usize {
        Df11Tensor::stored_bytes(self)
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    if s.dtype != Dtype::BF16 {
        return Err(err(format!("df11 codes BF16 tensors, not {:?}", s.dtype)));
    }
    let t = Df11Tensor {
        luts: s.array("luts", ArrayDtype::U8)?.to_vec(),
        encoded_exponent: s.array("encoded_exponent", ArrayDtype::U8)?.to_vec(),
        sign_mantissa: s.array("sign_mantissa", ArrayDtype::U8)?.to_vec(),
        output_positions: to_u32(s.array("output_positions", ArrayDtype::U32)?),
        gaps: s.array("gaps", ArrayDtype::U8)?.to_vec(),
        n_elements: s.numel(),
    };
    t.validate().map_err(|e| err(e.to_string()))?;
    Ok(t.into())
}
