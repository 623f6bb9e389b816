//! ggml's dequantisation of one block of each type to f32, exactly as `ggml-quants.c` computes it
//! (formats.md §1.4): the same operations in the same order, so results match ggml's reference
//! bit for bit. The scalar reference every CPU and GPU kernel is tested against; the quant-type
//! table ([`super::TYPES`]) names each type's function.

use half::bf16;

/// Dequantises one block (its bytes) into its elements.
pub type BlockFn = fn(&[u8], &mut [f32]);

pub(super) fn f32_le(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

pub(super) fn f16_le(b: &[u8], y: &mut [f32]) {
    y[0] = f16_at(b, 0);
}

pub(super) fn bf16_le(b: &[u8], y: &mut [f32]) {
    y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
}

/// The little-endian IEEE half at `b[at..]` as f32, exactly as the `half` crate converts it,
/// inlined into the product kernels (a call into `half` per block cost 6 % of a 7B's step).
#[inline(always)]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
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

pub(super) fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = (q as i8) as f32 * d;
    }
}

pub(super) fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

pub(super) fn q4_1(b: &[u8], y: &mut [f32]) {
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

pub(super) fn q5_0(b: &[u8], y: &mut [f32]) {
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

pub(super) fn q5_1(b: &[u8], y: &mut [f32]) {
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
#[inline(always)]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

pub(super) fn q4_k(b: &[u8], y: &mut [f32]) {
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

pub(super) fn q5_k(b: &[u8], y: &mut [f32]) {
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

pub(super) fn q6_k(b: &[u8], y: &mut [f32]) {
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
pub(super) fn q2_k(b: &[u8], y: &mut [f32]) {
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
pub fn q3k_scales(packed: &[u8]) -> [u8; 16] {
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
pub(super) fn q3_k(b: &[u8], y: &mut [f32]) {
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
pub const IQ4NL_VALUES: [i8; 16] = [
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
pub(super) fn iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_32(&b[2..18], f16_at(b, 0), y);
}

/// IQ4_XS: 8 sub-blocks of 32, each with a 6-bit scale (offset 32): its low 4 bits in
/// `scales_l`, its high 2 in `scales_h` (`d scales_h:u16 scales_l[4] qs[128]`).
pub(super) fn iq4_xs(b: &[u8], y: &mut [f32]) {
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
pub const FP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `ggml_e8m0_to_fp32_half`: half the E8M0 scale `2^(e − 127)`, built from its bits (the
/// two smallest are subnormal; 255, E8M0's NaN, is not special-cased, as in ggml).
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
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
pub fn ue4m3_half(x: u8) -> f32 {
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
pub(super) fn mxfp4(b: &[u8], y: &mut [f32]) {
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
pub(super) fn nvfp4(b: &[u8], y: &mut [f32]) {
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
