//! Raw access to the integer codes of the simple 32-element ggml block types: GGUF's side of
//! [`entrollm_format::ggml_blocks`], which holds the block layouts and the exact pack/unpack.

use super::types::GgmlType;
use crate::error::{ModelError, Result};
pub use entrollm_format::ggml_blocks::{pack_codes, BlockType, QuantCodes};
pub use entrollm_format::kquants::KType;

impl GgmlType {
    /// The code-bearing block type this is (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), or `None`.
    pub fn block_type(self) -> Option<BlockType> {
        Some(match self {
            GgmlType::Q4_0 => BlockType::Q4_0,
            GgmlType::Q4_1 => BlockType::Q4_1,
            GgmlType::Q5_0 => BlockType::Q5_0,
            GgmlType::Q5_1 => BlockType::Q5_1,
            GgmlType::Q8_0 => BlockType::Q8_0,
            _ => return None,
        })
    }
}

impl GgmlType {
    /// The block type [`entrollm_format::kquants`] splits into codes and fields (the k-quants,
    /// IQ4_NL/IQ4_XS, MXFP4/NVFP4), or `None`.
    pub fn ktype(self) -> Option<KType> {
        KType::from_name(self.name())
    }
}

/// Bits per code of a code-bearing type (4, 5 or 8), or `None` for other types.
pub fn code_bits(ty: GgmlType) -> Option<u32> {
    ty.block_type().map(BlockType::bits)
}

/// Splits `bytes` (whole blocks of `ty`) into codes and scales. `name` names the tensor in errors.
pub fn unpack_codes(name: &str, ty: GgmlType, bytes: &[u8]) -> Result<QuantCodes> {
    let block = ty.block_type().ok_or_else(|| {
        ModelError::Unsupported(format!(
            "tensor `{name}`: raw codes are available for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, not {ty}"
        ))
    })?;
    entrollm_format::ggml_blocks::unpack_codes(block, bytes)
        .map_err(|e| ModelError::tensor(name, e))
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
        for ty in CODE_TYPES {
            let b = ty.block_type().unwrap();
            assert_eq!(b.block_bytes(), ty.type_size(), "{ty}");
            assert_eq!(b.name(), ty.name());
        }
        assert_eq!(GgmlType::Q4_K.block_type(), None);
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
            let block = ty.block_type().unwrap();
            for (i, (&c, &y)) in q.codes.iter().zip(&y).enumerate() {
                let c = if block.signed() {
                    c as i8 as i32
                } else {
                    c as i32
                };
                let m = if block.has_m() { -1.5 } else { 0.0 };
                let expected = 0.125 * (c - block.offset() as i32) as f32 + m;
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
            let Some(kt) = ty.ktype() else { continue };
            assert_eq!(
                (kt.block_weights(), kt.block_bytes()),
                ty.block_layout(),
                "{ty}"
            );
            if crate::gguf::dequant::block_fn(ty).is_none() {
                continue;
            }
            let bytes: Vec<u8> = (0..3 * kt.block_bytes()).map(|_| next() as u8).collect();
            let mut sp = split(kt, &bytes).unwrap();
            // Finite, non-zero scales, so that every code moves its weight.
            for (v, f) in sp.fields.iter_mut().zip(kt.fields()) {
                for x in v.iter_mut() {
                    *x = match f.kind {
                        FieldKind::Half => {
                            half::f16::from_f32(0.25 + (next() % 8) as f32 / 64.0).to_bits()
                        }
                        FieldKind::Bits(b) => 1 + (next() % ((1 << b) - 1) as u64) as u16,
                    };
                    // Q3_K's and IQ4_XS's 6-bit scales are offset by 32.
                    if matches!(kt, KType::Q3K | KType::Iq4Xs) && f.name == "sc" && *x == 32 {
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
            let top = 1u16 << kt.code_bits();
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
