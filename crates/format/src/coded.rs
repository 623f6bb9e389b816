//! Coded tensors in the container: how the codec's coded forms map to a container's arrays and JSON
//! parameters, and back. `docs/dtans.md` and `docs/format.md` describe the arrays.

use crate::container::{ArrayDtype, CodedTensor};
use crate::ggml_blocks::{pack_codes, BlockType, QuantCodes, QK};
use crate::{Dtype, FormatError, Result};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{DtansParams, DtansTensor};
use entrollm_codec::Payload;
use serde_json::{json, Value};
use std::borrow::Cow;

/// Coder names as the manifest records them.
pub const DTANS: &str = "dtans";
pub const DF11: &str = "df11";
pub const DTANS_GGML: &str = "dtans-ggml";

/// A tensor in one of the codec's coded forms.
pub enum Coded {
    Dtans(DtansTensor),
    Df11(Df11Tensor),
    /// A GGUF tensor of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks.
    Ggml(GgmlCoded),
}

/// A GGUF tensor of code-bearing blocks, losslessly: its integer codes dtANS-coded as an int
/// payload (`rows × cols` weights), the blocks' f16 scales `d` (and offsets `m`) stored beside. The
/// decoded form is the original block bytes; the weights are `d·(code − offset) (+ m)` per block of
/// 32 columns, which the fused matvec applies in its epilogue.
pub struct GgmlCoded {
    pub block: BlockType,
    pub codes: DtansTensor,
    pub d: Vec<u16>,
    pub m: Option<Vec<u16>>,
}

impl GgmlCoded {
    /// The shape a container records for this tensor: `[rows, bytes per row]` of U8.
    pub fn stored_shape(block: BlockType, rows: usize, cols: usize) -> Vec<usize> {
        vec![rows, cols / QK * block.block_bytes()]
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
                let block: BlockType = serde_json::from_value(c.params["block"].clone())
                    .map_err(|e| err(format!("bad block type: {e}")))?;
                if p.payload != Payload::Int(block.bits() as u8) {
                    return Err(err(format!(
                        "{} codes are {}-bit integers, not a {:?} payload",
                        block.name(),
                        block.bits(),
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
                    m: block.has_m().then(|| scales("m")).transpose()?,
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
            other => Err(err(format!(
                "unknown coder '{other}' (this entrollm knows {DTANS}, {DTANS_GGML} and {DF11})"
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
        }
    }

    /// [`Self::decode`] and, for the dtANS coders, where the stored bytes go, from one pass over
    /// the coded tiles.
    pub fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        match self {
            Coded::Dtans(t) => t.decode_with_breakdown().map(|(d, b)| (d, Some(b))),
            Coded::Df11(_) => Ok((self.decode()?, None)),
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

    #[test]
    fn ggml_blocks_round_trip_through_the_container_arrays() {
        let (rows, cols) = (40, 96);
        let bytes = q4_1_blocks(rows, cols);
        let q = unpack_codes(BlockType::Q4_1, &bytes).unwrap();
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 10,
            sc: 64,
            t: None,
        };
        let codes =
            DtansTensor::encode(Payload::Int(4), rows, cols, &q.codes, &[], coding).unwrap();
        let coded = Coded::Ggml(GgmlCoded {
            block: BlockType::Q4_1,
            codes,
            d: q.d,
            m: q.m,
        });
        assert_eq!(coded.decode().unwrap(), bytes);
        let params = coded.params(json!({}));
        assert_eq!(params["block"], "Q4_1");
        let arrays = coded.arrays();
        let shape = GgmlCoded::stored_shape(BlockType::Q4_1, rows, cols);
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
