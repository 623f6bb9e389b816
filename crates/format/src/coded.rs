//! Coded tensors in the container: how the codec's coded forms map to a container's arrays and JSON
//! parameters, and back. `docs/dtans.md` and `docs/format.md` describe the arrays.

use crate::container::{ArrayDtype, CodedTensor};
use crate::ggml_blocks::{has_m, pack_codes, QuantCodes, QK};
use crate::kquants::{FieldKind, Split};
use crate::qtype::GgmlType;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{DtansParams, DtansTensor};
use entrollm_codec::lossy::scalar::scale_matrix;
/// The FP16 matrix shape block scales (and scalar codes' scales) are coded in.
pub use entrollm_codec::lossy::scalar::scale_matrix_shape;
use entrollm_codec::lossy::scalar::{Scalar, ScaleStore};
use entrollm_codec::lossy::LossyTensor;
use entrollm_codec::rans::RansStream;
use entrollm_codec::{CodecError, Payload};
use serde_json::{json, Value};
use std::borrow::Cow;

/// Coder names as the manifest records them.
pub const DTANS: &str = "dtans";
pub const DF11: &str = "df11";
pub const DTANS_GGML: &str = "dtans-ggml";
pub const GGML_SCALES: &str = "ggml-scales";
pub const LOSSY: &str = "lossy";
pub const DTANS_BLOCKS: &str = "dtans-blocks";
pub const RANS_FIELDS: &str = "rans-fields";
pub const RANS_FLOATS: &str = "rans-floats";
pub const DTANS_SCALAR: &str = "dtans-scalar";

/// A tensor in one of the codec's coded forms.
pub enum Coded {
    Dtans(DtansTensor),
    Df11(Df11Tensor),
    /// A GGUF tensor of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks.
    Ggml(GgmlCoded),
    /// A GGUF tensor of such blocks with only its scales coded.
    GgmlScales(GgmlScales),
    /// A float matrix coded lossily: it decodes to its reconstruction, not to the source.
    Lossy(LossyCoded),
    /// A GGUF tensor of k-quant, IQ4 or FP4 blocks: codes and each side field a stream.
    Blocks(BlocksCoded),
    /// Any other tensor as a stream of its bytes' fields (packed integer codes, group scales).
    Fields(FieldsCoded),
    /// A 16-bit float matrix as rANS over its codes beside its raw bytes (narrow matrices).
    Floats(FloatsCoded),
    /// A float matrix coded lossily by a scalar quantiser (`compress --quantizer int|fp8`): its
    /// codes dtANS-coded as the fused products serve them, with group scales; it decodes to its
    /// reconstruction, as [`Coded::Lossy`] does.
    Scalar(ScalarCoded),
}

/// A scalar-quantised matrix and the float dtype it decodes to.
#[derive(Clone, Debug)]
pub struct ScalarCoded {
    pub dtype: Dtype,
    pub tensor: entrollm_codec::lossy::scalar::ScalarTensor,
}

impl ScalarCoded {
    /// The reconstruction as bytes of `dtype` (rounded to nearest, halves saturated).
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        reconstruction_bytes(self.dtype, &self.tensor.decode()?)
    }
}

/// A lossy reconstruction as bytes of `dtype`: rounded to nearest, saturated to the dtype's range
/// (a point can land past the largest finite half).
fn reconstruction_bytes(dtype: Dtype, v: &[f32]) -> entrollm_codec::Result<Vec<u8>> {
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

/// The ggml type `v` names, one `accepts` takes (an error otherwise).
fn block_type(v: &Value, accepts: fn(GgmlType) -> bool) -> Result<GgmlType> {
    let ty: GgmlType = serde_json::from_value(v.clone())
        .map_err(|e| FormatError::Usage(format!("bad block type: {e}")))?;
    match accepts(ty) {
        true => Ok(ty),
        false => Err(FormatError::Usage(format!(
            "bad block type: {ty} for this coding"
        ))),
    }
}

/// Bytes of a block's scales (`d`, and `m` for the `_1` types), which lead each block.
fn scale_bytes(block: GgmlType) -> usize {
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

    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
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

    fn stored_bytes(&self) -> usize {
        self.rest.len() + self.d.stored_bytes() + self.m.as_ref().map_or(0, |m| m.stored_bytes())
    }
}

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

/// One stream of a [`BlocksCoded`] tensor: dtANS-coded (codes only: the form fused kernels
/// decode), rANS-coded, or its values bit-packed where no coding shrinks them.
pub enum BlockStream {
    Coded(DtansTensor),
    /// rANS over the values; for halves over their high bytes, the low bytes (`low`) a second
    /// rANS stream (a quantiser's scales are far from uniform in both).
    Rans {
        stream: RansStream,
        low: Option<RansStream>,
    },
    Packed(Vec<u8>),
}

impl BlockStream {
    /// `dtans`, `rans` or `packed`.
    fn coding(&self) -> &'static str {
        match self {
            BlockStream::Coded(_) => "dtans",
            BlockStream::Rans { .. } => "rans",
            BlockStream::Packed(_) => "packed",
        }
    }

    fn stored_bytes(&self) -> usize {
        match self {
            BlockStream::Coded(t) => t.stored_bytes(),
            BlockStream::Rans { stream, low } => {
                stream.stored_bytes() + low.as_ref().map_or(0, RansStream::stored_bytes)
            }
            BlockStream::Packed(b) => b.len(),
        }
    }

    fn params(&self) -> Value {
        match self {
            BlockStream::Coded(t) => serde_json::to_value(t.params()).expect("params serialise"),
            BlockStream::Rans { .. } => json!({ "rans": true }),
            BlockStream::Packed(_) => json!({ "packed": true }),
        }
    }

    fn arrays<'s>(&'s self, name: &str) -> Vec<(String, ArrayDtype, Cow<'s, [u8]>)> {
        let a = |n: &str, d, b| (format!("{name}_{n}"), d, b);
        match self {
            BlockStream::Coded(t) => dtans_arrays(t)
                .into_iter()
                .map(|(n, d, b)| a(&n, d, b))
                .collect(),
            BlockStream::Rans { stream, low } => {
                let rans = |p: &str, r: &'s RansStream| {
                    vec![
                        a(
                            &format!("{p}table"),
                            ArrayDtype::U8,
                            Cow::Owned(entrollm_codec::rans::table_bytes(&r.freqs)),
                        ),
                        a(
                            &format!("{p}offsets"),
                            ArrayDtype::U32,
                            u32_bytes(&r.offsets),
                        ),
                        a(&format!("{p}words"), ArrayDtype::U8, u16_bytes(&r.words)),
                    ]
                };
                let mut v = rans("", stream);
                if let Some(low) = low {
                    v.extend(rans("low_", low));
                }
                v
            }
            BlockStream::Packed(b) => {
                vec![(name.to_string(), ArrayDtype::U8, Cow::Borrowed(&b[..]))]
            }
        }
    }
}

/// Bits of a field's value.
fn field_bits(kind: FieldKind) -> u32 {
    match kind {
        FieldKind::Half => 16,
        FieldKind::Bits(b) => u32::from(b),
    }
}

/// A field's values bit-packed (halves as little-endian u16).
fn pack_field(kind: FieldKind, v: &[u16]) -> Vec<u8> {
    match kind {
        FieldKind::Half => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        FieldKind::Bits(b) => {
            let bytes: Vec<u8> = v.iter().map(|&x| x as u8).collect();
            crate::kquants::pack_bits(&bytes, u32::from(b))
        }
    }
}

fn unpack_field(kind: FieldKind, b: &[u8], n: usize) -> Option<Vec<u16>> {
    match kind {
        FieldKind::Half => (b.len() == 2 * n).then(|| to_u16(b)),
        FieldKind::Bits(bits) => crate::kquants::unpack_bits(b, u32::from(bits), n)
            .map(|v| v.into_iter().map(u16::from).collect()),
    }
}

/// A field's values as rANS symbols (the high bytes of halves) with their alphabet, and the low
/// bytes of halves.
fn field_symbols(kind: FieldKind, v: &[u16]) -> (Vec<u8>, usize, Option<Vec<u8>>) {
    match kind {
        FieldKind::Half => (
            v.iter().map(|&x| (x >> 8) as u8).collect(),
            256,
            Some(v.iter().map(|&x| x as u8).collect()),
        ),
        FieldKind::Bits(b) => (v.iter().map(|&x| x as u8).collect(), 1 << b, None),
    }
}

fn counts(symbols: &[u8], alphabet: usize) -> Vec<u64> {
    entrollm_codec::histogram::byte_histogram(symbols)[..alphabet].to_vec()
}

/// dtANS is kept for codes unless rANS is smaller by this many bits a weight: dtANS codes are
/// what a fused product can decode in place.
pub const RANS_MARGIN_BITS: f64 = 0.03;

/// Which coding a split tensor's codes get, with its predicted bytes.
enum CodesChoice {
    Dtans(entrollm_codec::dtans::Coding, f64),
    Rans(f64),
    Packed(f64),
}

fn choose_codes(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    codes: &[u8],
    coding: Option<entrollm_codec::dtans::Coding>,
) -> entrollm_codec::Result<CodesChoice> {
    let payload = Payload::Int(ty.code_bits() as u8);
    if let Some(c) = coding {
        let p = DtansTensor::predict_bytes(payload, rows, cols, codes, c)?;
        return Ok(CodesChoice::Dtans(c, p));
    }
    let packed = (codes.len() * ty.code_bits() as usize).div_ceil(8) as f64;
    let rans = RansStream::predict_bytes(&counts(codes, 1 << ty.code_bits()))?;
    let (c, dtans) = entrollm_codec::dtans::choose_coding_and_width(payload, rows, cols, codes)?;
    let margin = RANS_MARGIN_BITS * codes.len() as f64 / 8.0;
    Ok(if dtans < packed && dtans <= rans + margin {
        CodesChoice::Dtans(c, dtans)
    } else if rans < packed {
        CodesChoice::Rans(rans)
    } else {
        CodesChoice::Packed(packed)
    })
}

/// A field's stream: rANS where it is smaller than the packed values.
fn code_field(kind: FieldKind, v: &[u16]) -> entrollm_codec::Result<BlockStream> {
    let packed = pack_field(kind, v);
    if v.is_empty() {
        return Ok(BlockStream::Packed(packed));
    }
    let (symbols, alphabet, low) = field_symbols(kind, v);
    let stream = RansStream::encode(&symbols, alphabet)?;
    let low = low.map(|l| RansStream::encode(&l, 256)).transpose()?;
    let s = BlockStream::Rans { stream, low };
    Ok(match s.stored_bytes() < packed.len() {
        true => s,
        false => BlockStream::Packed(packed),
    })
}

fn predict_field(kind: FieldKind, v: &[u16]) -> entrollm_codec::Result<f64> {
    let packed = (v.len() * field_bits(kind) as usize).div_ceil(8) as f64;
    if v.is_empty() {
        return Ok(packed);
    }
    let (symbols, alphabet, low) = field_symbols(kind, v);
    let low = match low {
        Some(l) => RansStream::predict_bytes(&counts(&l, 256))?,
        None => 0.0,
    };
    Ok((RansStream::predict_bytes(&counts(&symbols, alphabet))? + low).min(packed))
}

/// The `n` values of a field's stream (named `name` in errors).
fn decode_field(
    kind: FieldKind,
    stream: &BlockStream,
    n: usize,
    name: &str,
) -> entrollm_codec::Result<Vec<u16>> {
    let corrupt = |what: String| CodecError::Corrupt(what);
    // A stream's own errors, named.
    let named = |e: CodecError| match e {
        CodecError::Corrupt(m) | CodecError::Shape(m) | CodecError::Unsupported(m) => {
            corrupt(format!("stream '{name}': {m}"))
        }
    };
    let v: Vec<u16> = match stream {
        BlockStream::Rans { stream, low } => {
            let hi = stream.decode().map_err(named)?;
            match (kind, low) {
                (FieldKind::Half, Some(low)) => {
                    let lo = low.decode().map_err(named)?;
                    if lo.len() != hi.len() {
                        return Err(corrupt(format!(
                            "field {name}: {} low bytes for {} values",
                            lo.len(),
                            hi.len()
                        )));
                    }
                    hi.iter()
                        .zip(&lo)
                        .map(|(&h, &l)| u16::from(h) << 8 | u16::from(l))
                        .collect()
                }
                (FieldKind::Bits(_), None) => hi.into_iter().map(u16::from).collect(),
                _ => {
                    return Err(corrupt(format!(
                        "field {name}: low bytes are for f16 fields only"
                    )))
                }
            }
        }
        BlockStream::Packed(b) => unpack_field(kind, b, n).ok_or_else(|| {
            corrupt(format!(
                "field {name}: {} packed bytes do not hold {n} values",
                b.len()
            ))
        })?,
        BlockStream::Coded(_) => {
            return Err(corrupt(format!("field {name} cannot be dtANS-coded")))
        }
    };
    if v.len() != n {
        return Err(corrupt(format!(
            "field {name}: {} values, {n} expected",
            v.len()
        )));
    }
    Ok(v)
}

/// A GGUF tensor of blocks that split ([`GgmlType::splits`]), losslessly: its codes (one per
/// weight, weight order) as a `rows × cols` int payload, and each of the blocks' side fields
/// ([`GgmlType::fields`]: the f16 super-scales, the unpacked sub-block scales and mins) as its
/// own stream, each in the coding that stores it smallest. It decodes to the original block bytes.
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
        let ty = block_type(&params["type"], GgmlType::splits)?;
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

fn is_flag(p: &Value, k: &str) -> bool {
    p.get(k).and_then(Value::as_bool) == Some(true)
}

/// A stream of `n` values of `kind` named `name`, rANS-coded or packed as `p` says, from its
/// arrays: `NAME` packed; `NAME_table`, `NAME_offsets`, `NAME_words` (and for halves the low
/// bytes' `NAME_low_*`) rANS-coded.
fn stream_from_stored<'a>(
    name: &str,
    kind: FieldKind,
    n: usize,
    p: &Value,
    array: &impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
) -> Result<BlockStream> {
    let err = FormatError::Usage;
    // A rANS stream of `n` symbols of `alphabet` (arrays `NAME_PREFIXtable` …).
    let one = |prefix: &str, alphabet: usize| -> Result<RansStream> {
        let a = |k: &str, d| array(&format!("{name}_{prefix}{k}"), d);
        // Containers before the compact tables stored each frequency as a u16 (`freqs`).
        let freqs = match a("table", ArrayDtype::U8) {
            Ok(t) => entrollm_codec::rans::table_freqs(t, alphabet)
                .map_err(|e| err(format!("stream '{name}': {e}")))?,
            Err(e) => to_u16(a("freqs", ArrayDtype::U8).map_err(|_| e)?),
        };
        let stream = RansStream {
            n,
            freqs,
            offsets: to_u32(a("offsets", ArrayDtype::U32)?),
            words: to_u16(a("words", ArrayDtype::U8)?),
        };
        stream
            .validate()
            .map_err(|e| err(format!("stream '{name}': {e}")))?;
        if stream.freqs.len() != alphabet {
            return Err(err(format!(
                "stream '{name}' has a table of {} symbols, not {alphabet}",
                stream.freqs.len()
            )));
        }
        Ok(stream)
    };
    if is_flag(p, "rans") {
        let (alphabet, halves) = match kind {
            FieldKind::Half => (256, true),
            FieldKind::Bits(b) => (1 << b, false),
        };
        Ok(BlockStream::Rans {
            stream: one("", alphabet)?,
            low: halves.then(|| one("low_", 256)).transpose()?,
        })
    } else if is_flag(p, "packed") {
        let len = n
            .checked_mul(field_bits(kind) as usize)
            .ok_or_else(|| err(format!("stream '{name}' of {n} values is too large")))?
            .div_ceil(8);
        let b = array(name, ArrayDtype::U8)?;
        if b.len() != len {
            return Err(err(format!(
                "array '{name}' holds {} bytes, {len} expected",
                b.len()
            )));
        }
        Ok(BlockStream::Packed(b.to_vec()))
    } else {
        Err(err(format!("stream '{name}' is neither rans nor packed")))
    }
}

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

fn u16_bytes(v: &[u16]) -> Cow<'_, [u8]> {
    Cow::Owned(v.iter().flat_map(|w| w.to_le_bytes()).collect())
}

fn to_u16(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// The payload that codes a tensor stored as `dtype`, if any.
pub fn payload_of(dtype: Dtype) -> Option<Payload> {
    match dtype {
        Dtype::BF16 => Some(Payload::Bf16),
        Dtype::F16 => Some(Payload::Fp16),
        Dtype::F8E4M3 => Some(Payload::Fp8E4m3),
        Dtype::F8E5M2 => Some(Payload::Fp8E5m2),
        _ => None,
    }
}

fn u32_bytes(v: &[u32]) -> Cow<'_, [u8]> {
    Cow::Owned(v.iter().flat_map(|w| w.to_le_bytes()).collect())
}

fn to_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn dtans_params(params: &Value) -> Result<DtansParams> {
    serde_json::from_value(params.clone())
        .map_err(|e| FormatError::Usage(format!("bad dtans params: {e}")))
}

/// The arrays of a dtANS tensor (`docs/dtans.md`).
fn dtans_arrays(t: &DtansTensor) -> Vec<(String, ArrayDtype, Cow<'_, [u8]>)> {
    let a = |n: &str, d, b| (n.to_string(), d, b);
    let symbols: Vec<u32> = t.table.symbols.iter().map(|&s| s as u32).collect();
    vec![
        a(
            "symbols",
            ArrayDtype::U32,
            Cow::Owned(u32_bytes(&symbols).into_owned()),
        ),
        a("counts", ArrayDtype::U8, Cow::Borrowed(&t.table.counts[..])),
        a("tiles", ArrayDtype::U32, u32_bytes(&t.tiles)),
        a("stream", ArrayDtype::U32, u32_bytes(&t.stream)),
        a("companion", ArrayDtype::U32, u32_bytes(&t.companion)),
        a("raw", ArrayDtype::U8, Cow::Borrowed(&t.raw[..])),
    ]
}

/// A dtANS tensor from its stored arrays; `array(name, dtype)` fetches one.
fn dtans_from_arrays<'a>(
    p: &DtansParams,
    array: impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
) -> Result<DtansTensor> {
    let err = FormatError::Usage;
    let symbols = to_u32(array("symbols", ArrayDtype::U32)?)
        .iter()
        .map(|&s| u16::try_from(s).map_err(|_| err(format!("table symbol {s} exceeds 16 bits"))))
        .collect::<Result<Vec<u16>>>()?;
    DtansTensor::from_parts(
        p,
        symbols,
        array("counts", ArrayDtype::U8)?.to_vec(),
        to_u32(array("tiles", ArrayDtype::U32)?),
        to_u32(array("stream", ArrayDtype::U32)?),
        to_u32(array("companion", ArrayDtype::U32)?),
        array("raw", ArrayDtype::U8)?.to_vec(),
    )
    .map_err(|e| err(e.to_string()))
}

impl Coded {
    pub fn coder(&self) -> &'static str {
        match self {
            Coded::Dtans(_) => DTANS,
            Coded::Df11(_) => DF11,
            Coded::Ggml(_) => DTANS_GGML,
            Coded::GgmlScales(_) => GGML_SCALES,
            Coded::Lossy(_) => LOSSY,
            Coded::Blocks(_) => DTANS_BLOCKS,
            Coded::Fields(_) => RANS_FIELDS,
            Coded::Floats(_) => RANS_FLOATS,
            Coded::Scalar(_) => DTANS_SCALAR,
        }
    }

    /// The parameters the manifest stores, with `stats` (shown by `inspect`) added.
    pub fn params(&self, stats: Value) -> Value {
        let mut v = match self {
            Coded::Dtans(t) => serde_json::to_value(t.params()).expect("params serialise"),
            Coded::Df11(t) => json!({ "n_elements": t.n_elements }),
            Coded::Ggml(g) => {
                let mut v = serde_json::to_value(g.codes.params()).expect("params serialise");
                v["block"] = json!(g.block);
                v
            }
            Coded::GgmlScales(g) => {
                let p = |t: &DtansTensor| serde_json::to_value(t.params()).expect("params");
                let mut v = json!({
                    "block": g.block, "rows": g.rows, "cols": g.cols, "d": p(&g.d),
                });
                if let Some(m) = &g.m {
                    v["m"] = p(m);
                }
                v
            }
            Coded::Lossy(l) => json!({
                "quantizer": l.tensor.quantizer.to_string(),
                "rows": l.tensor.rows,
                "cols": l.tensor.cols,
                "bits_per_weight": l.tensor.bits_per_weight(),
            }),
            Coded::Blocks(b) => b.params(),
            Coded::Fields(f) => json!({ "bits": f.bits, "stream": f.stream.params() }),
            Coded::Floats(f) => json!({ "stream": f.codes.params() }),
            Coded::Scalar(q) => {
                let t = &q.tensor;
                let mut v = json!({
                    "quantizer": t.quantizer.to_string(),
                    "group": t.group,
                    "codes": t.codes.params(),
                    "bits_per_weight": t.bits_per_weight(),
                });
                match &t.scales {
                    ScaleStore::Raw(_) => v["scales"] = json!("raw"),
                    ScaleStore::Coded { n, stream } => {
                        v["scales"] = json!({ "n": n, "stream": stream.params() })
                    }
                }
                v
            }
        };
        v["stats"] = stats;
        v
    }

    /// The arrays to store, by name.
    pub fn arrays(&self) -> Vec<(String, ArrayDtype, Cow<'_, [u8]>)> {
        let a = |n: &str, d, b| (n.to_string(), d, b);
        match self {
            Coded::Dtans(t) => dtans_arrays(t),
            Coded::Ggml(g) => {
                let mut v = dtans_arrays(&g.codes);
                v.push(a("d", ArrayDtype::U8, u16_bytes(&g.d)));
                if let Some(m) = &g.m {
                    v.push(a("m", ArrayDtype::U8, u16_bytes(m)));
                }
                v
            }
            Coded::GgmlScales(g) => {
                let mut v = vec![a("rest", ArrayDtype::U8, Cow::Borrowed(&g.rest[..]))];
                fn prefixed<'t>(
                    p: &'static str,
                    t: &'t DtansTensor,
                ) -> impl Iterator<Item = (String, ArrayDtype, Cow<'t, [u8]>)> {
                    dtans_arrays(t)
                        .into_iter()
                        .map(move |(n, d, b)| (format!("{p}_{n}"), d, b))
                }
                v.extend(prefixed("d", &g.d));
                if let Some(m) = &g.m {
                    v.extend(prefixed("m", m));
                }
                v
            }
            Coded::Lossy(l) => vec![a("data", ArrayDtype::U8, Cow::Owned(l.tensor.to_bytes()))],
            Coded::Scalar(q) => {
                let mut v: Vec<_> = dtans_arrays(&q.tensor.codes)
                    .into_iter()
                    .map(|(n, d, b)| (format!("codes_{n}"), d, b))
                    .collect();
                match &q.tensor.scales {
                    ScaleStore::Raw(r) => v.push(a("scales", ArrayDtype::U8, u16_bytes(r))),
                    ScaleStore::Coded { stream, .. } => v.extend(
                        dtans_arrays(stream)
                            .into_iter()
                            .map(|(n, d, b)| (format!("scales_{n}"), d, b)),
                    ),
                }
                v
            }
            Coded::Blocks(b) => b.arrays(),
            Coded::Fields(f) => f.stream.arrays("fields"),
            Coded::Floats(f) => {
                let mut v = f.codes.arrays("codes");
                v.push(a("raw", ArrayDtype::U8, Cow::Borrowed(&f.raw[..])));
                v
            }
            Coded::Df11(t) => vec![
                a("luts", ArrayDtype::U8, Cow::Borrowed(&t.luts[..])),
                a(
                    "encoded_exponent",
                    ArrayDtype::U8,
                    Cow::Borrowed(&t.encoded_exponent[..]),
                ),
                a(
                    "sign_mantissa",
                    ArrayDtype::U8,
                    Cow::Borrowed(&t.sign_mantissa[..]),
                ),
                a(
                    "output_positions",
                    ArrayDtype::U32,
                    u32_bytes(&t.output_positions),
                ),
                a("gaps", ArrayDtype::U8, Cow::Borrowed(&t.gaps[..])),
            ],
        }
    }

    /// Rebuilds a coded tensor from the container, checking that it matches the tensor's dtype and
    /// shape and that its structure is sound. Callers add the tensor's name to errors.
    pub fn from_stored(dtype: Dtype, shape: &[usize], c: &CodedTensor<'_>) -> Result<Coded> {
        let err = FormatError::Usage;
        let array = |n: &str, want: ArrayDtype| -> Result<&[u8]> {
            match c.arrays.get(n) {
                Some(&(d, b)) if d == want => Ok(b),
                Some(&(d, _)) => Err(err(format!("array '{n}' is {d:?}, expected {want:?}"))),
                None => Err(err(format!("{} tensor has no '{n}' array", c.coder))),
            }
        };
        let numel: usize = shape.iter().product();
        match c.coder {
            DTANS => {
                let p = dtans_params(c.params)?;
                if payload_of(dtype) != Some(p.payload) {
                    return Err(err(format!(
                        "a {dtype:?} tensor cannot hold a {:?} payload",
                        p.payload
                    )));
                }
                if p.rows.checked_mul(p.cols) != Some(numel)
                    || shape.first().is_some_and(|&r| r != p.rows)
                {
                    return Err(err(format!(
                        "coded as {}×{} but its shape is {shape:?}",
                        p.rows, p.cols
                    )));
                }
                Ok(Coded::Dtans(dtans_from_arrays(&p, array)?))
            }
            DTANS_GGML => {
                let p = dtans_params(c.params)?;
                let block = block_type(&c.params["block"], crate::ggml_blocks::handles)?;
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
                    let v = to_u16(array(n, ArrayDtype::U8)?);
                    if v.len() != n_blocks {
                        return Err(err(format!(
                            "array '{n}' holds {} scales for {n_blocks} blocks",
                            v.len()
                        )));
                    }
                    Ok(v)
                };
                Ok(Coded::Ggml(GgmlCoded {
                    block,
                    codes: dtans_from_arrays(&p, array)?,
                    d: scales("d")?,
                    m: has_m(block).then(|| scales("m")).transpose()?,
                }))
            }
            GGML_SCALES => {
                let block = block_type(&c.params["block"], crate::ggml_blocks::handles)?;
                let dim = |k: &str| {
                    c.params[k]
                        .as_u64()
                        .and_then(|v| usize::try_from(v).ok())
                        .ok_or_else(|| err(format!("ggml-scales params lack '{k}'")))
                };
                let (rows, cols) = (dim("rows")?, dim("cols")?);
                if dtype != Dtype::U8
                    || !cols.is_multiple_of(QK)
                    || shape != GgmlCoded::stored_shape(block, rows, cols)
                {
                    return Err(err(format!(
                        "{} blocks of {rows}×{cols} weights are stored as U8 {:?}, not {dtype:?} \
                         {shape:?}",
                        block.name(),
                        GgmlCoded::stored_shape(block, rows, cols)
                    )));
                }
                let n = rows * cols / QK;
                let stream = |k: &str| -> Result<DtansTensor> {
                    let p = dtans_params(&c.params[k])?;
                    if p.payload != Payload::Fp16 || (p.rows, p.cols) != scale_matrix_shape(n) {
                        return Err(err(format!(
                            "scale stream '{k}' is {:?} {}×{}, not FP16 covering {n} blocks",
                            p.payload, p.rows, p.cols
                        )));
                    }
                    dtans_from_arrays(&p, |a, d| array(&format!("{k}_{a}"), d))
                };
                let rest = array("rest", ArrayDtype::U8)?;
                let want = n * (block.type_size() - scale_bytes(block));
                if rest.len() != want {
                    return Err(err(format!(
                        "array 'rest' holds {} bytes, {n} {} blocks need {want}",
                        rest.len(),
                        block.name()
                    )));
                }
                Ok(Coded::GgmlScales(GgmlScales {
                    block,
                    rows,
                    cols,
                    rest: rest.to_vec(),
                    d: stream("d")?,
                    m: has_m(block).then(|| stream("m")).transpose()?,
                }))
            }
            DF11 => {
                if dtype != Dtype::BF16 {
                    return Err(err(format!("df11 codes BF16 tensors, not {dtype:?}")));
                }
                let t = Df11Tensor {
                    luts: array("luts", ArrayDtype::U8)?.to_vec(),
                    encoded_exponent: array("encoded_exponent", ArrayDtype::U8)?.to_vec(),
                    sign_mantissa: array("sign_mantissa", ArrayDtype::U8)?.to_vec(),
                    output_positions: to_u32(array("output_positions", ArrayDtype::U32)?),
                    gaps: array("gaps", ArrayDtype::U8)?.to_vec(),
                    n_elements: numel,
                };
                t.validate().map_err(|e| err(e.to_string()))?;
                Ok(Coded::Df11(t))
            }
            LOSSY => {
                if !LossyCoded::decodes_to(dtype) {
                    return Err(err(format!(
                        "a lossy matrix decodes to F32, BF16 or F16, not {dtype:?}"
                    )));
                }
                let tensor = LossyTensor::from_bytes(array("data", ArrayDtype::U8)?)
                    .map_err(|e| err(e.to_string()))?;
                if shape != [tensor.rows, tensor.cols] {
                    return Err(err(format!(
                        "coded as {}×{} but its shape is {shape:?}",
                        tensor.rows, tensor.cols
                    )));
                }
                Ok(Coded::Lossy(LossyCoded { dtype, tensor }))
            }
            DTANS_SCALAR => {
                if !LossyCoded::decodes_to(dtype) {
                    return Err(err(format!(
                        "a lossy matrix decodes to F32, BF16 or F16, not {dtype:?}"
                    )));
                }
                let quantizer = match c.params["quantizer"].as_str() {
                    Some("fp8") => Scalar::Fp8,
                    Some(q) if q.starts_with("int") => Scalar::Int {
                        group: 1,
                        dead_zone: 0.0,
                    },
                    q => return Err(err(format!("unknown scalar quantiser {q:?}"))),
                };
                let group = c.params["group"]
                    .as_u64()
                    .and_then(|g| usize::try_from(g).ok())
                    .filter(|&g| g > 0)
                    .ok_or_else(|| err("dtans-scalar params lack a 'group' of columns".into()))?;
                let quantizer = match quantizer {
                    Scalar::Int { .. } => Scalar::Int {
                        group,
                        dead_zone: 0.0,
                    },
                    q => q,
                };
                let p = dtans_params(&c.params["codes"])?;
                if shape != [p.rows, p.cols] {
                    return Err(err(format!(
                        "coded as {}×{} but its shape is {shape:?}",
                        p.rows, p.cols
                    )));
                }
                let codes = dtans_from_arrays(&p, |a, d| array(&format!("codes_{a}"), d))?;
                let scales = match &c.params["scales"] {
                    Value::String(r) if r == "raw" => {
                        let b = array("scales", ArrayDtype::U8)?;
                        if b.len() % 2 != 0 {
                            return Err(err("array 'scales' is not whole f16 values".into()));
                        }
                        ScaleStore::Raw(to_u16(b))
                    }
                    v => {
                        let n = v["n"]
                            .as_u64()
                            .and_then(|n| usize::try_from(n).ok())
                            .ok_or_else(|| err("dtans-scalar scales lack 'n'".into()))?;
                        let p = dtans_params(&v["stream"])?;
                        let stream =
                            dtans_from_arrays(&p, |a, d| array(&format!("scales_{a}"), d))?;
                        ScaleStore::Coded { n, stream }
                    }
                };
                let tensor = entrollm_codec::lossy::scalar::ScalarTensor {
                    quantizer,
                    group,
                    codes,
                    scales,
                };
                // The shape of codes and scales, checked before anything is decoded.
                tensor
                    .check_shape()
                    .map_err(|e| err(e.to_string()))?;
                Ok(Coded::Scalar(ScalarCoded { dtype, tensor }))
            }
            DTANS_BLOCKS => Ok(Coded::Blocks(BlocksCoded::from_stored(
                dtype, shape, c.params, array,
            )?)),
            RANS_FIELDS => Ok(Coded::Fields(FieldsCoded::from_stored(
                dtype, shape, c.params, array,
            )?)),
            RANS_FLOATS => Ok(Coded::Floats(FloatsCoded::from_stored(
                dtype, shape, c.params, array,
            )?)),
            other => Err(err(format!(
                "unknown coder '{other}' (this entrollm knows {DTANS}, {DTANS_GGML}, {GGML_SCALES}, \
                 {DTANS_BLOCKS}, {RANS_FIELDS}, {RANS_FLOATS}, {DF11}, {LOSSY} and {DTANS_SCALAR})"
            ))),
        }
    }

    /// The decoded tensor's bytes, as the source stored them.
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        match self {
            Coded::Dtans(t) => t.decode(),
            Coded::Df11(t) => Ok(t.decode()?.iter().flat_map(|w| w.to_le_bytes()).collect()),
            Coded::Ggml(g) => pack_codes(&QuantCodes {
                block: g.block,
                codes: g.codes.decode()?,
                d: g.d.clone(),
                m: g.m.clone(),
            })
            .map_err(entrollm_codec::CodecError::Corrupt),
            Coded::GgmlScales(g) => g.decode(),
            Coded::Lossy(l) => l.decode(),
            Coded::Blocks(b) => b.decode(),
            Coded::Fields(f) => f.decode(),
            Coded::Floats(f) => f.decode(),
            Coded::Scalar(q) => q.decode(),
        }
    }

    /// [`Self::decode`] and, for the dtANS coders, where the stored bytes go, from one pass over
    /// the coded tiles.
    pub fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        match self {
            Coded::Dtans(t) => t.decode_with_breakdown().map(|(d, b)| (d, Some(b))),
            Coded::Df11(_)
            | Coded::GgmlScales(_)
            | Coded::Lossy(_)
            | Coded::Blocks(_)
            | Coded::Fields(_)
            | Coded::Floats(_)
            | Coded::Scalar(_) => Ok((self.decode()?, None)),
            Coded::Ggml(g) => {
                let (codes, b) = g.codes.decode_with_breakdown()?;
                let bytes = pack_codes(&QuantCodes {
                    block: g.block,
                    codes,
                    d: g.d.clone(),
                    m: g.m.clone(),
                })
                .map_err(entrollm_codec::CodecError::Corrupt)?;
                Ok((bytes, Some(b)))
            }
        }
    }

    pub fn stored_bytes(&self) -> usize {
        match self {
            Coded::Dtans(t) => t.stored_bytes(),
            Coded::Df11(t) => t.stored_bytes(),
            Coded::Ggml(g) => {
                g.codes.stored_bytes() + 2 * (g.d.len() + g.m.as_ref().map_or(0, Vec::len))
            }
            Coded::GgmlScales(g) => g.stored_bytes(),
            Coded::Lossy(l) => l.tensor.stored_bytes(),
            Coded::Blocks(b) => b.stored_bytes(),
            Coded::Fields(f) => f.stored_bytes(),
            Coded::Floats(f) => f.stored_bytes(),
            Coded::Scalar(q) => q.tensor.stored_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml_blocks::unpack_codes;
    use entrollm_codec::dtans::{Coding, Mode};
    use std::collections::BTreeMap;

    /// A Q4_1 tensor of `rows × cols` weights with skewed codes and arbitrary scales.
    fn q4_1_blocks(rows: usize, cols: usize) -> Vec<u8> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::new();
        for _ in 0..rows * cols / QK {
            out.extend_from_slice(&(next() as u16 & 0x3bff).to_le_bytes());
            out.extend_from_slice(&(next() as u16 | 0x8000).to_le_bytes());
            // Two nibbles per byte, biased towards the middle codes.
            out.extend((0..16).map(|_| {
                let n = |r: u64| (6 + (r % 5) as u8) & 0x0f;
                let r = next();
                n(r) | (n(r >> 8) << 4)
            }));
        }
        out
    }

    fn stored<'a>(
        coded: &'a Coded,
        arrays: &'a [(String, ArrayDtype, Cow<'a, [u8]>)],
        params: &'a Value,
    ) -> CodedTensor<'a> {
        CodedTensor {
            coder: coded.coder(),
            params,
            arrays: arrays
                .iter()
                .map(|(n, d, b)| (n.as_str(), (*d, &b[..])))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    /// A scalar-quantised matrix through the container's arrays and params and back (scales raw
    /// and dtANS-coded); params or arrays that disagree with the tensor are errors, not panics.
    #[test]
    fn scalar_codes_round_trip_and_hostile_params_are_errors() {
        use entrollm_codec::lossy::scalar::{encode, Scalar};
        let mut s = 0x1234_5678u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for (rows, cols, q) in [
            (64, 256, Scalar::Fp8),
            (
                256,
                512,
                Scalar::Int {
                    group: 32,
                    dead_zone: 0.0,
                },
            ),
        ] {
            let w: Vec<f32> = (0..rows * cols).map(|_| next() + next() + next()).collect();
            let (tensor, _) = encode(&w, rows, cols, q, 3.0, None).unwrap();
            let coded = Coded::Scalar(ScalarCoded {
                dtype: Dtype::BF16,
                tensor,
            });
            let want = coded.decode().unwrap();
            let arrays = coded.arrays();
            let params = coded.params(json!({}));
            let back = Coded::from_stored(
                Dtype::BF16,
                &[rows, cols],
                &stored(&coded, &arrays, &params),
            )
            .unwrap();
            assert_eq!(back.decode().unwrap(), want);
            assert_eq!(back.stored_bytes(), coded.stored_bytes());
            let fails = |dtype: Dtype, shape: &[usize], params: &Value| {
                Coded::from_stored(dtype, shape, &stored(&coded, &arrays, params)).is_err()
            };
            assert!(fails(Dtype::U8, &[rows, cols], &params));
            assert!(fails(Dtype::BF16, &[rows, cols + 1], &params));
            for (key, bad) in [
                ("group", json!(7)),
                ("group", json!(0)),
                ("group", json!("x")),
                ("quantizer", json!("e8")),
                (
                    "scales",
                    json!({"n": 1usize << 40, "stream": params["codes"].clone()}),
                ),
            ] {
                let mut p = params.clone();
                p[key] = bad;
                assert!(fails(Dtype::BF16, &[rows, cols], &p), "{key}");
            }
            // A quantiser that disagrees with the codes' payload.
            let mut p = params.clone();
            p["quantizer"] = json!(if q == Scalar::Fp8 { "int-g32" } else { "fp8" });
            assert!(fails(Dtype::BF16, &[rows, cols], &p));
        }
    }

    /// Blocks of every type with few distinct scales (as a quantiser's are: a narrow range of
    /// magnitudes), random code bytes; rows × cols weights.
    fn blocks(block: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::new();
        for _ in 0..rows * cols / QK {
            // f16 scales in [2^-8, 2^-6): exponent 7..8, the mantissa's top bits varying.
            let mut scale = || 0x1c00u16 + (next() % 0x600) as u16;
            out.extend_from_slice(&scale().to_le_bytes());
            if has_m(block) {
                out.extend_from_slice(&(scale() | 0x8000).to_le_bytes());
            }
            out.extend((0..block.type_size() - scale_bytes(block)).map(|_| next() as u8));
        }
        out
    }

    /// Blocks of `ty` as a quantiser writes them: codes peaked at the middle of their range,
    /// super-scales of a narrow range, sub-block scales skewed; `rows × cols` weights.
    fn kblocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let n = rows * cols / ty.block_size();
        let bits = ty.code_bits();
        let mid = 1u64 << (bits - 1);
        let codes: Vec<u8> = (0..rows * cols)
            .map(|_| {
                // A sum of three uniforms: peaked at the middle code.
                let r = next();
                let spread = 1u64 << bits.saturating_sub(2);
                let v = mid + (r % spread) + ((r >> 16) % spread) + ((r >> 32) % spread);
                (v - (3 * spread / 2).min(v)).min((1 << bits) - 1) as u8
            })
            .collect();
        let fields = ty
            .fields()
            .iter()
            .map(|f| {
                (0..n * f.per_block)
                    .map(|_| match f.kind {
                        FieldKind::Half => 0x1c00u16 + (next() % 0x300) as u16,
                        FieldKind::Bits(b) => {
                            let top = (1u64 << b) - 1;
                            (top / 2 + next() % (top / 4 + 1)).min(top) as u16
                        }
                    })
                    .collect()
            })
            .collect();
        crate::kquants::join(&Split { ty, codes, fields }).unwrap()
    }

    #[test]
    fn split_blocks_round_trip_through_the_container_for_every_type() {
        for (i, ty) in GgmlType::ALL.into_iter().filter(|t| t.splits()).enumerate() {
            let w = ty.block_size();
            for (rows, cols) in [(1, w), (3, 3 * w), (37, 2 * w), (256, 1024)] {
                for noise in [false, true] {
                    let bytes = match noise {
                        false => kblocks(ty, rows, cols, 11 + i as u64),
                        // Uniform bytes: nothing codes smaller, everything is stored packed.
                        true => kblocks(ty, 1, w, 1)
                            .iter()
                            .cycle()
                            .zip(0u64..)
                            .map(|(_, k)| (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
                            .take(rows * cols / w * ty.type_size())
                            .collect(),
                    };
                    let what = format!("{ty:?} {rows}x{cols} noise {noise}");
                    let (b, _) = BlocksCoded::encode(ty, rows, cols, &bytes, None).unwrap();
                    let coded = Coded::Blocks(b);
                    assert_eq!(coded.decode().unwrap(), bytes, "{what}");
                    let params = coded.params(json!({}));
                    let arrays = coded.arrays();
                    let shape = BlocksCoded::stored_shape(ty, rows, cols);
                    let back =
                        Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &arrays, &params))
                            .unwrap();
                    assert_eq!(back.decode().unwrap(), bytes, "{what} stored");
                    let actual = coded.stored_bytes() as f64;
                    // Packed streams never cost more than the blocks.
                    assert!(actual <= bytes.len() as f64 + 8.0, "{what}: {actual}");
                    let (predicted, h) = BlocksCoded::predict(ty, rows, cols, &bytes).unwrap();
                    assert!(
                        (predicted - actual).abs() <= 0.05 * actual + 1024.0,
                        "{what}: predicted {predicted}, stored {actual}"
                    );
                    if rows * cols >= 256 * 1024 && !noise {
                        assert!(actual < 0.9 * bytes.len() as f64, "{what}: {actual}");
                        let bpw = actual * 8.0 / (rows * cols) as f64;
                        assert!(bpw >= h.bound_bpw() - 0.01, "{what}: {bpw} below the bound");
                    }
                }
            }
        }
    }

    #[test]
    fn damaged_split_blocks_are_errors() {
        let (ty, rows, cols) = (GgmlType::Q4_K, 64, 1024);
        let bytes = kblocks(ty, rows, cols, 5);
        let coded = Coded::Blocks(BlocksCoded::encode(ty, rows, cols, &bytes, None).unwrap().0);
        let params = coded.params(json!({}));
        let arrays = coded.arrays();
        let shape = BlocksCoded::stored_shape(ty, rows, cols);
        let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)], shape: &[usize]| {
            match Coded::from_stored(Dtype::U8, shape, &stored(&coded, a, p)) {
                Err(e) => e.to_string(),
                Ok(c) => match c.decode() {
                    Err(e) => e.to_string(),
                    Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
                },
            }
        };
        assert!(err(&params, &arrays, &[rows, 1]).contains("stored as U8"));
        let mut p = params.clone();
        p["type"] = json!("Q9_K");
        assert!(err(&p, &arrays, &shape).contains("block type"));
        let mut p = params.clone();
        p["rows"] = json!(rows + 32);
        assert!(err(&p, &arrays, &shape).contains("stored as U8"));
        each_array_is_needed(&arrays, |a| err(&params, a, &shape));
        assert!(
            params["codes"].get("packed").is_none(),
            "skewed codes code smaller"
        );
        let mut p = params.clone();
        p["codes"] = json!({ "packed": true });
        assert!(err(&p, &arrays, &shape).contains("'codes'"));
        let mut p = params.clone();
        p["fields"]["sc"] = json!({ "dtans": true });
        assert!(err(&p, &arrays, &shape).contains("'sc'"));
    }

    type Arrays<'a> = [(String, ArrayDtype, Cow<'a, [u8]>)];

    /// Every array of a coded tensor is needed (reading without it is an error naming it), and
    /// one cut short is an error; `err` reads a tensor of these arrays.
    fn each_array_is_needed(arrays: &Arrays<'_>, err: impl Fn(&Arrays<'_>) -> String) {
        for (name, ..) in arrays {
            let without: Vec<_> = arrays.iter().filter(|(n, ..)| n != name).cloned().collect();
            assert!(err(&without).contains(name.as_str()), "{name}");
            let cut: Vec<_> = arrays
                .iter()
                .map(|(n, d, b)| match n == name {
                    true => (n.clone(), *d, Cow::Owned(b[..b.len() / 2 / 4 * 4].to_vec())),
                    false => (n.clone(), *d, b.clone()),
                })
                .collect();
            assert!(!err(&cut).is_empty(), "{name} cut");
        }
    }

    /// Bytes of `n` 4-bit codes skewed around 8 (a quantiser's), packed two a byte.
    fn skewed_nibbles(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut code = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // A sum of three uniforms: near-Gaussian codes in 0..=15.
            let v = (s & 7) + (s >> 8 & 7) + (s >> 16 & 3);
            v as u8
        };
        (0..n / 2).map(|_| code() | code() << 4).collect()
    }

    #[test]
    fn fields_round_trip_at_every_width_through_the_container() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut rand = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect()
        };
        let cases: Vec<(Dtype, Vec<usize>, Vec<u8>)> = vec![
            (Dtype::I32, vec![64, 96], skewed_nibbles(64 * 96 * 8, 1)),
            (Dtype::I32, vec![3, 5], rand(60)),
            (Dtype::U8, vec![1], rand(1)),
            (Dtype::F16, vec![7, 9], rand(126)),
            (Dtype::I32, vec![0, 4], Vec::new()),
            (Dtype::I64, vec![33], vec![0; 264]),
        ];
        for (dtype, shape, bytes) in &cases {
            for bits in FIELD_WIDTHS {
                if (bytes.len() * 8) % bits as usize != 0 {
                    assert!(FieldsCoded::encode(bytes, bits).is_err());
                    continue;
                }
                let f = FieldsCoded::encode(bytes, bits).unwrap();
                let (predicted, _) = FieldsCoded::predict(bytes, bits).unwrap();
                assert!(
                    (predicted - f.stored_bytes() as f64).abs() <= 64.0 + 0.01 * bytes.len() as f64,
                    "{dtype:?} {bits}: predicted {predicted}, stored {}",
                    f.stored_bytes()
                );
                let coded = Coded::Fields(f);
                let params = coded.params(json!({}));
                let arrays = coded.arrays();
                let back =
                    Coded::from_stored(*dtype, shape, &stored(&coded, &arrays, &params)).unwrap();
                assert_eq!(&back.decode().unwrap(), bytes, "{dtype:?} {shape:?} {bits}");
            }
        }
        // Packed 4-bit codes code near their entropy at their width, and smaller than at others.
        let bytes = &cases[0].2;
        let (best, h) = FIELD_WIDTHS[..4]
            .iter()
            .map(|&b| (b, FieldsCoded::encode(bytes, b).unwrap().stored_bytes()))
            .min_by_key(|&(_, n)| n)
            .map(|(b, _)| (b, FieldsCoded::predict(bytes, b).unwrap().1))
            .unwrap();
        assert_eq!(best, 4);
        let f = FieldsCoded::encode(bytes, 4).unwrap();
        let per_code = f.stored_bytes() as f64 * 8.0 / (bytes.len() * 2) as f64;
        assert!(per_code < h + 0.01, "{per_code} bits a code, entropy {h}");
    }

    #[test]
    fn damaged_fields_are_errors() {
        let bytes = skewed_nibbles(20_000, 3);
        let coded = Coded::Fields(FieldsCoded::encode(&bytes, 4).unwrap());
        let params = coded.params(json!({}));
        let arrays = coded.arrays();
        let shape = [bytes.len() / 4];
        let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)], shape: &[usize]| {
            match Coded::from_stored(Dtype::I32, shape, &stored(&coded, a, p)) {
                Err(e) => e.to_string(),
                Ok(c) => match c.decode() {
                    Err(e) => e.to_string(),
                    Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
                },
            }
        };
        each_array_is_needed(&arrays, |a| err(&params, a, &shape));
        let e = err(&params, &arrays, &[shape[0] + 1]);
        assert!(e.contains("fields"), "{e}");
        for bad in [json!(3), json!(32), json!("4"), Value::Null] {
            let mut p = params.clone();
            p["bits"] = bad;
            assert!(err(&p, &arrays, &shape).contains("bits"));
        }
        let mut p = params.clone();
        p["stream"] = json!({ "dtans": true });
        assert!(err(&p, &arrays, &shape).contains("neither"));
    }

    /// BF16/F16 bytes of `n` weights ~ N(0, 0.02²), with every special value planted (zeros of
    /// both signs, infinities, NaNs, subnormals) so the codes' split is checked at the edges.
    fn float_bytes(payload: Payload, n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut unif = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut v: Vec<u16> = (0..n)
            .map(|_| {
                let (a, b) = (unif().max(1e-300), unif());
                let x = (0.02 * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32;
                match payload {
                    Payload::Bf16 => half::bf16::from_f32(x).to_bits(),
                    _ => half::f16::from_f32(x).to_bits(),
                }
            })
            .collect();
        let specials = [
            0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8001, 0x7C00, 0xFFFF,
        ];
        for (i, &x) in specials.iter().enumerate().take(n) {
            v[i * 7 % n] = x;
        }
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Narrow float matrices: rANS over the codes beside the raw bytes decodes bit for bit through
    /// the container, within 0.02 bit a weight of the bound at 384 × 384, its size as predicted.
    #[test]
    fn floats_round_trip_through_the_container_at_their_bound() {
        for (payload, dtype) in [(Payload::Bf16, Dtype::BF16), (Payload::Fp16, Dtype::F16)] {
            for (rows, cols) in [(384, 384), (3, 5), (1, 1)] {
                let bytes = float_bytes(payload, rows * cols, rows as u64);
                let f = FloatsCoded::encode(payload, &bytes).unwrap();
                let (codes, _) = payload.symbolize(&bytes).unwrap();
                let predicted = FloatsCoded::predict(payload, &codes).unwrap();
                assert!(
                    (predicted - f.stored_bytes() as f64).abs()
                        <= 64.0 + 0.001 * bytes.len() as f64,
                    "{dtype:?}: predicted {predicted}, stored {}",
                    f.stored_bytes()
                );
                if rows * cols > 1000 {
                    use entrollm_codec::histogram::{byte_histogram, entropy_bits};
                    let n = (rows * cols) as f64;
                    let bound = entropy_bits(&byte_histogram(&codes)) + 8.0;
                    let bpw = f.stored_bytes() as f64 * 8.0 / n;
                    assert!(
                        bpw < bound + 0.02,
                        "{dtype:?}: {bpw} bits a weight, bound {bound}"
                    );
                    assert_eq!(f.coding(), "rans");
                }
                let coded = Coded::Floats(f);
                let params = coded.params(json!({}));
                let arrays = coded.arrays();
                let shape = [rows, cols];
                let back = Coded::from_stored(dtype, &shape, &stored(&coded, &arrays, &params));
                assert_eq!(
                    back.unwrap().decode().unwrap(),
                    bytes,
                    "{dtype:?} {rows}x{cols}"
                );
            }
        }
        assert!(FloatsCoded::encode(Payload::Fp8E4m3, &[1, 2]).is_err());
    }

    #[test]
    fn damaged_floats_are_errors() {
        let bytes = float_bytes(Payload::Bf16, 384 * 64, 9);
        let coded = Coded::Floats(FloatsCoded::encode(Payload::Bf16, &bytes).unwrap());
        let params = coded.params(json!({}));
        let arrays = coded.arrays();
        let shape = [384, 64];
        let err =
            |p: &Value, a: &Arrays<'_>, shape: &[usize], dtype: Dtype| match Coded::from_stored(
                dtype,
                shape,
                &stored(&coded, a, p),
            ) {
                Err(e) => e.to_string(),
                Ok(c) => match c.decode() {
                    Err(e) => e.to_string(),
                    Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
                },
            };
        each_array_is_needed(&arrays, |a| err(&params, a, &shape, Dtype::BF16));
        assert!(err(&params, &arrays, &[384, 65], Dtype::BF16).contains("raw"));
        assert!(err(&params, &arrays, &shape, Dtype::F32).contains("BF16 and F16"));
        let mut p = params.clone();
        p["stream"] = json!({ "dtans": true });
        assert!(err(&p, &arrays, &shape, Dtype::BF16).contains("neither"));
    }

    #[test]
    fn scales_alone_round_trip_for_every_block_type() {
        for (i, block) in GgmlType::ALL
            .into_iter()
            .filter(|&t| crate::ggml_blocks::handles(t))
            .enumerate()
        {
            for (rows, cols) in [(1, 32), (3, 96), (70, 576), (257, 1024)] {
                let bytes = blocks(block, rows, cols, 7 + i as u64);
                let g = GgmlScales::encode(block, rows, cols, &bytes).unwrap();
                let coded = Coded::GgmlScales(g);
                assert_eq!(coded.decode().unwrap(), bytes, "{block:?} {rows}x{cols}");
                let params = coded.params(json!({}));
                let arrays = coded.arrays();
                let shape = GgmlCoded::stored_shape(block, rows, cols);
                let back = Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &arrays, &params))
                    .unwrap();
                assert_eq!(
                    back.decode().unwrap(),
                    bytes,
                    "{block:?} {rows}x{cols} stored"
                );
                let predicted = GgmlScales::predict_bytes(block, &bytes).unwrap();
                let actual = coded.stored_bytes() as f64;
                assert!(
                    (predicted - actual).abs() <= 0.05 * actual + 256.0,
                    "{block:?} {rows}x{cols}: predicted {predicted}, stored {actual}"
                );
                // Thousands of scales of a narrow range code smaller than they are.
                if rows * cols >= 257 * 1024 {
                    assert!(actual < bytes.len() as f64, "{block:?} {rows}x{cols}");
                }
            }
        }
    }

    #[test]
    fn damaged_scale_streams_are_errors() {
        let (block, rows, cols) = (GgmlType::Q4_1, 70, 576);
        let bytes = blocks(block, rows, cols, 3);
        let coded = Coded::GgmlScales(GgmlScales::encode(block, rows, cols, &bytes).unwrap());
        let params = coded.params(json!({}));
        let arrays = coded.arrays();
        let shape = GgmlCoded::stored_shape(block, rows, cols);
        let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)]| match Coded::from_stored(
            Dtype::U8,
            &shape,
            &stored(&coded, a, p),
        ) {
            Err(e) => e.to_string(),
            Ok(c) => match c.decode() {
                Err(e) => e.to_string(),
                Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
            },
        };
        let without =
            |name: &str| -> Vec<_> { arrays.iter().filter(|a| a.0 != name).cloned().collect() };
        assert!(err(&params, &without("rest")).contains("'rest'"));
        assert!(err(&params, &without("m_stream")).contains("m_stream"));
        let mut short = arrays.clone();
        let r = short.iter_mut().find(|a| a.0 == "rest").unwrap();
        r.2 = Cow::Owned(r.2[1..].to_vec());
        assert!(err(&params, &short).contains("'rest'"));
        let mut p = params.clone();
        p["rows"] = json!(rows + 1);
        assert!(err(&p, &arrays).contains("stored as U8"));
        let mut p = params.clone();
        p["d"]["rows"] = json!(1);
        assert!(err(&p, &arrays).contains("scale stream 'd'"));
        let mut p = params.clone();
        p.as_object_mut().unwrap().remove("m");
        assert!(err(&p, &arrays).contains("bad dtans params"));
        // A flipped byte in a coded stream: an error or different scales, never a panic (the
        // container's checksum of the decoded tensor then names it).
        let mut flipped = arrays.clone();
        let st = flipped.iter_mut().find(|a| a.0 == "d_stream").unwrap();
        let mut b = st.2.to_vec();
        b[5] ^= 0x40;
        st.2 = Cow::Owned(b);
        if let Ok(c) = Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &flipped, &params)) {
            assert!(c.decode().map_or(true, |d| d != bytes));
        }
    }

    #[test]
    fn ggml_blocks_round_trip_through_the_container_arrays() {
        let (rows, cols) = (40, 96);
        let bytes = q4_1_blocks(rows, cols);
        let q = unpack_codes(GgmlType::Q4_1, &bytes).unwrap();
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 10,
            sc: 64,
            t: None,
        };
        let codes =
            DtansTensor::encode(Payload::Int(4), rows, cols, &q.codes, &[], coding).unwrap();
        let coded = Coded::Ggml(GgmlCoded {
            block: GgmlType::Q4_1,
            codes,
            d: q.d,
            m: q.m,
        });
        assert_eq!(coded.decode().unwrap(), bytes);
        let params = coded.params(json!({}));
        assert_eq!(params["block"], "Q4_1");
        let arrays = coded.arrays();
        let shape = GgmlCoded::stored_shape(GgmlType::Q4_1, rows, cols);
        assert_eq!(shape, [rows, cols / 32 * 20]);
        let c = stored(&coded, &arrays, &params);
        let back = Coded::from_stored(Dtype::U8, &shape, &c).unwrap();
        assert_eq!(back.decode().unwrap(), bytes);

        // Wrong shape, dtype, block type or scale count: clear errors, no panics.
        let err = |dtype, shape: &[usize], c: &CodedTensor| {
            Coded::from_stored(dtype, shape, c)
                .err()
                .expect("rejected")
                .to_string()
        };
        assert!(err(Dtype::U8, &[rows, 61], &c).contains("stored as U8"));
        assert!(err(Dtype::F16, &shape, &c).contains("F16"));
        let mut p = params.clone();
        p["block"] = json!("Q8_0");
        assert!(err(Dtype::U8, &shape, &stored(&coded, &arrays, &p)).contains("8-bit"));
        p["block"] = json!("Q9_9");
        assert!(err(Dtype::U8, &shape, &stored(&coded, &arrays, &p)).contains("block type"));
        let mut short = arrays.clone();
        let m = short.iter_mut().find(|a| a.0 == "m").unwrap();
        m.2 = Cow::Owned(m.2[2..].to_vec());
        assert!(err(Dtype::U8, &shape, &stored(&coded, &short, &params)).contains("'m'"));
        let no_m: Vec<_> = arrays.iter().filter(|a| a.0 != "m").cloned().collect();
        assert!(err(Dtype::U8, &shape, &stored(&coded, &no_m, &params)).contains("no 'm'"));
    }
}
