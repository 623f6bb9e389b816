//! `ggml-scales`: a GGUF tensor of code-bearing blocks with only its f16 scales coded.

use super::{dtans_arrays, dtans_from_arrays, dtans_params, Arrays, Coded, Coder, CoderKind};
use super::{scale_matrix_shape, Stored};
use crate::container::ArrayDtype;
use crate::ggml_blocks::{has_m, QK};
use crate::qtype::GgmlType;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::dtans::DtansTensor;
use entrollm_codec::lossy::scalar::scale_matrix;
use entrollm_codec::{CodecError, Payload};
use serde_json::{json, Value};
use std::borrow::Cow;

pub const GGML_SCALES: &str = "ggml-scales";

pub(super) const KIND: CoderKind = CoderKind {
    name: GGML_SCALES,
    load,
};

/// A GGUF tensor of code-bearing blocks whose codes do not code smaller (rows too short for the
/// coder's slices to pay, or near-uniform codes) but whose f16 scales do: each block's bytes after
/// its scales kept as they are (`rest`, blocks in order), and all blocks' scales `d` (and offsets
/// `m`) as one dtANS-coded FP16 stream each: the stream row-major in a matrix of
/// [`scale_matrix_shape`], its tail padded with the last scale.
pub struct GgmlScales {
    pub block: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub rest: Vec<u8>,
    pub d: DtansTensor,
    pub m: Option<DtansTensor>,
}

/// Bytes of a block's scales (`d`, and `m` for the `_1` types), which lead each block.
pub(super) fn scale_bytes(block: GgmlType) -> usize {
    if has_m(block) {
        4
    } else {
        2
    }
}

impl GgmlScales {
    /// The blocks `bytes` of a `rows × cols` tensor with their scales coded (each stream in the
    /// coding the coder predicts smallest).
    pub fn encode(
        block: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> entrollm_codec::Result<Self> {
        let q = crate::ggml_blocks::unpack_codes(block, bytes).map_err(CodecError::Shape)?;
        if q.codes.len() != rows * cols {
            return Err(CodecError::Shape(format!(
                "{} blocks of {} weights for a {rows}×{cols} tensor",
                q.d.len(),
                q.codes.len()
            )));
        }
        let code = |v: &[u16]| -> entrollm_codec::Result<DtansTensor> {
            let (r, c, b) = scale_matrix(v);
            let (codes, raw) = Payload::Fp16.symbolize(&b)?;
            let (coding, _) =
                entrollm_codec::dtans::choose_coding_and_width(Payload::Fp16, r, c, &codes)?;
            DtansTensor::encode(Payload::Fp16, r, c, &codes, &raw, coding)
        };
        let (bb, sb) = (block.type_size(), scale_bytes(block));
        Ok(GgmlScales {
            block,
            rows,
            cols,
            rest: bytes
                .chunks_exact(bb)
                .flat_map(|b| &b[sb..])
                .copied()
                .collect(),
            d: code(&q.d)?,
            m: q.m.as_deref().map(code).transpose()?,
        })
    }

    /// Predicted stored bytes of [`GgmlScales::encode`] for these blocks (from the scales'
    /// histograms, no coding).
    pub fn predict_bytes(block: GgmlType, bytes: &[u8]) -> entrollm_codec::Result<f64> {
        let q = crate::ggml_blocks::unpack_codes(block, bytes).map_err(CodecError::Shape)?;
        let predict = |v: &[u16]| -> entrollm_codec::Result<f64> {
            let (r, c, b) = scale_matrix(v);
            let (codes, _) = Payload::Fp16.symbolize(&b)?;
            Ok(entrollm_codec::dtans::choose_coding_and_width(Payload::Fp16, r, c, &codes)?.1)
        };
        let rest = q.d.len() * (block.type_size() - scale_bytes(block));
        Ok(rest as f64 + predict(&q.d)? + q.m.as_deref().map_or(Ok(0.0), predict)?)
    }

    fn decode_blocks(&self) -> entrollm_codec::Result<Vec<u8>> {
        let n = self.rows * self.cols / QK;
        let scales = |t: &DtansTensor| -> entrollm_codec::Result<Vec<u8>> {
            let mut v = t.decode()?;
            v.truncate(2 * n);
            Ok(v)
        };
        let d = scales(&self.d)?;
        let m = self.m.as_ref().map(scales).transpose()?;
        let (bb, sb) = (self.block.type_size(), scale_bytes(self.block));
        let corrupt = |what: &str| CodecError::Corrupt(what.to_string());
        if d.len() != 2 * n
            || self.rest.len() != n * (bb - sb)
            || m.as_ref().is_some_and(|m| m.len() != 2 * n)
        {
            return Err(corrupt(
                "ggml-scales: scales or codes do not cover every block",
            ));
        }
        let mut out = Vec::with_capacity(n * bb);
        for (i, rest) in self.rest.chunks_exact(bb - sb).enumerate() {
            out.extend_from_slice(&d[2 * i..2 * i + 2]);
            if let Some(m) = &m {
                out.extend_from_slice(&m[2 * i..2 * i + 2]);
            }
            out.extend_from_slice(rest);
        }
        Ok(out)
    }

    fn bytes(&self) -> usize {
        self.rest.len() + self.d.stored_bytes() + self.m.as_ref().map_or(0, |m| m.stored_bytes())
    }
}

impl Coder for GgmlScales {
    fn name(&self) -> &'static str {
        GGML_SCALES
    }
    fn params(&self) -> Value {
        let p = |t: &DtansTensor| serde_json::to_value(t.params()).expect("params");
        let mut v = json!({
            "block": self.block, "rows": self.rows, "cols": self.cols, "d": p(&self.d),
        });
        if let Some(m) = &self.m {
            v["m"] = p(m);
        }
        v
    }
    fn arrays(&self) -> Arrays<'_> {
        let mut v = vec![(
            "rest".to_string(),
            ArrayDtype::U8,
            Cow::Borrowed(&self.rest[..]),
        )];
        fn prefixed<'t>(
            p: &'static str,
            t: &'t DtansTensor,
        ) -> impl Iterator<Item = (String, ArrayDtype, Cow<'t, [u8]>)> {
            dtans_arrays(t)
                .into_iter()
                .map(move |(n, d, b)| (format!("{p}_{n}"), d, b))
        }
        v.extend(prefixed("d", &self.d));
        if let Some(m) = &self.m {
            v.extend(prefixed("m", m));
        }
        v
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        self.decode_blocks()
    }
    fn stored_bytes(&self) -> usize {
        self.bytes()
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    let (dtype, shape, params) = (s.dtype, s.shape, s.params());
    let block = super::block_type(&params["block"], crate::ggml_blocks::handles)?;
    let dim = |k: &str| {
        params[k]
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| err(format!("ggml-scales params lack '{k}'")))
    };
    let (rows, cols) = (dim("rows")?, dim("cols")?);
    if dtype != Dtype::U8
        || !cols.is_multiple_of(QK)
        || shape != super::GgmlCoded::stored_shape(block, rows, cols)
    {
        return Err(err(format!(
            "{} blocks of {rows}×{cols} weights are stored as U8 {:?}, not {dtype:?} \
             {shape:?}",
            block.name(),
            super::GgmlCoded::stored_shape(block, rows, cols)
        )));
    }
    let n = rows * cols / QK;
    let stream = |k: &str| -> Result<DtansTensor> {
        let p = dtans_params(&params[k])?;
        if p.payload != Payload::Fp16 || (p.rows, p.cols) != scale_matrix_shape(n) {
            return Err(err(format!(
                "scale stream '{k}' is {:?} {}×{}, not FP16 covering {n} blocks",
                p.payload, p.rows, p.cols
            )));
        }
        dtans_from_arrays(&p, |a, d| s.array(&format!("{k}_{a}"), d))
    };
    let rest = s.array("rest", ArrayDtype::U8)?;
    let want = n * (block.type_size() - scale_bytes(block));
    if rest.len() != want {
        return Err(err(format!(
            "array 'rest' holds {} bytes, {n} {} blocks need {want}",
            rest.len(),
            block.name()
        )));
    }
    Ok(GgmlScales {
        block,
        rows,
        cols,
        rest: rest.to_vec(),
        d: stream("d")?,
        m: has_m(block).then(|| stream("m")).transpose()?,
    }
    .into())
}
