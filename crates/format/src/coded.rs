//! Coded tensors in the container: how the codec's coded forms map to a container's arrays and JSON
//! parameters, and back. `docs/dtans.md` and `docs/format.md` describe the arrays.

use crate::container::{ArrayDtype, CodedTensor};
use crate::{Dtype, FormatError, Result};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{DtansParams, DtansTensor};
use entrollm_codec::Payload;
use serde_json::{json, Value};
use std::borrow::Cow;

/// Coder names as the manifest records them.
pub const DTANS: &str = "dtans";
pub const DF11: &str = "df11";

/// A tensor in one of the codec's coded forms.
pub enum Coded {
    Dtans(DtansTensor),
    Df11(Df11Tensor),
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

impl Coded {
    pub fn coder(&self) -> &'static str {
        match self {
            Coded::Dtans(_) => DTANS,
            Coded::Df11(_) => DF11,
        }
    }

    /// The parameters the manifest stores, with `stats` (shown by `inspect`) added.
    pub fn params(&self, stats: Value) -> Value {
        let mut v = match self {
            Coded::Dtans(t) => serde_json::to_value(t.params()).expect("params serialise"),
            Coded::Df11(t) => json!({ "n_elements": t.n_elements }),
        };
        v["stats"] = stats;
        v
    }

    /// The arrays to store, by name.
    pub fn arrays(&self) -> Vec<(String, ArrayDtype, Cow<'_, [u8]>)> {
        let a = |n: &str, d, b| (n.to_string(), d, b);
        match self {
            Coded::Dtans(t) => {
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
                let p: DtansParams = serde_json::from_value(c.params.clone())
                    .map_err(|e| err(format!("bad dtans params: {e}")))?;
                if payload_of(dtype) != Some(p.payload)
                    && !matches!(p.payload, Payload::Int(_) if dtype == Dtype::U8)
                {
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
                let symbols = to_u32(array("symbols", ArrayDtype::U32)?);
                let symbols = symbols
                    .iter()
                    .map(|&s| {
                        u16::try_from(s)
                            .map_err(|_| err(format!("table symbol {s} exceeds 16 bits")))
                    })
                    .collect::<Result<Vec<u16>>>()?;
                let t = DtansTensor::from_parts(
                    &p,
                    symbols,
                    array("counts", ArrayDtype::U8)?.to_vec(),
                    to_u32(array("tiles", ArrayDtype::U32)?),
                    to_u32(array("stream", ArrayDtype::U32)?),
                    to_u32(array("companion", ArrayDtype::U32)?),
                    array("raw", ArrayDtype::U8)?.to_vec(),
                )
                .map_err(|e| err(e.to_string()))?;
                Ok(Coded::Dtans(t))
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
                "unknown coder '{other}' (this entrollm knows dtans and df11)"
            ))),
        }
    }

    /// The decoded tensor's bytes, as the source stored them.
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        match self {
            Coded::Dtans(t) => t.decode(),
            Coded::Df11(t) => Ok(t.decode()?.iter().flat_map(|w| w.to_le_bytes()).collect()),
        }
    }

    pub fn stored_bytes(&self) -> usize {
        match self {
            Coded::Dtans(t) => t.stored_bytes(),
            Coded::Df11(t) => t.stored_bytes(),
        }
    }
}
