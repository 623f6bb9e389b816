//! `dtans-blocks`: a GGUF tensor of k-quant, IQ4 or FP4 blocks: codes and each side field a stream.

use super::stream::{choose_codes, code_field, decode_field, is_flag, predict_field};
use super::stream::{stream_from_stored, BlockStream, CodesChoice};
use super::{dtans_from_arrays, dtans_params, Arrays, Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::kquants::{FieldKind, Split};
use crate::qtype::GgmlType;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::dtans::DtansTensor;
use entrollm_codec::rans::RansStream;
use entrollm_codec::{CodecError, Payload};
use serde_json::{json, Value};
use std::borrow::Cow;

pub const DTANS_BLOCKS: &str = "dtans-blocks";

pub(super) const KIND: CoderKind = CoderKind {
    name: DTANS_BLOCKS,
    load,
};

/// A GGUF tensor of blocks that split ([`GgmlType::splits`]), losslessly: its codes (one per weight, weight order) as a
/// `rows × cols` int payload, and each of the blocks' side fields ([`GgmlType::fields`]: the f16
/// super-scales, the unpacked sub-block scales and mins) as its own stream, each in the coding
/// that stores it smallest. It decodes to the original block bytes.
pub struct BlocksCoded {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub codes: BlockStream,
    pub fields: Vec<BlockStream>,
}

impl BlocksCoded {
    /// The shape a container records for this tensor: `[rows, bytes per row]` of U8.
    pub fn stored_shape(ty: GgmlType, rows: usize, cols: usize) -> Vec<usize> {
        vec![rows, cols / ty.block_size() * ty.type_size()]
    }

    fn check_shape(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        s: &Split,
    ) -> entrollm_codec::Result<()> {
        if !cols.is_multiple_of(ty.block_size()) || s.codes.len() != rows * cols {
            return Err(CodecError::Shape(format!(
                "{} weights of {} blocks for a {rows}×{cols} tensor (rows must be whole blocks of {})",
                s.codes.len(),
                ty.name(),
                ty.block_size()
            )));
        }
        Ok(())
    }

    /// Codes the blocks `bytes` of a `rows × cols` tensor: the codes with `coding` (dtANS) or in
    /// the coding predicted smallest, each field with rANS where that is smaller. A stream is
    /// stored packed where its coding would not be smaller.
    pub fn encode(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        coding: Option<entrollm_codec::dtans::Coding>,
    ) -> entrollm_codec::Result<(Self, Split)> {
        let s = crate::kquants::split(ty, bytes).map_err(CodecError::Shape)?;
        Self::check_shape(ty, rows, cols, &s)?;
        let payload = Payload::Int(ty.code_bits() as u8);
        let packed = crate::kquants::pack_bits(&s.codes, ty.code_bits());
        let codes = match choose_codes(ty, rows, cols, &s.codes, coding)? {
            CodesChoice::Dtans(c, _) => {
                let t = DtansTensor::encode(payload, rows, cols, &s.codes, &[], c)?;
                match coding.is_some() || t.stored_bytes() < packed.len() {
                    true => BlockStream::Coded(t),
                    false => BlockStream::Packed(packed),
                }
            }
            CodesChoice::Rans(_) => {
                let stream = RansStream::encode(&s.codes, 1 << ty.code_bits())?;
                match stream.stored_bytes() < packed.len() {
                    true => BlockStream::Rans { stream, low: None },
                    false => BlockStream::Packed(packed),
                }
            }
            CodesChoice::Packed(_) => BlockStream::Packed(packed),
        };
        let fields = s
            .fields
            .iter()
            .zip(ty.fields())
            .map(|(v, f)| code_field(f.kind, v))
            .collect::<entrollm_codec::Result<Vec<_>>>()?;
        Ok((
            BlocksCoded {
                ty,
                rows,
                cols,
                codes,
                fields,
            },
            s,
        ))
    }

    /// Predicted stored bytes of [`Self::encode`] (from histograms, no coding), and the entropy
    /// bound in bits a weight: the codes' entropy plus each field's at its own value entropy.
    pub fn predict(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> entrollm_codec::Result<(f64, BlocksEntropy)> {
        let s = crate::kquants::split(ty, bytes).map_err(CodecError::Shape)?;
        Self::check_shape(ty, rows, cols, &s)?;
        let mut total = match choose_codes(ty, rows, cols, &s.codes, None)? {
            CodesChoice::Dtans(_, p) | CodesChoice::Rans(p) | CodesChoice::Packed(p) => p,
        };
        for (v, f) in s.fields.iter().zip(ty.fields()) {
            total += predict_field(f.kind, v)?;
        }
        Ok((total, BlocksEntropy::of(&s)))
    }

    /// The codes and fields as [`crate::kquants::join`] takes them.
    fn split(&self) -> entrollm_codec::Result<Split> {
        let n_codes = self.rows * self.cols;
        let n_blocks = n_codes / self.ty.block_size();
        let corrupt = |what: String| CodecError::Corrupt(what);
        let codes = match &self.codes {
            BlockStream::Coded(t) => t.decode()?,
            BlockStream::Rans { stream, .. } => stream.decode()?,
            BlockStream::Packed(b) => crate::kquants::unpack_bits(b, self.ty.code_bits(), n_codes)
                .ok_or_else(|| corrupt(format!("{} packed codes are not {n_codes}", b.len())))?,
        };
        if codes.len() != n_codes {
            return Err(corrupt(format!(
                "{} codes for {n_codes} weights",
                codes.len()
            )));
        }
        let fields = self
            .fields
            .iter()
            .zip(self.ty.fields())
            .map(|(stream, f)| {
                let n = n_blocks * f.per_block;
                decode_field(f.kind, stream, n, f.name)
            })
            .collect::<entrollm_codec::Result<Vec<_>>>()?;
        Ok(Split {
            ty: self.ty,
            codes,
            fields,
        })
    }

    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        crate::kquants::join(&self.split()?).map_err(CodecError::Corrupt)
    }

    pub fn stored_bytes(&self) -> usize {
        self.codes.stored_bytes()
            + self
                .fields
                .iter()
                .map(BlockStream::stored_bytes)
                .sum::<usize>()
    }

    /// Each stream's name, stored bytes and coding (`dtans`, `rans` or `packed`).
    pub fn streams(&self) -> Vec<(&'static str, usize, &'static str)> {
        let names = std::iter::once("codes").chain(self.ty.fields().iter().map(|f| f.name));
        names
            .zip(std::iter::once(&self.codes).chain(&self.fields))
            .map(|(n, s)| (n, s.stored_bytes(), s.coding()))
            .collect()
    }

    fn params(&self) -> Value {
        let fields: serde_json::Map<String, Value> = self
            .fields
            .iter()
            .zip(self.ty.fields())
            .map(|(s, f)| (f.name.to_string(), s.params()))
            .collect();
        json!({
            "type": self.ty, "rows": self.rows, "cols": self.cols,
            "codes": self.codes.params(), "fields": fields,
        })
    }

    fn arrays(&self) -> Vec<(String, ArrayDtype, Cow<'_, [u8]>)> {
        let names = std::iter::once("codes").chain(self.ty.fields().iter().map(|f| f.name));
        names
            .zip(std::iter::once(&self.codes).chain(&self.fields))
            .flat_map(|(name, s)| s.arrays(name))
            .collect()
    }

    fn from_stored<'a>(
        dtype: Dtype,
        shape: &[usize],
        params: &Value,
        array: impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
    ) -> Result<Self> {
        let err = FormatError::Usage;
        let ty = super::block_type(&params["type"], GgmlType::splits)?;
        let dim = |k: &str| {
            params[k]
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| err(format!("{DTANS_BLOCKS} params lack '{k}'")))
        };
        let (rows, cols) = (dim("rows")?, dim("cols")?);
        let n_codes = rows
            .checked_mul(cols)
            .filter(|&n| n <= 1 << 40)
            .ok_or_else(|| err(format!("{rows}×{cols} is too large")))?;
        if dtype != Dtype::U8
            || !cols.is_multiple_of(ty.block_size())
            || shape != Self::stored_shape(ty, rows, cols)
        {
            return Err(err(format!(
                "{} blocks of {rows}×{cols} weights are stored as U8 {:?}, not {dtype:?} {shape:?}",
                ty.name(),
                Self::stored_shape(ty, rows, cols)
            )));
        }
        let n_blocks = n_codes / ty.block_size();
        let p = &params["codes"];
        let payload = Payload::Int(ty.code_bits() as u8);
        let codes = if is_flag(p, "packed") || is_flag(p, "rans") {
            stream_from_stored(
                "codes",
                FieldKind::Bits(ty.code_bits() as u8),
                n_codes,
                p,
                &array,
            )?
        } else {
            let dp = dtans_params(p)?;
            if dp.payload != payload || (dp.rows, dp.cols) != (rows, cols) {
                return Err(err(format!(
                    "stream 'codes' is {:?} {}×{}, not {payload:?} {rows}×{cols}",
                    dp.payload, dp.rows, dp.cols
                )));
            }
            BlockStream::Coded(dtans_from_arrays(&dp, |a, d| {
                array(&format!("codes_{a}"), d)
            })?)
        };
        let fields = ty
            .fields()
            .iter()
            .map(|f| {
                let n = n_blocks * f.per_block;
                stream_from_stored(f.name, f.kind, n, &params["fields"][f.name], &array)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BlocksCoded {
            ty,
            rows,
            cols,
            codes,
            fields,
        })
    }
}

/// The entropy of a split tensor: its codes' (bits a code) and the bound in bits a weight.
#[derive(Clone, Copy, Debug)]
pub struct BlocksEntropy {
    pub code_bits: f64,
    pub side_bits_per_weight: f64,
}

impl BlocksEntropy {
    pub fn of(s: &Split) -> BlocksEntropy {
        use entrollm_codec::histogram::{byte_histogram, entropy_bits, u16_entropy_bits};
        let weights = s.codes.len().max(1) as f64;
        let side: f64 = s
            .fields
            .iter()
            .map(|v| u16_entropy_bits(v) * v.len() as f64)
            .sum::<f64>();
        BlocksEntropy {
            code_bits: entropy_bits(&byte_histogram(&s.codes)),
            side_bits_per_weight: side / weights,
        }
    }

    pub fn bound_bpw(&self) -> f64 {
        self.code_bits + self.side_bits_per_weight
    }
}

impl Coder for BlocksCoded {
    fn name(&self) -> &'static str {
        DTANS_BLOCKS
    }
    fn params(&self) -> Value {
        BlocksCoded::params(self)
    }
    fn arrays(&self) -> Arrays<'_> {
        BlocksCoded::arrays(self)
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        BlocksCoded::decode(self)
    }
    fn stored_bytes(&self) -> usize {
        BlocksCoded::stored_bytes(self)
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    Ok(BlocksCoded::from_stored(s.dtype, s.shape, s.params(), |n, d| s.array(n, d))?.into())
}
