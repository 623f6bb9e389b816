//! The streams of the coders of GGUF block fields and raw bytes (`dtans-blocks`, `rans-fields`,
//! `rans-floats`): dtANS, rANS or packed, whichever stores a stream smallest.

use super::{dtans_arrays, to_u16, to_u32, u16_bytes, u32_bytes};
use crate::container::ArrayDtype;
use crate::kquants::FieldKind;
use crate::qtype::GgmlType;
use crate::{FormatError, Result};
use entrollm_codec::dtans::DtansTensor;
use entrollm_codec::rans::RansStream;
use entrollm_codec::{CodecError, Payload};
use serde_json::{json, Value};
use std::borrow::Cow;

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
    pub(super) fn coding(&self) -> &'static str {
        match self {
            BlockStream::Coded(_) => "dtans",
            BlockStream::Rans { .. } => "rans",
            BlockStream::Packed(_) => "packed",
        }
    }

    pub(super) fn stored_bytes(&self) -> usize {
        match self {
            BlockStream::Coded(t) => t.stored_bytes(),
            BlockStream::Rans { stream, low } => {
                stream.stored_bytes() + low.as_ref().map_or(0, RansStream::stored_bytes)
            }
            BlockStream::Packed(b) => b.len(),
        }
    }

    pub(super) fn params(&self) -> Value {
        match self {
            BlockStream::Coded(t) => serde_json::to_value(t.params()).expect("params serialise"),
            BlockStream::Rans { .. } => json!({ "rans": true }),
            BlockStream::Packed(_) => json!({ "packed": true }),
        }
    }

    pub(super) fn arrays<'s>(&'s self, name: &str) -> Vec<(String, ArrayDtype, Cow<'s, [u8]>)> {
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
pub(super) fn field_bits(kind: FieldKind) -> u32 {
    match kind {
        FieldKind::Half => 16,
        FieldKind::Bits(b) => u32::from(b),
    }
}

/// A field's values bit-packed (halves as little-endian u16).
pub(super) fn pack_field(kind: FieldKind, v: &[u16]) -> Vec<u8> {
    match kind {
        FieldKind::Half => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        FieldKind::Bits(b) => {
            let bytes: Vec<u8> = v.iter().map(|&x| x as u8).collect();
            crate::kquants::pack_bits(&bytes, u32::from(b))
        }
    }
}

pub(super) fn unpack_field(kind: FieldKind, b: &[u8], n: usize) -> Option<Vec<u16>> {
    match kind {
        FieldKind::Half => (b.len() == 2 * n).then(|| to_u16(b)),
        FieldKind::Bits(bits) => crate::kquants::unpack_bits(b, u32::from(bits), n)
            .map(|v| v.into_iter().map(u16::from).collect()),
    }
}

/// A field's values as rANS symbols (the high bytes of halves) with their alphabet, and the low
/// bytes of halves.
pub(super) fn field_symbols(kind: FieldKind, v: &[u16]) -> (Vec<u8>, usize, Option<Vec<u8>>) {
    match kind {
        FieldKind::Half => (
            v.iter().map(|&x| (x >> 8) as u8).collect(),
            256,
            Some(v.iter().map(|&x| x as u8).collect()),
        ),
        FieldKind::Bits(b) => (v.iter().map(|&x| x as u8).collect(), 1 << b, None),
    }
}

pub(super) fn counts(symbols: &[u8], alphabet: usize) -> Vec<u64> {
    entrollm_codec::histogram::byte_histogram(symbols)[..alphabet].to_vec()
}

/// dtANS is kept for codes unless rANS is smaller by this many bits a weight: dtANS codes are
/// what a fused product can decode in place.
pub const RANS_MARGIN_BITS: f64 = 0.03;

/// Which coding a split tensor's codes get, with its predicted bytes.
pub(super) enum CodesChoice {
    Dtans(entrollm_codec::dtans::Coding, f64),
    Rans(f64),
    Packed(f64),
}

pub(super) fn choose_codes(
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
pub(super) fn code_field(kind: FieldKind, v: &[u16]) -> entrollm_codec::Result<BlockStream> {
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

pub(super) fn predict_field(kind: FieldKind, v: &[u16]) -> entrollm_codec::Result<f64> {
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
pub(super) fn decode_field(
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

pub(super) fn is_flag(p: &Value, k: &str) -> bool {
    p.get(k).and_then(Value::as_bool) == Some(true)
}

/// A stream of `n` values of `kind` named `name`, rANS-coded or packed as `p` says, from its
/// arrays: `NAME` packed; `NAME_table`, `NAME_offsets`, `NAME_words` (and for halves the low
/// bytes' `NAME_low_*`) rANS-coded.
pub(super) fn stream_from_stored<'a>(
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
