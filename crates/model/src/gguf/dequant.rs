//! Dequantisation of ggml tensors to f32: each block by its type's row of the quant-type table
//! ([`entrollm_format::qtype`], whose [`dequant`](entrollm_format::qtype::dequant) computes
//! exactly what `ggml-quants.c` does, formats.md §1.4), with the tensor's name in errors and large
//! tensors split over threads.

use super::types::GgmlType;
use crate::error::{ModelError, Result};
use entrollm_format::qtype::BlockFn;
pub use entrollm_format::qtype::DEQUANTIZABLE;
use rayon::prelude::*;

/// Tensors with at least this many elements are dequantised in parallel.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Fails with [`ModelError::Unsupported`] naming `name` unless [`dequantize`] handles `ty`.
/// Callers check this before allocating the output.
pub fn check_dequantizable(name: &str, ty: GgmlType) -> Result<()> {
    supported_block_fn(name, ty).map(|_| ())
}

fn supported_block_fn(name: &str, ty: GgmlType) -> Result<BlockFn> {
    ty.row().to_f32.ok_or_else(|| {
        let supported: Vec<&str> = DEQUANTIZABLE.iter().map(|t| t.name()).collect();
        ModelError::Unsupported(format!(
            "tensor `{name}`: ggml type {ty} cannot be dequantised (supported: {})",
            supported.join(", ")
        ))
    })
}

/// Dequantises whole blocks of `ty` from `src` into `dst` (`dst.len()` elements, `src` exactly
/// their bytes). `name` names the tensor in errors. Large inputs are split over rayon threads.
pub fn dequantize(name: &str, ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let f = supported_block_fn(name, ty)?;
    let (bs, ts) = ty.block_layout();
    if !dst.len().is_multiple_of(bs) || ty.bytes_for(dst.len() as u64) != Some(src.len() as u64) {
        return Err(ModelError::tensor(
            name,
            format!(
                "{} bytes of {ty} do not hold {} elements ({bs} per {ts}-byte block)",
                src.len(),
                dst.len()
            ),
        ));
    }
    let run = |src: &[u8], dst: &mut [f32]| {
        for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
            f(b, y);
        }
    };
    if dst.len() >= PARALLEL_MIN_ELEMENTS {
        // Chunks of whole blocks, about 16K elements each.
        let blocks_per_chunk = (16384 / bs).max(1);
        src.par_chunks(blocks_per_chunk * ts)
            .zip(dst.par_chunks_mut(blocks_per_chunk * bs))
            .for_each(|(s, d)| run(s, d));
    } else {
        run(src, dst);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use entrollm_format::qtype::dequant::{
        e8m0_half, f16_at, scale_min_k4, ue4m3_half, FP4_VALUES,
    };
    use half::f16;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn halves_convert_exactly_as_the_half_crate_does() {
        for h in 0..=u16::MAX {
            let ours = f16_at(&h.to_le_bytes(), 0);
            let theirs = f16::from_bits(h).to_f32();
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
        }
    }

    fn deq(ty: GgmlType, block: &[u8]) -> Vec<f32> {
        let mut y = vec![f32::NAN; ty.block_size() * block.len() / ty.type_size()];
        dequantize("t", ty, block, &mut y).unwrap();
        y
    }

    #[test]
    fn plain_floats() {
        let mut b = Vec::new();
        b.extend_from_slice(&1.5f32.to_le_bytes());
        b.extend_from_slice(&(-0.25f32).to_le_bytes());
        assert_eq!(deq(GgmlType::F32, &b), vec![1.5, -0.25]);
        // F16 0x3C00 = 1.0, 0xC000 = -2.0, 0x0001 = smallest subnormal 2^-24.
        let b = [0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00];
        assert_eq!(deq(GgmlType::F16, &b), vec![1.0, -2.0, 2f32.powi(-24)]);
        // BF16 0x3F80 = 1.0, 0xC0A0 = -5.0.
        assert_eq!(
            deq(GgmlType::BF16, &[0x80, 0x3F, 0xA0, 0xC0]),
            vec![1.0, -5.0]
        );
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let y = deq(GgmlType::Q8_0, &b);
        for (j, &y) in y.iter().enumerate() {
            assert_eq!(y, (j as f32 - 16.0) * 0.5);
        }
    }

    #[test]
    fn q4_0_block_low_nibbles_first() {
        let mut b = h(2.0).to_vec();
        // Byte j: low nibble j, high nibble 15 - j.
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(GgmlType::Q4_0, &b);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0, "low {j}");
            assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * 2.0, "high {j}");
        }
    }

    #[test]
    fn q4_1_block() {
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        b.extend((0..16u8).map(|j| j | (3 << 4)));
        let y = deq(GgmlType::Q4_1, &b);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.25 - 1.0);
            assert_eq!(y[j + 16], 3.0 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q5_0_block_high_bits() {
        let mut b = h(1.0).to_vec();
        // qh bit j = 1 for even j: elements 0, 2, ..., 30 get +16.
        b.extend_from_slice(&0x5555_5555u32.to_le_bytes());
        b.extend((0..16u8).map(|j| (j & 0xF) | (7 << 4)));
        let y = deq(GgmlType::Q5_0, &b);
        for j in 0..16usize {
            let hi = if j.is_multiple_of(2) { 16 } else { 0 };
            assert_eq!(y[j], (j as i32 + hi - 16) as f32, "{j}");
            assert_eq!(y[j + 16], (7 + hi - 16) as f32, "{}", j + 16);
        }
    }

    #[test]
    fn q5_1_block() {
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&h(2.0));
        // Only element 31's high bit set.
        b.extend_from_slice(&(1u32 << 31).to_le_bytes());
        b.extend(std::iter::repeat_n(0xF1u8, 16));
        let y = deq(GgmlType::Q5_1, &b);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 + 2.0);
            let q = if j == 15 { 15 + 16 } else { 15 };
            assert_eq!(y[j + 16], q as f32 * 0.5 + 2.0);
        }
    }

    /// Packs eight 6-bit (scale, min) pairs the way ggml's K-quant quantizer does.
    fn pack_k4_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                s[j] = sc[j];
                s[j + 4] = mn[j];
            } else {
                s[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
                s[j - 4] |= (sc[j] >> 4) << 6;
                s[j] |= (mn[j] >> 4) << 6;
            }
        }
        s
    }

    #[test]
    fn k4_scale_unpacking_inverts_the_packing() {
        let sc = [1, 63, 17, 40, 33, 2, 63, 50];
        let mn = [0, 5, 63, 31, 48, 62, 1, 20];
        let s = pack_k4_scales(sc, mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &s), (sc[j], mn[j]), "pair {j}");
        }
    }

    #[test]
    fn q4_k_block() {
        let sc = [1, 2, 3, 4, 5, 6, 7, 63];
        let mn = [0, 1, 2, 3, 60, 10, 20, 33];
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&h(0.25));
        b.extend_from_slice(&pack_k4_scales(sc, mn));
        let qs: Vec<u8> = (0..128)
            .map(|i| (i % 16) as u8 | (((i / 8) % 16) as u8) << 4)
            .collect();
        b.extend_from_slice(&qs);
        let y = deq(GgmlType::Q4_K, &b);
        for c in 0..4 {
            for l in 0..32 {
                let q = qs[32 * c + l];
                let lo = 0.5 * sc[2 * c] as f32 * (q & 0xF) as f32 - 0.25 * mn[2 * c] as f32;
                let hi = 0.5 * sc[2 * c + 1] as f32 * (q >> 4) as f32 - 0.25 * mn[2 * c + 1] as f32;
                assert_eq!(y[64 * c + l], lo, "chunk {c} elem {l}");
                assert_eq!(y[64 * c + 32 + l], hi, "chunk {c} elem {}", 32 + l);
            }
        }
    }

    #[test]
    fn q5_k_block() {
        let sc = [3, 9, 1, 63, 12, 7, 40, 2];
        let mn = [5, 0, 63, 8, 16, 33, 1, 4];
        let mut b = h(0.125).to_vec();
        b.extend_from_slice(&h(1.0));
        b.extend_from_slice(&pack_k4_scales(sc, mn));
        let qh: Vec<u8> = (0..32).map(|l| (l * 37 % 256) as u8).collect();
        let qs: Vec<u8> = (0..128).map(|i| (i * 11 % 256) as u8).collect();
        b.extend_from_slice(&qh);
        b.extend_from_slice(&qs);
        let y = deq(GgmlType::Q5_K, &b);
        for c in 0..4 {
            for l in 0..32 {
                let q = qs[32 * c + l];
                let bit = |k: usize| ((qh[l] >> k) & 1) as u32 * 16;
                let v_lo = (q & 0xF) as u32 + bit(2 * c);
                let v_hi = (q >> 4) as u32 + bit(2 * c + 1);
                let lo = 0.125 * sc[2 * c] as f32 * v_lo as f32 - mn[2 * c] as f32;
                let hi = 0.125 * sc[2 * c + 1] as f32 * v_hi as f32 - mn[2 * c + 1] as f32;
                assert_eq!(y[64 * c + l], lo, "chunk {c} elem {l}");
                assert_eq!(y[64 * c + 32 + l], hi, "chunk {c} elem {}", 32 + l);
            }
        }
    }

    #[test]
    fn q6_k_block() {
        let ql: Vec<u8> = (0..128).map(|i| (i * 29 % 256) as u8).collect();
        let qh: Vec<u8> = (0..64).map(|i| (i * 71 % 256) as u8).collect();
        let sc: Vec<i8> = (0..16).map(|i| (i as i8 - 8) * 3).collect();
        let mut b = ql.clone();
        b.extend_from_slice(&qh);
        b.extend(sc.iter().map(|&s| s as u8));
        b.extend_from_slice(&h(0.5));
        let y = deq(GgmlType::Q6_K, &b);
        // Element e of the block: half n = e/128, r = e%128, quarter k = r/32, l = r%32.
        for (e, &ye) in y.iter().enumerate() {
            let (n, r) = (e / 128, e % 128);
            let (k, l) = (r / 32, r % 32);
            let low_byte = ql[64 * n + l + if k % 2 == 1 { 32 } else { 0 }];
            let low = if k < 2 { low_byte & 0xF } else { low_byte >> 4 };
            let high = (qh[32 * n + l] >> (2 * k)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            let s = sc[8 * n + l / 16 + 2 * k] as f32;
            assert_eq!(ye, 0.5 * s * q as f32, "element {e}");
        }
    }

    #[test]
    fn fp4_scales_decode_as_ggml_defines_them() {
        for e in 0..=255u8 {
            // 2^(e − 128), computed in f64 (exact there; e < 2 are f32 subnormals).
            let want = 2f64.powi(e as i32 - 128) as f32;
            assert_eq!(e8m0_half(e).to_bits(), want.to_bits(), "e8m0 {e}");
        }
        for x in 0..=255u8 {
            let (exp, man) = (((x >> 3) & 0xF) as i32, (x & 7) as f64);
            let raw = match exp {
                0 => man * 2f64.powi(-9),
                _ => (1.0 + man / 8.0) * 2f64.powi(exp - 7),
            };
            let want = if x == 0x7F { 0.0 } else { (raw * 0.5) as f32 };
            assert_eq!(ue4m3_half(x).to_bits(), want.to_bits(), "ue4m3 {x:#04x}");
        }
    }

    #[test]
    fn mxfp4_block_low_nibbles_first() {
        // e = 127: a scale of one half, so the values are E2M1's own.
        let mut b = vec![127u8];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(GgmlType::MXFP4, &b);
        for j in 0..16 {
            assert_eq!(y[j], FP4_VALUES[j] as f32 * 0.5, "low {j}");
            assert_eq!(y[j + 16], FP4_VALUES[15 - j] as f32 * 0.5, "high {j}");
        }
    }

    #[test]
    fn nvfp4_block_sub_blocks_of_sixteen() {
        // Scales 0.5·{1, 2, 1.125, 480}: E4M3 0x38, 0x40, 0x39 and 0xFF (bit 7 ignored).
        let d = [0x38u8, 0x40, 0x39, 0xFF];
        let mut b = d.to_vec();
        // Sub-block s's byte j: low nibble (j + s) mod 16, high nibble 15 − j.
        b.extend((0..32u8).map(|i| ((i % 8 + i / 8) % 16) | ((15 - i % 8) << 4)));
        let y = deq(GgmlType::NVFP4, &b);
        let scale = [0.5f32, 1.0, 0.5625, 240.0];
        for s in 0..4 {
            for j in 0..8 {
                let lo = FP4_VALUES[(j + s) % 16] as f32 * scale[s];
                assert_eq!(y[16 * s + j], lo, "sub-block {s} low {j}");
                let hi = FP4_VALUES[15 - j] as f32 * scale[s];
                assert_eq!(y[16 * s + 8 + j], hi, "sub-block {s} high {j}");
            }
        }
    }

    // Blocks with edge scales (MXFP4 e = 0, 1, 2, 127, 254, 255; NVFP4 d = 0, 1, 7, 8, 0x7E,
    // 0x7F, 0x80, 0xFF and some ordinary ones), every code in both nibbles, and the bits of
    // their dequantisation by gguf-py 0.19.0 (`gguf.quants.dequantize`): infinities where the
    // largest E8M0 scales overflow, negative zeros where a zero NVFP4 scale meets a negative code.
    const MXFP4_BLOCKS: [[u8; 17]; 6] = [
        [
            0x00, 0xf0, 0xe1, 0xd2, 0xc3, 0xb4, 0xa5, 0x96, 0x87, 0x78, 0x69, 0x5a, 0x4b, 0x3c,
            0x2d, 0x1e, 0x0f,
        ],
        [
            0x01, 0x21, 0x12, 0x03, 0xf4, 0xe5, 0xd6, 0xc7, 0xb8, 0xa9, 0x9a, 0x8b, 0x7c, 0x6d,
            0x5e, 0x4f, 0x30,
        ],
        [
            0x02, 0x52, 0x43, 0x34, 0x25, 0x16, 0x07, 0xf8, 0xe9, 0xda, 0xcb, 0xbc, 0xad, 0x9e,
            0x8f, 0x70, 0x61,
        ],
        [
            0x7f, 0x83, 0x74, 0x65, 0x56, 0x47, 0x38, 0x29, 0x1a, 0x0b, 0xfc, 0xed, 0xde, 0xcf,
            0xb0, 0xa1, 0x92,
        ],
        [
            0xfe, 0xb4, 0xa5, 0x96, 0x87, 0x78, 0x69, 0x5a, 0x4b, 0x3c, 0x2d, 0x1e, 0x0f, 0xf0,
            0xe1, 0xd2, 0xc3,
        ],
        [
            0xff, 0xe5, 0xd6, 0xc7, 0xb8, 0xa9, 0x9a, 0x8b, 0x7c, 0x6d, 0x5e, 0x4f, 0x30, 0x21,
            0x12, 0x03, 0xf4,
        ],
    ];
    const MXFP4_EXPECTED: [u32; 192] = [
        0x00000000, 0x00200000, 0x00400000, 0x00600000, 0x00800000, 0x00c00000, 0x01000000,
        0x01400000, 0x00000000, 0x80200000, 0x80400000, 0x80600000, 0x80800000, 0x80c00000,
        0x81000000, 0x81400000, 0x81400000, 0x81000000, 0x80c00000, 0x80800000, 0x80600000,
        0x80400000, 0x80200000, 0x00000000, 0x01400000, 0x01000000, 0x00c00000, 0x00800000,
        0x00600000, 0x00400000, 0x00200000, 0x00000000, 0x00400000, 0x00800000, 0x00c00000,
        0x01000000, 0x01400000, 0x01800000, 0x01c00000, 0x00000000, 0x80400000, 0x80800000,
        0x80c00000, 0x81000000, 0x81400000, 0x81800000, 0x81c00000, 0x00000000, 0x00800000,
        0x00400000, 0x00000000, 0x81c00000, 0x81800000, 0x81400000, 0x81000000, 0x80c00000,
        0x80800000, 0x80400000, 0x00000000, 0x01c00000, 0x01800000, 0x01400000, 0x01000000,
        0x00c00000, 0x01000000, 0x01400000, 0x01800000, 0x01c00000, 0x02000000, 0x02400000,
        0x00000000, 0x80800000, 0x81000000, 0x81400000, 0x81800000, 0x81c00000, 0x82000000,
        0x82400000, 0x00000000, 0x00800000, 0x01c00000, 0x01800000, 0x01400000, 0x01000000,
        0x00800000, 0x00000000, 0x82400000, 0x82000000, 0x81c00000, 0x81800000, 0x81400000,
        0x81000000, 0x80800000, 0x00000000, 0x02400000, 0x02000000, 0x3fc00000, 0x40000000,
        0x40400000, 0x40800000, 0x40c00000, 0x00000000, 0xbf000000, 0xbf800000, 0xbfc00000,
        0xc0000000, 0xc0400000, 0xc0800000, 0xc0c00000, 0x00000000, 0x3f000000, 0x3f800000,
        0x00000000, 0x40c00000, 0x40800000, 0x40400000, 0x40000000, 0x3fc00000, 0x3f800000,
        0x3f000000, 0x00000000, 0xc0c00000, 0xc0800000, 0xc0400000, 0xc0000000, 0xbfc00000,
        0xbf800000, 0xbf000000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x00000000,
        0xfe800000, 0xff000000, 0xff400000, 0xff800000, 0xff800000, 0xff800000, 0xff800000,
        0x00000000, 0x7e800000, 0x7f000000, 0x7f400000, 0xff400000, 0xff000000, 0xfe800000,
        0x00000000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f400000, 0x7f000000,
        0x7e800000, 0x00000000, 0xff800000, 0xff800000, 0xff800000, 0xff800000, 0x7f800000,
        0x7f800000, 0x7f800000, 0x00000000, 0xff000000, 0xff800000, 0xff800000, 0xff800000,
        0xff800000, 0xff800000, 0xff800000, 0x00000000, 0x7f000000, 0x7f800000, 0x7f800000,
        0x7f800000, 0xff800000, 0xff800000, 0xff800000, 0xff800000, 0xff800000, 0xff000000,
        0x00000000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000,
        0x7f000000, 0x00000000, 0xff800000,
    ];
    const NVFP4_BLOCKS: [[u8; 36]; 3] = [
        [
            0x00, 0x01, 0x07, 0x08, 0x00, 0x71, 0xe2, 0x53, 0xc4, 0x35, 0xa6, 0x17, 0x88, 0xf9,
            0x6a, 0xdb, 0x4c, 0xbd, 0x2e, 0x9f, 0x00, 0x71, 0xe2, 0x53, 0xc4, 0x35, 0xa6, 0x17,
            0x88, 0xf9, 0x6a, 0xdb, 0x4c, 0xbd, 0x2e, 0x9f,
        ],
        [
            0x7e, 0x7f, 0x80, 0xff, 0x15, 0x86, 0xf7, 0x68, 0xd9, 0x4a, 0xbb, 0x2c, 0x9d, 0x0e,
            0x7f, 0xe0, 0x51, 0xc2, 0x33, 0xa4, 0x15, 0x86, 0xf7, 0x68, 0xd9, 0x4a, 0xbb, 0x2c,
            0x9d, 0x0e, 0x7f, 0xe0, 0x51, 0xc2, 0x33, 0xa4,
        ],
        [
            0x38, 0x47, 0x0f, 0x55, 0x2a, 0x9b, 0x0c, 0x7d, 0xee, 0x5f, 0xc0, 0x31, 0xa2, 0x13,
            0x84, 0xf5, 0x66, 0xd7, 0x48, 0xb9, 0x2a, 0x9b, 0x0c, 0x7d, 0xee, 0x5f, 0xc0, 0x31,
            0xa2, 0x13, 0x84, 0xf5, 0x66, 0xd7, 0x48, 0xb9,
        ],
    ];
    const NVFP4_EXPECTED: [u32; 192] = [
        0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
        0x00000000, 0x00000000, 0x00000000, 0x80000000, 0x00000000, 0x80000000, 0x00000000,
        0x80000000, 0x00000000, 0x00000000, 0xba800000, 0xbb000000, 0xbb400000, 0xbb800000,
        0xbbc00000, 0xbc000000, 0xbc400000, 0x00000000, 0xbc400000, 0x3c000000, 0xbbc00000,
        0x3b800000, 0xbb400000, 0x3b000000, 0xba800000, 0x00000000, 0x3be00000, 0x3c600000,
        0x3ca80000, 0x3ce00000, 0x3d280000, 0x3d600000, 0x3da80000, 0x00000000, 0x3da80000,
        0xbd600000, 0x3d280000, 0xbce00000, 0x3ca80000, 0xbc600000, 0x3be00000, 0x00000000,
        0xbc000000, 0xbc800000, 0xbcc00000, 0xbd000000, 0xbd400000, 0xbd800000, 0xbdc00000,
        0x00000000, 0xbdc00000, 0x3d800000, 0xbd400000, 0x3d000000, 0xbcc00000, 0x3c800000,
        0xbc000000, 0x44a80000, 0x44e00000, 0x45280000, 0x00000000, 0xc3600000, 0xc3e00000,
        0xc4280000, 0xc4600000, 0x43600000, 0x00000000, 0xc5280000, 0x44e00000, 0xc4a80000,
        0x44600000, 0xc4280000, 0x43e00000, 0x80000000, 0x80000000, 0x80000000, 0x00000000,
        0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x80000000, 0x00000000, 0x00000000,
        0x80000000, 0x00000000, 0x80000000, 0x00000000, 0x80000000, 0x00000000, 0x00000000,
        0x00000000, 0x00000000, 0x80000000, 0x80000000, 0x80000000, 0x80000000, 0x00000000,
        0x00000000, 0x80000000, 0x00000000, 0x80000000, 0x00000000, 0x80000000, 0x00000000,
        0xc4b40000, 0xc4f00000, 0xc5340000, 0x00000000, 0x43700000, 0x43f00000, 0x44340000,
        0x44700000, 0xc3700000, 0x00000000, 0x45340000, 0xc4f00000, 0x44b40000, 0xc4700000,
        0x44340000, 0xc3f00000, 0xbf800000, 0xbfc00000, 0xc0000000, 0xc0400000, 0xc0800000,
        0xc0c00000, 0x00000000, 0x3f000000, 0x3f800000, 0xbf000000, 0x00000000, 0x40c00000,
        0xc0800000, 0x40400000, 0xc0000000, 0x3fc00000, 0x40700000, 0x40b40000, 0x40f00000,
        0x41340000, 0x41700000, 0x41b40000, 0x00000000, 0xbff00000, 0xc0700000, 0x3ff00000,
        0x00000000, 0xc1b40000, 0x41700000, 0xc1340000, 0x40f00000, 0xc0b40000, 0xbcf00000,
        0xbd340000, 0xbd700000, 0xbdb40000, 0xbdf00000, 0xbe340000, 0x00000000, 0x3c700000,
        0x3cf00000, 0xbc700000, 0x00000000, 0x3e340000, 0xbdf00000, 0x3db40000, 0xbd700000,
        0x3d340000, 0x41500000, 0x419c0000, 0x41d00000, 0x421c0000, 0x42500000, 0x429c0000,
        0x00000000, 0xc0d00000, 0xc1500000, 0x40d00000, 0x00000000, 0xc29c0000, 0x42500000,
        0xc21c0000, 0x41d00000, 0xc19c0000,
    ];
    fn assert_bits(ty: GgmlType, blocks: &[u8], expected: &[u32]) {
        let y = deq(ty, blocks);
        assert_eq!(y.len(), expected.len());
        for (i, (&y, &want)) in y.iter().zip(expected).enumerate() {
            let want = f32::from_bits(want);
            // Both sides are NaN-free here; a NaN would match any NaN, whatever its payload.
            let same = y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan());
            assert!(
                same,
                "{ty} element {i}: ours {y:e} ({:#010x}), gguf-py {want:e}",
                y.to_bits()
            );
        }
    }

    #[test]
    fn fp4_blocks_match_gguf_py_bit_for_bit() {
        assert_bits(
            GgmlType::MXFP4,
            MXFP4_BLOCKS.as_flattened(),
            &MXFP4_EXPECTED,
        );
        assert_bits(
            GgmlType::NVFP4,
            NVFP4_BLOCKS.as_flattened(),
            &NVFP4_EXPECTED,
        );
        // The edges are there: infinities from e = 254 and 255, negative zeros from d = 0.
        assert!(MXFP4_EXPECTED[128..]
            .iter()
            .any(|&b| f32::from_bits(b) == f32::INFINITY));
        assert!(NVFP4_EXPECTED[..16].contains(&0x8000_0000));
    }

    #[test]
    fn unsupported_type_and_bad_lengths_are_errors() {
        let err = dequantize("blk.0.x", GgmlType::IQ2_XXS, &[0; 66], &mut [0.0; 256]).unwrap_err();
        assert!(
            matches!(&err, ModelError::Unsupported(m) if m.contains("blk.0.x") && m.contains("IQ2_XXS")),
            "{err}"
        );
        let err = dequantize("w", GgmlType::Q4_0, &[0; 17], &mut [0.0; 32]).unwrap_err();
        assert!(err.to_string().contains("w"), "{err}");
        assert!(dequantize("w", GgmlType::Q4_0, &[0; 18], &mut [0.0; 31]).is_err());
    }

    #[test]
    fn parallel_path_matches_serial() {
        let n_blocks = PARALLEL_MIN_ELEMENTS / 32 + 7;
        let mut src = Vec::with_capacity(n_blocks * 20);
        for i in 0..n_blocks {
            src.extend_from_slice(&h(0.01 * (i % 50) as f32));
            src.extend_from_slice(&h(-0.5));
            src.extend((0..16).map(|j| ((i * 7 + j * 13) % 256) as u8));
        }
        let mut par = vec![0.0; n_blocks * 32];
        dequantize("w", GgmlType::Q4_1, &src, &mut par).unwrap();
        for (i, (b, y)) in src.chunks_exact(20).zip(par.chunks_exact(32)).enumerate() {
            assert_eq!(deq(GgmlType::Q4_1, b), y, "block {i}");
        }
    }
}
