//! Raw access to the integer codes of the simple 32-element ggml block types, for lossless
//! re-coding: [`unpack_codes`] splits blocks into one code per weight plus per-block f16 scales,
//! and [`pack_codes`] rebuilds the exact original bytes.
//!
//! Codes are in weight order (element j of block b is `codes[32·b + j]`): Q4_0/Q4_1 0..=15,
//! Q5_0/Q5_1 0..=31 (the high bit from `qh`), Q8_0 the i8 value's bit pattern as u8.

use super::types::GgmlType;
use crate::error::{ModelError, Result};

const QK: usize = 32;

/// The codes and scales of a tensor of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantCodes {
    pub ggml_type: GgmlType,
    /// One code per weight, in weight order.
    pub codes: Vec<u8>,
    /// Per-block scale `d`, as f16 bits.
    pub d: Vec<u16>,
    /// Per-block offset `m` (f16 bits) of the `_1` types; `None` for the others.
    pub m: Option<Vec<u16>>,
}

/// Layout of one code-bearing block type: whether it has `m`, code width in bits.
struct Layout {
    has_m: bool,
    bits: u32,
}

fn layout(name: &str, ty: GgmlType) -> Result<Layout> {
    Ok(match ty {
        GgmlType::Q4_0 => Layout { has_m: false, bits: 4 },
        GgmlType::Q4_1 => Layout { has_m: true, bits: 4 },
        GgmlType::Q5_0 => Layout { has_m: false, bits: 5 },
        GgmlType::Q5_1 => Layout { has_m: true, bits: 5 },
        GgmlType::Q8_0 => Layout { has_m: false, bits: 8 },
        _ => {
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}`: raw codes are available for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, not {ty}"
            )))
        }
    })
}

/// Bits per code of a code-bearing type (4, 5 or 8), or `None` for other types.
pub fn code_bits(ty: GgmlType) -> Option<u32> {
    layout("", ty).ok().map(|l| l.bits)
}

/// Splits `bytes` (whole blocks of `ty`) into codes and scales. `name` names the tensor in errors.
pub fn unpack_codes(name: &str, ty: GgmlType, bytes: &[u8]) -> Result<QuantCodes> {
    let l = layout(name, ty)?;
    let ts = ty.type_size();
    if !bytes.len().is_multiple_of(ts) {
        return Err(ModelError::tensor(
            name,
            format!(
                "{} bytes are not whole {ty} blocks of {ts} bytes",
                bytes.len()
            ),
        ));
    }
    let n_blocks = bytes.len() / ts;
    let mut codes = Vec::with_capacity(n_blocks * QK);
    let mut d = Vec::with_capacity(n_blocks);
    let mut m = l.has_m.then(|| Vec::with_capacity(n_blocks));
    for b in bytes.chunks_exact(ts) {
        d.push(u16::from_le_bytes([b[0], b[1]]));
        let mut at = 2;
        if let Some(m) = &mut m {
            m.push(u16::from_le_bytes([b[2], b[3]]));
            at = 4;
        }
        match l.bits {
            8 => codes.extend_from_slice(&b[at..at + QK]),
            4 => {
                let qs = &b[at..at + 16];
                codes.extend(qs.iter().map(|q| q & 0x0F));
                codes.extend(qs.iter().map(|q| q >> 4));
            }
            _ => {
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 20];
                let high = |j: usize| (((qh >> j) & 1) << 4) as u8;
                codes.extend(qs.iter().enumerate().map(|(j, q)| (q & 0x0F) | high(j)));
                codes.extend(qs.iter().enumerate().map(|(j, q)| (q >> 4) | high(j + 16)));
            }
        }
    }
    Ok(QuantCodes {
        ggml_type: ty,
        codes,
        d,
        m,
    })
}

/// Re-packs codes and scales into ggml block bytes; the exact inverse of [`unpack_codes`].
pub fn pack_codes(q: &QuantCodes) -> Result<Vec<u8>> {
    let ty = q.ggml_type;
    let name = "codes";
    let l = layout(name, ty)?;
    let n_blocks = q.d.len();
    if q.codes.len() != n_blocks * QK {
        return Err(ModelError::tensor(
            name,
            format!(
                "{} codes for {n_blocks} {ty} blocks; expected {}",
                q.codes.len(),
                n_blocks * QK
            ),
        ));
    }
    match (&q.m, l.has_m) {
        (Some(m), true) if m.len() == n_blocks => {}
        (None, false) => {}
        (m, _) => {
            return Err(ModelError::tensor(
                name,
                format!(
                    "{ty} needs {} per-block m values, got {}",
                    if l.has_m { n_blocks } else { 0 },
                    m.as_ref()
                        .map_or_else(|| "none".to_string(), |m| m.len().to_string())
                ),
            ))
        }
    }
    let max_code = if l.bits == 8 {
        u8::MAX
    } else {
        (1u8 << l.bits) - 1
    };
    if let Some(i) = q.codes.iter().position(|&c| c > max_code) {
        return Err(ModelError::tensor(
            name,
            format!(
                "code {i} is {}, above the {}-bit maximum {max_code} of {ty}",
                q.codes[i], l.bits
            ),
        ));
    }
    let mut out = Vec::with_capacity(n_blocks * ty.type_size());
    for (b, codes) in q.codes.chunks_exact(QK).enumerate() {
        out.extend_from_slice(&q.d[b].to_le_bytes());
        if let Some(m) = &q.m {
            out.extend_from_slice(&m[b].to_le_bytes());
        }
        match l.bits {
            8 => out.extend_from_slice(codes),
            4 => out.extend((0..16).map(|j| codes[j] | (codes[j + 16] << 4))),
            _ => {
                let qh = codes
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (j, &c)| acc | (u32::from(c >> 4) << j));
                out.extend_from_slice(&qh.to_le_bytes());
                out.extend((0..16).map(|j| (codes[j] & 0x0F) | ((codes[j + 16] & 0x0F) << 4)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::dequant::dequantize;
    use super::*;

    const CODE_TYPES: [GgmlType; 5] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];

    /// xorshift64*: deterministic pseudo-random bytes.
    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn pack_inverts_unpack_on_random_blocks_of_every_type() {
        for ty in CODE_TYPES {
            for seed in 0..20u64 {
                let n_blocks = 1 + (seed as usize * 7) % 13;
                let bytes = random_bytes(seed + 1000 * ty.id() as u64, n_blocks * ty.type_size());
                let q = unpack_codes("t", ty, &bytes).unwrap();
                assert_eq!(q.codes.len(), n_blocks * 32);
                assert_eq!(q.d.len(), n_blocks);
                assert_eq!(
                    q.m.as_ref().map(Vec::len),
                    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1).then_some(n_blocks)
                );
                let max = (1u32 << code_bits(ty).unwrap()) - 1;
                assert!(q.codes.iter().all(|&c| u32::from(c) <= max), "{ty}");
                assert_eq!(pack_codes(&q).unwrap(), bytes, "{ty} seed {seed}");
            }
        }
    }

    /// The codes reproduce the dequantised values: y = (code - offset)·d (+ m).
    #[test]
    fn codes_agree_with_dequantisation() {
        for ty in CODE_TYPES {
            let mut bytes = random_bytes(ty.id() as u64, 4 * ty.type_size());
            // Keep d and m finite: small positive f16 values.
            for b in bytes.chunks_exact_mut(ty.type_size()) {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.125).to_bits().to_le_bytes());
                if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(-1.5).to_bits().to_le_bytes());
                }
            }
            let q = unpack_codes("t", ty, &bytes).unwrap();
            let mut y = vec![0.0; q.codes.len()];
            dequantize("t", ty, &bytes, &mut y).unwrap();
            for (i, (&c, &y)) in q.codes.iter().zip(&y).enumerate() {
                let expected = match ty {
                    GgmlType::Q4_0 => (c as i32 - 8) as f32 * 0.125,
                    GgmlType::Q5_0 => (c as i32 - 16) as f32 * 0.125,
                    GgmlType::Q8_0 => (c as i8) as f32 * 0.125,
                    _ => c as f32 * 0.125 - 1.5,
                };
                assert_eq!(y, expected, "{ty} element {i}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(
            matches!(unpack_codes("w", GgmlType::Q4_K, &[0; 144]), Err(ModelError::Unsupported(m)) if m.contains("w"))
        );
        assert!(unpack_codes("w", GgmlType::Q4_0, &[0; 19]).is_err());
        let mut q = unpack_codes("w", GgmlType::Q4_0, &[0; 18]).unwrap();
        q.codes[3] = 16;
        assert!(pack_codes(&q).unwrap_err().to_string().contains("code 3"));
        q.codes[3] = 0;
        q.m = Some(vec![0]);
        assert!(pack_codes(&q).is_err());
        q.m = None;
        q.codes.pop();
        assert!(pack_codes(&q).is_err());
        let mut q = unpack_codes("w", GgmlType::Q5_1, &[0; 24]).unwrap();
        q.m = None;
        assert!(pack_codes(&q).is_err());
    }
}
