//! `dtans-ggml`: a GGUF tensor of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks, its codes dtANS-coded.

use super::{dtans_arrays, dtans_from_arrays, dtans_params, to_u16, u16_bytes, Arrays};
use super::{Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::ggml_blocks::{has_m, pack_codes, QuantCodes, QK};
use crate::qtype::GgmlType;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::dtans::DtansTensor;
use entrollm_codec::Payload;
use serde_json::{json, Value};

pub const DTANS_GGML: &str = "dtans-ggml";

pub(super) const KIND: CoderKind = CoderKind {
    name: DTANS_GGML,
    load,
};

/// A GGUF tensor of code-bearing blocks, losslessly: its integer codes dtANS-coded as an int
/// payload (`rows × cols` weights), the blocks' f16 scales `d` (and offsets `m`) stored beside. The
/// decoded form is the original block bytes; the weights are `d·(code − offset) (+ m)` per block of
/// 32 columns, which the fused matvec applies in its epilogue.
pub struct GgmlCoded {
    pub block: GgmlType,
    pub codes: DtansTensor,
    pub d: Vec<u16>,
    pub m: Option<Vec<u16>>,
}

impl GgmlCoded {
    /// The shape a container records for this tensor: `[rows, bytes per row]` of U8.
    pub fn stored_shape(block: GgmlType, rows: usize, cols: usize) -> Vec<usize> {
        vec![rows, cols / QK * block.type_size()]
    }

    /// The per-block scales and offsets as f32, in block order (row-major, `cols / 32` per row).
    pub fn scales_f32(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let f = |v: &[u16]| -> Vec<f32> {
            v.iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect()
        };
        (f(&self.d), self.m.as_deref().map(f))
    }
}

impl GgmlCoded {
    fn packed(&self, codes: Vec<u8>) -> entrollm_codec::Result<Vec<u8>> {
        pack_codes(&QuantCodes {
            block: self.block,
            codes,
            d: self.d.clone(),
            m: self.m.clone(),
        })
        .map_err(entrollm_codec::CodecError::Corrupt)
    }
}

impl Coder for GgmlCoded {
    fn name(&self) -> &'static str {
        DTANS_GGML
    }
    fn params(&self) -> Value {
        let mut v = serde_json::to_value(self.codes.params()).expect("params serialise");
        v["block"] = json!(self.block);
        v
    }
    fn arrays(&self) -> Arrays<'_> {
        let mut v = dtans_arrays(&self.codes);
        v.push(("d".to_string(), ArrayDtype::U8, u16_bytes(&self.d)));
        if let Some(m) = &self.m {
            v.push(("m".to_string(), ArrayDtype::U8, u16_bytes(m)));
        }
        v
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        self.packed(self.codes.decode()?)
    }
    fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        let (codes, b) = self.codes.decode_with_breakdown()?;
        Ok((self.packed(codes)?, Some(b)))
    }
    fn stored_bytes(&self) -> usize {
        self.codes.stored_bytes() + 2 * (self.d.len() + self.m.as_ref().map_or(0, Vec::len))
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    let (dtype, shape) = (s.dtype, s.shape);
    let p = dtans_params(s.params())?;
    let block = super::block_type(&s.params()["block"], crate::ggml_blocks::handles)?;
    if p.payload != Payload::Int(block.code_bits() as u8) {
        return Err(err(format!(
            "{} codes are {}-bit integers, not a {:?} payload",
            block.name(),
            block.code_bits(),
            p.payload
        )));
    }
    if dtype != Dtype::U8
        || !p.cols.is_multiple_of(QK)
        || shape != GgmlCoded::stored_shape(block, p.rows, p.cols)
    {
        return Err(err(format!(
            "{} blocks of {}×{} weights are stored as U8 {:?}, not {dtype:?} {shape:?}",
            block.name(),
            p.rows,
            p.cols,
            GgmlCoded::stored_shape(block, p.rows, p.cols)
        )));
    }
    let n_blocks = p.rows * p.cols / QK;
    let scales = |n: &str| -> Result<Vec<u16>> {
        let v = to_u16(s.array(n, ArrayDtype::U8)?);
        if v.len() != n_blocks {
            return Err(err(format!(
                "array '{n}' holds {} scales for {n_blocks} blocks",
                v.len()
            )));
        }
        Ok(v)
    };
    Ok(GgmlCoded {
        block,
        codes: dtans_from_arrays(&p, |n, d| s.array(n, d))?,
        d: scales("d")?,
        m: has_m(block).then(|| scales("m")).transpose()?,
    }
    .into())
}
