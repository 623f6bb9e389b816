//! Payload symbolization: how a weight's bits split into a coded symbol part (`code`, at most 8 bits)
//! and a raw part stored uncoded (`raw`, one byte for 16-bit floats, none otherwise).
//!
//! | payload   | element      | code (entropy coded)            | raw byte                 |
//! |-----------|--------------|---------------------------------|--------------------------|
//! | BF16      | u16          | exponent (bits 7..15)           | sign << 7 \| mantissa (7) |
//! | FP16      | u16          | high byte: sign, exponent, m9..m8 | low mantissa byte      |
//! | FP8 E4M3  | u8           | the whole byte                  | –                        |
//! | FP8 E5M2  | u8           | the whole byte                  | –                        |
//! | FP4 E2M1  | u8 (nibble)  | the nibble                      | –                        |
//! | IntN      | u8 (code)    | the N-bit code                  | –                        |
//!
//! BF16 follows DFloat11/MINE: sign and mantissa are close to uniform and independent of the exponent,
//! so only the exponent is worth coding. For FP16 the exponent straddles the byte boundary; coding the
//! whole high byte (exponent plus sign and the top two mantissa bits, ~3.6 bits of entropy over the
//! exponent's) keeps one raw byte per weight, the layout every kernel shares.

use crate::CodecError;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// What a coded element is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Payload {
    Bf16,
    Fp16,
    Fp8E4m3,
    Fp8E5m2,
    Fp4E2m1,
    /// Unsigned integer codes of 2..=8 bits (quantized checkpoints; signed codes are stored as
    /// their two's-complement bit pattern).
    Int(u8),
}

impl Payload {
    /// Bits of the coded part of one element.
    pub fn code_bits(self) -> u32 {
        match self {
            Payload::Bf16 | Payload::Fp16 | Payload::Fp8E4m3 | Payload::Fp8E5m2 => 8,
            Payload::Fp4E2m1 => 4,
            Payload::Int(b) => b as u32,
        }
    }

    /// Whether each element also carries one raw (uncoded) byte.
    pub fn has_raw(self) -> bool {
        matches!(self, Payload::Bf16 | Payload::Fp16)
    }

    /// Bytes of one element in its source (and decoded) form.
    pub fn element_bytes(self) -> usize {
        if self.has_raw() {
            2
        } else {
            1
        }
    }

    /// Number of distinct codes.
    pub fn alphabet(self) -> usize {
        1 << self.code_bits()
    }

    pub fn validate(self) -> Result<(), CodecError> {
        match self {
            Payload::Int(b) if !(2..=8).contains(&b) => Err(CodecError::Unsupported(format!(
                "integer payloads have 2 to 8 bits, not {b}"
            ))),
            _ => Ok(()),
        }
    }

    /// Splits a 16-bit element into (code, raw). Only for payloads with a raw byte.
    #[inline(always)]
    pub fn split16(self, w: u16) -> (u8, u8) {
        match self {
            Payload::Bf16 => ((w >> 7) as u8, (((w >> 8) & 0x80) | (w & 0x7F)) as u8),
            _ => ((w >> 8) as u8, w as u8),
        }
    }

    /// Inverse of [`Payload::split16`].
    #[inline(always)]
    pub fn join16(self, code: u8, raw: u8) -> u16 {
        match self {
            Payload::Bf16 => {
                (((raw & 0x80) as u16) << 8) | ((code as u16) << 7) | (raw & 0x7F) as u16
            }
            _ => ((code as u16) << 8) | raw as u16,
        }
    }

    /// The element value an escape record carries: the whole 16-bit float, or the code.
    #[inline(always)]
    pub fn element(self, code: u8, raw: u8) -> u16 {
        if self.has_raw() {
            self.join16(code, raw)
        } else {
            code as u16
        }
    }

    /// Inverse of [`Payload::element`].
    #[inline(always)]
    pub fn split_element(self, e: u16) -> (u8, u8) {
        if self.has_raw() {
            self.split16(e)
        } else {
            (e as u8, 0)
        }
    }

    /// The code that escaped weights decode to; with a zero raw byte it is the number 0 for every
    /// float payload (and code 0 for integers).
    pub fn zero_code(self) -> u8 {
        0
    }

    /// Splits source element bytes (little-endian u16 for 16-bit payloads, one byte per code otherwise)
    /// into codes and raw bytes. Checks that codes fit the payload's width.
    pub fn symbolize(self, bytes: &[u8]) -> Result<(Vec<u8>, Vec<u8>), CodecError> {
        self.validate()?;
        if self.has_raw() {
            if !bytes.len().is_multiple_of(2) {
                return Err(CodecError::Shape(format!(
                    "{} bytes is not a whole number of 16-bit elements",
                    bytes.len()
                )));
            }
            let n = bytes.len() / 2;
            let mut codes = vec![0u8; n];
            let mut raw = vec![0u8; n];
            const CHUNK: usize = 1 << 16;
            codes
                .par_chunks_mut(CHUNK)
                .zip(raw.par_chunks_mut(CHUNK))
                .zip(bytes.par_chunks(2 * CHUNK))
                .for_each(|((codes, raw), bytes)| {
                    for ((c, r), w) in codes
                        .iter_mut()
                        .zip(raw.iter_mut())
                        .zip(bytes.chunks_exact(2))
                    {
                        (*c, *r) = self.split16(u16::from_le_bytes([w[0], w[1]]));
                    }
                });
            Ok((codes, raw))
        } else {
            let limit = self.alphabet();
            if let Some(pos) = bytes.iter().position(|&b| b as usize >= limit) {
                return Err(CodecError::Corrupt(format!(
                    "element {pos} has code {} which does not fit {} bits",
                    bytes[pos],
                    self.code_bits()
                )));
            }
            Ok((bytes.to_vec(), Vec::new()))
        }
    }

    /// Value of one decoded element as f32 (integers: the code itself; scales are applied by the
    /// matvec epilogue).
    #[inline]
    pub fn to_f32(self, code: u8, raw: u8) -> f32 {
        match self {
            Payload::Bf16 => f32::from_bits((self.join16(code, raw) as u32) << 16),
            Payload::Fp16 => half::f16::from_bits(self.join16(code, raw)).to_f32(),
            Payload::Fp8E4m3 => fp8_e4m3_to_f32(code),
            Payload::Fp8E5m2 => half::f16::from_bits((code as u16) << 8).to_f32(),
            Payload::Fp4E2m1 => fp4_e2m1_to_f32(code),
            Payload::Int(_) => code as f32,
        }
    }
}

/// OCP FP8 E4M3 ("fn": no infinities, 0x7F/0xFF are NaN).
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 0x7) as f32;
    if e == 0xF && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Nearest FP8 E4M3 code to `v` (round to nearest, ties to even; saturates at ±448).
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(448.0);
    // The non-negative finite codes 0..=0x7E increase with their value: binary search for the
    // first code at or above `a`, then take the nearer of it and the one below (ties: even code).
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fp8_e4m3_to_f32(mid) < a {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return sign;
    }
    let below = lo - 1;
    let (down, up) = (a - fp8_e4m3_to_f32(below), fp8_e4m3_to_f32(lo) - a);
    let best = if down < up || (down == up && below & 1 == 0) {
        below
    } else {
        lo
    };
    sign | best
}

/// FP4 E2M1: values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit (bit 3).
pub fn fp4_e2m1_to_f32(n: u8) -> f32 {
    const V: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = V[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

#[cfg(test)]
mod tests {

    /// The nearest code by exhaustive search (ties to the even code), the definition the fast
    /// conversion must match.
    fn fp8_e4m3_by_search(v: f32) -> u8 {
        let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
        let a = v.abs().min(448.0);
        let mut best = 0u8;
        let mut best_err = f32::INFINITY;
        for c in 0u8..=0x7E {
            let err = (fp8_e4m3_to_f32(c) - a).abs();
            if err < best_err || (err == best_err && c & 1 == 0) {
                best = c;
                best_err = err;
            }
        }
        sign | best
    }

    #[test]
    fn fp8_e4m3_rounding_matches_the_exhaustive_search() {
        let mut vals = vec![
            0.0f32,
            -0.0,
            448.0,
            449.0,
            1e9,
            -1e9,
            f32::MIN_POSITIVE,
            1e-30,
        ];
        for c in 0u8..=0x7E {
            // Every code, and the midpoints to its neighbours (ties), and just around them.
            let x = fp8_e4m3_to_f32(c);
            let y = fp8_e4m3_to_f32(c.saturating_add(1).min(0x7E));
            let mid = (x + y) / 2.0;
            vals.extend([
                x,
                mid,
                mid.next_up(),
                mid.next_down(),
                x.next_up(),
                x.next_down(),
            ]);
        }
        let mut g = crate::rng::SplitMix64::new(1);
        for _ in 0..20_000 {
            let r = g.next_u64();
            vals.push(
                f32::from_bits(r as u32 & 0x43FF_FFFF) * if r >> 63 == 1 { -1.0 } else { 1.0 },
            );
        }
        for v in vals {
            for v in [v, -v] {
                assert_eq!(f32_to_fp8_e4m3(v), fp8_e4m3_by_search(v), "{v:e}");
            }
        }
    }
    use super::*;

    #[test]
    fn bf16_split_join_is_identity_on_all_patterns() {
        for w in 0..=u16::MAX {
            let (c, r) = Payload::Bf16.split16(w);
            assert_eq!(Payload::Bf16.join16(c, r), w);
            let (c, r) = Payload::Fp16.split16(w);
            assert_eq!(Payload::Fp16.join16(c, r), w);
        }
    }

    #[test]
    fn bf16_code_is_the_exponent() {
        let w = half::bf16::from_f32(-0.75).to_bits();
        let (c, r) = Payload::Bf16.split16(w);
        assert_eq!(c, 126);
        assert_eq!(r & 0x80, 0x80);
        assert_eq!(Payload::Bf16.to_f32(c, r), -0.75);
    }

    #[test]
    fn zero_code_with_zero_raw_is_zero() {
        for p in [
            Payload::Bf16,
            Payload::Fp16,
            Payload::Fp8E4m3,
            Payload::Fp8E5m2,
            Payload::Fp4E2m1,
        ] {
            assert_eq!(p.to_f32(p.zero_code(), 0), 0.0, "{p:?}");
        }
    }

    #[test]
    fn fp8_e4m3_table() {
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_to_f32(0x7F).is_nan());
        for c in 0u8..=0x7E {
            assert_eq!(f32_to_fp8_e4m3(fp8_e4m3_to_f32(c)), c);
            assert_eq!(
                f32_to_fp8_e4m3(-fp8_e4m3_to_f32(c)),
                if c == 0 { 0x80 } else { c | 0x80 }
            );
        }
    }

    #[test]
    fn int_codes_must_fit() {
        assert!(Payload::Int(4).symbolize(&[0, 15, 3]).is_ok());
        assert!(Payload::Int(4).symbolize(&[16]).is_err());
        assert!(Payload::Int(9).symbolize(&[1]).is_err());
        assert!(Payload::Bf16.symbolize(&[1, 2, 3]).is_err());
    }
}
