//! `rans-floats`: a 16-bit float matrix as rANS over its codes beside its raw bytes (narrow
//! matrices).

use super::stream::{code_field, decode_field, predict_field, stream_from_stored, BlockStream};
use super::{payload_of, Arrays, Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::kquants::FieldKind;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::{CodecError, Payload};
use serde_json::{json, Value};
use std::borrow::Cow;

pub const RANS_FLOATS: &str = "rans-floats";

pub(super) const KIND: CoderKind = CoderKind {
    name: RANS_FLOATS,
    load,
};

/// A BF16 or F16 matrix as rANS over its codes (BF16: the exponents; F16: the high bytes) beside
/// its raw bytes as they are (sign and mantissa): the codes' entropy plus one table a tensor.
/// dtANS pays per lane and per slice for what a fused product needs (about half a bit a weight
/// at 384–576 columns); where that does not pay, a matrix is stored this way and served decoded.
pub struct FloatsCoded {
    pub payload: Payload,
    /// The codes: rANS, or the bytes where coding does not shrink them.
    pub codes: BlockStream,
    pub raw: Vec<u8>,
}

impl FloatsCoded {
    /// The payloads it stores: those with a raw byte.
    pub fn stores(payload: Payload) -> bool {
        payload.has_raw()
    }

    fn check(payload: Payload) -> entrollm_codec::Result<()> {
        match Self::stores(payload) {
            true => Ok(()),
            false => Err(CodecError::Unsupported(format!(
                "{RANS_FLOATS} stores BF16 and F16 matrices, not {payload:?}"
            ))),
        }
    }

    /// Codes a tensor's bytes.
    pub fn encode(payload: Payload, bytes: &[u8]) -> entrollm_codec::Result<Self> {
        Self::check(payload)?;
        let (codes, raw) = payload.symbolize(bytes)?;
        let v: Vec<u16> = codes.iter().map(|&c| u16::from(c)).collect();
        Ok(FloatsCoded {
            payload,
            codes: code_field(FieldKind::Bits(8), &v)?,
            raw,
        })
    }

    /// Predicted stored bytes of [`Self::encode`] for the payload's `codes` (one raw byte each).
    pub fn predict(payload: Payload, codes: &[u8]) -> entrollm_codec::Result<f64> {
        Self::check(payload)?;
        let v: Vec<u16> = codes.iter().map(|&c| u16::from(c)).collect();
        Ok(predict_field(FieldKind::Bits(8), &v)? + codes.len() as f64)
    }

    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        let codes = decode_field(FieldKind::Bits(8), &self.codes, self.raw.len(), "codes")?;
        Ok(codes
            .iter()
            .zip(&self.raw)
            .flat_map(|(&c, &r)| self.payload.join16(c as u8, r).to_le_bytes())
            .collect())
    }

    pub fn stored_bytes(&self) -> usize {
        self.codes.stored_bytes() + self.raw.len()
    }

    /// The codes' coding: `rans` or `packed`.
    pub fn coding(&self) -> &'static str {
        self.codes.coding()
    }

    fn from_stored<'a>(
        dtype: Dtype,
        shape: &[usize],
        params: &Value,
        array: impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
    ) -> Result<Self> {
        let err = FormatError::Usage;
        let payload = payload_of(dtype)
            .filter(|&p| Self::stores(p))
            .ok_or_else(|| err(format!("{RANS_FLOATS} stores BF16 and F16, not {dtype:?}")))?;
        let n = crate::dtype::tensor_byte_len(dtype, shape).map_err(err)? / 2;
        let raw = array("raw", ArrayDtype::U8)?;
        if raw.len() != n {
            return Err(err(format!(
                "array 'raw' holds {} bytes, {n} expected",
                raw.len()
            )));
        }
        let codes = stream_from_stored("codes", FieldKind::Bits(8), n, &params["stream"], &array)?;
        Ok(FloatsCoded {
            payload,
            codes,
            raw: raw.to_vec(),
        })
    }
}

impl Coder for FloatsCoded {
    fn name(&self) -> &'static str {
        RANS_FLOATS
    }
    fn params(&self) -> Value {
        json!({ "stream": self.codes.params() })
    }
    fn arrays(&self) -> Arrays<'_> {
        let mut v = self.codes.arrays("codes");
        v.push((
            "raw".to_string(),
            ArrayDtype::U8,
            Cow::Borrowed(&self.raw[..]),
        ));
        v
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        FloatsCoded::decode(self)
    }
    fn stored_bytes(&self) -> usize {
        FloatsCoded::stored_bytes(self)
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    Ok(FloatsCoded::from_stored(s.dtype, s.shape, s.params(), |n, d| s.array(n, d))?.into())
}
