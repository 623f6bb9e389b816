//! `rans-fields`: any other tensor as a stream of its bytes' fields (packed integer codes, group
//! scales).

use super::stream::{code_field, decode_field, pack_field, predict_field};
use super::stream::{stream_from_stored, unpack_field, BlockStream};
use super::{Arrays, Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::kquants::FieldKind;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::CodecError;
use serde_json::{json, Value};

pub const RANS_FIELDS: &str = "rans-fields";

pub(super) const KIND: CoderKind = CoderKind {
    name: RANS_FIELDS,
    load,
};

/// A tensor that no matrix form holds, stored as its bytes' fields: `bits`-bit fields (1, 2, 4
/// or 8, LSB first in each byte) or, at 16, little-endian halves (high and low bytes two
/// streams), as one stream, rANS-coded or packed where coding does not shrink it. Packed integer
/// codes (GPTQ and AWQ `qweight` and `qzeros`, compressed-tensors `weight_packed`) code near
/// their codes' entropy at their code width; any width decodes to the same bytes.
pub struct FieldsCoded {
    pub bits: u32,
    /// The tensor's bytes.
    pub len: usize,
    pub stream: BlockStream,
}

/// The field widths [`FieldsCoded`] reads.
pub const FIELD_WIDTHS: [u32; 5] = [1, 2, 4, 8, 16];

impl FieldsCoded {
    fn kind(bits: u32) -> FieldKind {
        match bits {
            16 => FieldKind::Half,
            b => FieldKind::Bits(b as u8),
        }
    }

    fn fields(bytes: &[u8], bits: u32) -> entrollm_codec::Result<Vec<u16>> {
        if !FIELD_WIDTHS.contains(&bits) || !(bytes.len() * 8).is_multiple_of(bits as usize) {
            return Err(CodecError::Shape(format!(
                "{} bytes are not whole {bits}-bit fields",
                bytes.len()
            )));
        }
        let n = bytes.len() * 8 / bits as usize;
        unpack_field(Self::kind(bits), bytes, n)
            .ok_or_else(|| CodecError::Shape(format!("{} bytes", bytes.len())))
    }

    /// Codes `bytes` as `bits`-bit fields.
    pub fn encode(bytes: &[u8], bits: u32) -> entrollm_codec::Result<Self> {
        let v = Self::fields(bytes, bits)?;
        Ok(FieldsCoded {
            bits,
            len: bytes.len(),
            stream: code_field(Self::kind(bits), &v)?,
        })
    }

    /// Predicted stored bytes of [`Self::encode`] at `bits`, and the fields' entropy in bits a
    /// field (halves: at their 16-bit values' entropy).
    pub fn predict(bytes: &[u8], bits: u32) -> entrollm_codec::Result<(f64, f64)> {
        let v = Self::fields(bytes, bits)?;
        let h = match bits {
            16 => entrollm_codec::histogram::u16_entropy_bits(&v),
            _ => {
                let b: Vec<u8> = v.iter().map(|&x| x as u8).collect();
                use entrollm_codec::histogram::{byte_histogram, entropy_bits};
                entropy_bits(&byte_histogram(&b))
            }
        };
        Ok((predict_field(Self::kind(bits), &v)?, h))
    }

    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        let kind = Self::kind(self.bits);
        let n = self.len * 8 / self.bits as usize;
        Ok(pack_field(
            kind,
            &decode_field(kind, &self.stream, n, "fields")?,
        ))
    }

    pub fn stored_bytes(&self) -> usize {
        self.stream.stored_bytes()
    }

    /// The stream's coding: `rans` or `packed`.
    pub fn coding(&self) -> &'static str {
        self.stream.coding()
    }

    fn from_stored<'a>(
        dtype: Dtype,
        shape: &[usize],
        params: &Value,
        array: impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
    ) -> Result<Self> {
        let err = FormatError::Usage;
        let len = crate::dtype::tensor_byte_len(dtype, shape).map_err(err)?;
        let bits = params["bits"]
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .filter(|b| FIELD_WIDTHS.contains(b))
            .ok_or_else(|| {
                err(format!(
                    "{RANS_FIELDS} 'bits' is not one of {FIELD_WIDTHS:?}"
                ))
            })?;
        if !(len * 8).is_multiple_of(bits as usize) {
            return Err(err(format!(
                "{dtype:?} {shape:?} is not whole {bits}-bit fields"
            )));
        }
        let n = len * 8 / bits as usize;
        let stream = stream_from_stored("fields", Self::kind(bits), n, &params["stream"], &array)?;
        Ok(FieldsCoded { bits, len, stream })
    }
}

impl Coder for FieldsCoded {
    fn name(&self) -> &'static str {
        RANS_FIELDS
    }
    fn params(&self) -> Value {
        json!({ "bits": self.bits, "stream": self.stream.params() })
    }
    fn arrays(&self) -> Arrays<'_> {
        self.stream.arrays("fields")
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        FieldsCoded::decode(self)
    }
    fn stored_bytes(&self) -> usize {
        FieldsCoded::stored_bytes(self)
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    Ok(FieldsCoded::from_stored(s.dtype, s.shape, s.params(), |n, d| s.array(n, d))?.into())
}
