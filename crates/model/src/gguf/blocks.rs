//! Raw access to the integer codes of the simple 32-element ggml block types: GGUF's side of
//! [`entrollm_format::ggml_blocks`], which holds the exact pack/unpack (the block layouts are the
//! quant-type table's, [`entrollm_format::qtype`]).

use super::types::GgmlType;
use crate::error::{ModelError, Result};
pub use entrollm_format::ggml_blocks::{pack_codes, QuantCodes};

/// Splits `bytes` (whole blocks of `ty`) into codes and scales. `name` names the tensor in errors.
pub fn unpack_codes(name: &str, ty: GgmlType, bytes: &[u8]) -> Result<QuantCodes> {
    if !entrollm_format::ggml_blocks::handles(ty) {
        return Err(ModelError::Unsupported(format!(
            "tensor `{name}`: raw codes are available for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, not {ty}"
        )));
    }
    entrollm_format::ggml_blocks::unpack_codes(ty, bytes).map_err(|e| ModelError::tensor(name, e))
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

    #[test]
    fn block_types_agree_with_ggml_sizes() {
        use entrollm_format::ggml_blocks::handles;
        let handled: Vec<GgmlType> = GgmlType::ALL.into_iter().filter(|&t| handles(t)).collect();
        assert_eq!(handled, CODE_TYPES);
        for (ty, bytes) in CODE_TYPES.into_iter().zip([18, 20, 22, 24, 34]) {
            assert_eq!(ty.block_layout(), (32, bytes), "{ty}");
        }
        assert!(!handles(GgmlType::Q4_K));
    }

    /// The codes reproduce the dequantised values: y = (code - offset)·d (+ m).
    #[test]
    fn codes_agree_with_dequantisation() {
        let mut g = entrollm_codec::rng::SplitMix64::new(1);
        for ty in CODE_TYPES {
            let mut bytes: Vec<u8> = (0..4 * ty.type_size())
                .map(|_| g.next_u64() as u8)
                .collect();
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
            let block = ty.int_codes().unwrap();
            for (i, (&c, &y)) in q.codes.iter().zip(&y).enumerate() {
                let c = if block.signed {
                    c as i8 as i32
                } else {
                    c as i32
                };
                let m = if block.mins { -1.5 } else { 0.0 };
                let expected = 0.125 * (c - block.offset as i32) as f32 + m;
                assert_eq!(y, expected, "{ty} element {i}");
            }
        }
    }

    /// Each split code is its own weight's: changing code `j` changes dequantised weight `j` only.
    #[test]
    fn split_codes_are_in_weight_order() {
        use entrollm_format::kquants::{join, split, FieldKind};
        let mut g = entrollm_codec::rng::SplitMix64::new(2);
        let mut next = move || g.next_u64();
        for ty in GgmlType::ALL {
            if !ty.splits() || ty.row().to_f32.is_none() {
                continue;
            }
            let bytes: Vec<u8> = (0..3 * ty.type_size()).map(|_| next() as u8).collect();
            let mut sp = split(ty, &bytes).unwrap();
            // Finite, non-zero scales, so that every code moves its weight.
            for (v, f) in sp.fields.iter_mut().zip(ty.fields()) {
                for x in v.iter_mut() {
                    *x = match f.kind {
                        FieldKind::Half => {
                            half::f16::from_f32(0.25 + (next() % 8) as f32 / 64.0).to_bits()
                        }
                        FieldKind::Bits(b) => 1 + (next() % ((1 << b) - 1) as u64) as u16,
                    };
                    // Q3_K's and IQ4_XS's 6-bit scales are offset by 32.
                    if matches!(ty, GgmlType::Q3_K | GgmlType::IQ4_XS) && f.name == "sc" && *x == 32
                    {
                        *x = 33;
                    }
                }
            }
            let dequant = |sp: &entrollm_format::kquants::Split| {
                let b = join(sp).unwrap();
                let mut y = vec![0f32; sp.codes.len()];
                dequantize("t", ty, &b, &mut y).unwrap();
                y
            };
            let base = dequant(&sp);
            let top = 1u16 << ty.code_bits();
            for _ in 0..64 {
                let j = (next() % sp.codes.len() as u64) as usize;
                let mut changed = sp.clone();
                changed.codes[j] = ((u16::from(changed.codes[j]) + 1) % top) as u8;
                let y = dequant(&changed);
                for (i, (a, b)) in base.iter().zip(&y).enumerate() {
                    assert_eq!(a != b, i == j, "{ty}: code {j} moved weight {i}");
                }
            }
        }
    }

    #[test]
    fn unsupported_types_are_named() {
        assert!(
            matches!(unpack_codes("w", GgmlType::Q4_K, &[0; 144]), Err(ModelError::Unsupported(m)) if m.contains("w"))
        );
        assert!(unpack_codes("w", GgmlType::Q4_0, &[0; 19])
            .unwrap_err()
            .to_string()
            .contains("w"));
    }
}
