//! Dequantisation of ggml blocks to f32, exactly as `ggml-quants.c` computes it (formats.md §1.4):
//! the same operations in the same order, so results match ggml's reference bit for bit.

use super::types::GgmlType;
use crate::error::{ModelError, Result};
use half::bf16;
use rayon::prelude::*;

/// The types [`dequantize`] handles.
pub const DEQUANTIZABLE: [GgmlType; 17] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

/// Tensors with at least this many elements are dequantised in parallel.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Dequantises one block (its bytes) into its elements.
pub type BlockFn = fn(&[u8], &mut [f32]);

/// ggml's dequantisation of one block of `ty`, or `None` for types it does not handle.
pub fn block_fn(ty: GgmlType) -> Option<BlockFn> {
    Some(match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::Q2_K => q2_k,
        GgmlType::Q3_K => q3_k,
        GgmlType::IQ4_NL => iq4_nl,
        GgmlType::IQ4_XS => iq4_xs,
        GgmlType::MXFP4 => mxfp4,
        GgmlType::NVFP4 => nvfp4,
        _ => return None,
    })
}

/// Fails with [`ModelError::Unsupported`] naming `name` unless [`dequantize`] handles `ty`.
/// Callers check this before allocating the output.
pub fn check_dequantizable(name: &str, ty: GgmlType) -> Result<()> {
    supported_block_fn(name, ty).map(|_| ())
}

fn supported_block_fn(name: &str, ty: GgmlType) -> Result<BlockFn> {
    block_fn(ty).ok_or_else(|| {
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

/// The little-endian IEEE half at `b[at..]` as f32, exactly as the `half` crate converts it,
/// inlined into the product kernels (a call into `half` per block cost 6 % of a 7B's step).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]) as u32;
    let sign = (h & 0x8000) << 16;
    let (exp, man) = ((h >> 10) & 0x1f, h & 0x3ff);
    match exp {
        // ±0 and subnormals: man · 2^-24, exact in f32.
        0 => f32::from_bits(sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits()),
        31 if man == 0 => f32::from_bits(sign | 0x7f80_0000),
        // NaNs come out quiet, as F16C's conversion gives them.
        31 => f32::from_bits(sign | 0x7fc0_0000 | (man << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (man << 13)),
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = (q as i8) as f32 * d;
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5th bits of a Q5 block: element j's is bit j of `qh` (j in 0..32).
fn q5_high_bits(qh: &[u8]) -> u32 {
    u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]])
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = q5_high_bits(&b[2..6]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((((qs[j] & 0x0F) as u32 | h0) as i32) - 16) as f32 * d;
        y[j + 16] = ((((qs[j] >> 4) as u32 | h1) as i32) - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = q5_high_bits(&b[4..8]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit (scale, min) pair `j` (0..8) of a Q4_K/Q5_K block.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let ql = &qs[32 * c..32 * c + 32];
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * c + l] = d1 * ((ql[l] & 0x0F) + hi1) as f32 - m1;
            y[64 * c + 32 + l] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| sc[is + k] as i8 as f32;
            y[l] = d * s(0) * q1 as f32;
            y[l + 32] = d * s(2) * q2 as f32;
            y[l + 64] = d * s(4) * q3 as f32;
            y[l + 96] = d * s(6) * q4 as f32;
        }
    }
}

/// Q2_K: 16 sub-blocks of 16, 2-bit codes; each sub-block's 4-bit scale and 4-bit min times the
/// block's `d` and `dmin` (`scales[16] qs[64] d dmin`).
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let (mut is, mut out) = (0, 0);
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0xf) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    y[out] = dl * ((q[l + 16 * part] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Q3_K's 16 6-bit sub-block scales (offset 32, not yet removed) from their 12 packed bytes
/// (ggml's `kmask1`/`kmask2` unpacking).
#[inline(always)]
pub(crate) fn q3k_scales(packed: &[u8]) -> [u8; 16] {
    let word = |i: usize| u32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap());
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & kmask2) | ((tmp & kmask1) << 4),
        (a1 & kmask2) | (((tmp >> 2) & kmask1) << 4),
        ((a0 >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4),
        ((a1 >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4),
    ];
    std::array::from_fn(|i| (aux[i / 4] >> (8 * (i % 4))) as u8)
}

/// Q3_K: 16 sub-blocks of 16, 3-bit codes (2 low bits in `qs`, the high one in `hmask`, set
/// meaning +0, clear −4), 6-bit signed scales (offset 32) packed in 12 bytes
/// (`hmask[32] qs[64] scales[12] d`).
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hm, qs) = (&b[..32], &b[32..96]);
    let d_all = f16_at(b, 108);
    let scales = q3k_scales(&b[96..108]);
    let scale = |i: usize| scales[i];
    let (mut is, mut out, mut m) = (0, 0, 1u8);
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for part in 0..2 {
                let dl = d_all * (scale(is) as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let k = l + 16 * part;
                    let low = ((q[k] >> shift) & 3) as i32;
                    let high = if hm[k] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The 16 values IQ4_NL and IQ4_XS codes index (ggml's `kvalues_iq4nl`).
pub(crate) const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 16 bytes of 4-bit indices into [`IQ4NL_VALUES`], times `dl`: low nibbles the first 16
/// values, high nibbles the next 16.
fn iq4_32(qs: &[u8], dl: f32, y: &mut [f32]) {
    for j in 0..16 {
        y[j] = dl * IQ4NL_VALUES[(qs[j] & 0xf) as usize] as f32;
        y[j + 16] = dl * IQ4NL_VALUES[(qs[j] >> 4) as usize] as f32;
    }
}

/// IQ4_NL: blocks of 32 (`d qs[16]`).
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_32(&b[2..18], f16_at(b, 0), y);
}

/// IQ4_XS: 8 sub-blocks of 32, each with a 6-bit scale (offset 32): its low 4 bits in
/// `scales_l`, its high 2 in `scales_h` (`d scales_h:u16 scales_l[4] qs[128]`).
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as i32;
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..8 {
        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
            | (((scales_h >> (2 * ib)) & 3) << 4);
        iq4_32(
            &qs[16 * ib..16 * ib + 16],
            d * (ls - 32) as f32,
            &mut y[32 * ib..32 * ib + 32],
        );
    }
}

/// The 16 values MXFP4 and NVFP4 codes index (ggml's `kvalues_mxfp4`): the E2M1 values doubled,
/// so that they are integers; the scales are halved to match.
pub(crate) const FP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `ggml_e8m0_to_fp32_half`: half the E8M0 scale `2^(e − 127)`, built from its bits (the
/// two smallest are subnormal; 255, E8M0's NaN, is not special-cased, as in ggml).
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        (e as u32 - 1) << 23
    })
}

/// ggml's `ggml_ue4m3_to_fp32`: half the unsigned E4M3 scale `x` (bias 7; bit 7 is ignored).
/// 0x7F, E4M3's NaN, decodes to zero as ggml decodes it. Built from its bits: ggml's `ldexpf`
/// arithmetic is exact, so the bits are the same.
#[inline(always)]
pub(crate) fn ue4m3_half(x: u8) -> f32 {
    if x == 0x7F {
        return 0.0;
    }
    let (exp, man) = ((x >> 3) as u32 & 0xF, x as u32 & 7);
    match exp {
        // man · 2^-9 · 0.5 (zero for 0x00 and 0x80), exact.
        0 => man as f32 * (1.0 / 1024.0),
        // (1 + man/8) · 2^(exp − 7) · 0.5: biased exponent exp − 8 + 127.
        _ => f32::from_bits(((exp + 119) << 23) | (man << 20)),
    }
}

/// MXFP4: blocks of 32, one E8M0 scale (`e qs[16]`); low nibbles the first 16 values, high
/// nibbles the next 16.
fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = FP4_VALUES[(qs[j] & 0xf) as usize] as f32 * d;
        y[j + 16] = FP4_VALUES[(qs[j] >> 4) as usize] as f32 * d;
    }
}

/// NVFP4: blocks of 64 in four sub-blocks of 16, each with an unsigned E4M3 scale
/// (`d[4] qs[32]`); sub-block s's bytes are `qs[8s..8s + 8]`, low nibbles its first 8 values,
/// high nibbles its last 8.
fn nvfp4(b: &[u8], y: &mut [f32]) {
    let qs = &b[4..36];
    for s in 0..4 {
        let d = ue4m3_half(b[s]);
        let (q, y) = (&qs[8 * s..8 * s + 8], &mut y[16 * s..16 * s + 16]);
        for j in 0..8 {
            y[j] = FP4_VALUES[(q[j] & 0xf) as usize] as f32 * d;
            y[j + 8] = FP4_VALUES[(q[j] >> 4) as usize] as f32 * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
