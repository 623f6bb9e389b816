//! The integer codes and side fields of the code-bearing ggml block types: the legacy five (Q4_0 …
//! Q8_0), the k-quants (Q2_K … Q6_K), IQ4_NL / IQ4_XS and MXFP4 / NVFP4, for lossless re-coding
//! of GGUF tensors.
//! [`split`] turns whole blocks into one code per weight (weight order) and the blocks' other
//! fields as separate streams (each block's f16 scales, its packed 4/6/8-bit sub-block scales
//! unpacked to one value each); [`join`] rebuilds the exact original bytes. Every bit of a block is
//! in exactly one code or field value, so the two are inverse on any bytes.
//!
//! Codes: the legacy types as [`crate::ggml_blocks`] gives them (Q8_0 the i8's bit pattern),
//! Q2_K 0..=3, Q3_K 0..=7 (`low | high << 2`, the weight `dl·(code − 4)`), Q4_K 0..=15,
//! Q5_K 0..=31, Q6_K 0..=63 (the weight `d·sc·(code − 32)`), IQ4_NL / IQ4_XS the 4-bit index into
//! ggml's non-linear table, MXFP4 / NVFP4 the E2M1 nibble.

use serde::{Deserialize, Serialize};

/// A code-bearing ggml block type split by this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KType {
    #[serde(rename = "Q4_0")]
    Q4_0,
    #[serde(rename = "Q4_1")]
    Q4_1,
    #[serde(rename = "Q5_0")]
    Q5_0,
    #[serde(rename = "Q5_1")]
    Q5_1,
    #[serde(rename = "Q8_0")]
    Q8_0,
    #[serde(rename = "Q2_K")]
    Q2K,
    #[serde(rename = "Q3_K")]
    Q3K,
    #[serde(rename = "Q4_K")]
    Q4K,
    #[serde(rename = "Q5_K")]
    Q5K,
    #[serde(rename = "Q6_K")]
    Q6K,
    #[serde(rename = "IQ4_NL")]
    Iq4Nl,
    #[serde(rename = "IQ4_XS")]
    Iq4Xs,
    #[serde(rename = "MXFP4")]
    Mxfp4,
    #[serde(rename = "NVFP4")]
    Nvfp4,
}

/// What one field's values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// An f16 (its bits).
    Half,
    /// An unsigned integer of this many bits (1..=8).
    Bits(u8),
}

/// One of a block's side fields: `per_block` values of `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub per_block: usize,
    pub kind: FieldKind,
}

const fn field(name: &'static str, per_block: usize, kind: FieldKind) -> Field {
    Field {
        name,
        per_block,
        kind,
    }
}

const D: Field = field("d", 1, FieldKind::Half);
const DMIN: Field = field("dmin", 1, FieldKind::Half);

/// A tensor's blocks split: codes in weight order, and each field's values (blocks in order, a
/// block's values together), as `u16`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub ty: KType,
    pub codes: Vec<u8>,
    pub fields: Vec<Vec<u16>>,
}

impl KType {
    pub const ALL: [KType; 14] = [
        KType::Q4_0,
        KType::Q4_1,
        KType::Q5_0,
        KType::Q5_1,
        KType::Q8_0,
        KType::Q2K,
        KType::Q3K,
        KType::Q4K,
        KType::Q5K,
        KType::Q6K,
        KType::Iq4Nl,
        KType::Iq4Xs,
        KType::Mxfp4,
        KType::Nvfp4,
    ];

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            KType::Q4_0 => "Q4_0",
            KType::Q4_1 => "Q4_1",
            KType::Q5_0 => "Q5_0",
            KType::Q5_1 => "Q5_1",
            KType::Q8_0 => "Q8_0",
            KType::Q2K => "Q2_K",
            KType::Q3K => "Q3_K",
            KType::Q4K => "Q4_K",
            KType::Q5K => "Q5_K",
            KType::Q6K => "Q6_K",
            KType::Iq4Nl => "IQ4_NL",
            KType::Iq4Xs => "IQ4_XS",
            KType::Mxfp4 => "MXFP4",
            KType::Nvfp4 => "NVFP4",
        }
    }

    /// The type named `name` (ggml's spelling).
    pub fn from_name(name: &str) -> Option<KType> {
        KType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Weights per block.
    pub fn block_weights(self) -> usize {
        match self {
            KType::Q4_0 | KType::Q4_1 | KType::Q5_0 | KType::Q5_1 | KType::Q8_0 => 32,
            KType::Iq4Nl | KType::Mxfp4 => 32,
            KType::Nvfp4 => 64,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            KType::Q4_0 => 18,
            KType::Q4_1 => 20,
            KType::Q5_0 => 22,
            KType::Q5_1 => 24,
            KType::Q8_0 => 34,
            KType::Q2K => 84,
            KType::Q3K => 110,
            KType::Q4K => 144,
            KType::Q5K => 176,
            KType::Q6K => 210,
            KType::Iq4Nl => 18,
            KType::Iq4Xs => 136,
            KType::Mxfp4 => 17,
            KType::Nvfp4 => 36,
        }
    }

    /// Bits per code.
    pub fn code_bits(self) -> u32 {
        match self {
            KType::Q2K => 2,
            KType::Q3K => 3,
            KType::Q5K | KType::Q5_0 | KType::Q5_1 => 5,
            KType::Q6K => 6,
            KType::Q8_0 => 8,
            _ => 4,
        }
    }

    /// The block's fields besides its codes, in the order [`Split::fields`] holds them.
    pub fn fields(self) -> &'static [Field] {
        use FieldKind::*;
        const Q2K: [Field; 4] = [D, DMIN, field("sc", 16, Bits(4)), field("mn", 16, Bits(4))];
        const Q3K: [Field; 2] = [D, field("sc", 16, Bits(6))];
        const Q4K: [Field; 4] = [D, DMIN, field("sc", 8, Bits(6)), field("mn", 8, Bits(6))];
        const Q6K: [Field; 2] = [D, field("sc", 16, Bits(8))];
        const IQ4NL: [Field; 1] = [D];
        const DM: [Field; 2] = [D, field("m", 1, Half)];
        const IQ4XS: [Field; 2] = [D, field("sc", 8, Bits(6))];
        const MXFP4: [Field; 1] = [field("e", 1, Bits(8))];
        const NVFP4: [Field; 1] = [field("d", 4, Bits(8))];
        match self {
            KType::Q4_0 | KType::Q5_0 | KType::Q8_0 => &IQ4NL,
            KType::Q4_1 | KType::Q5_1 => &DM,
            KType::Q2K => &Q2K,
            KType::Q3K => &Q3K,
            KType::Q4K | KType::Q5K => &Q4K,
            KType::Q6K => &Q6K,
            KType::Iq4Nl => &IQ4NL,
            KType::Iq4Xs => &IQ4XS,
            KType::Mxfp4 => &MXFP4,
            KType::Nvfp4 => &NVFP4,
        }
    }

    /// Storage bits per weight of the type.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_weights() as f64
    }
}

fn half_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn put_half(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// 32 weights as two nibbles a byte: low nibbles the first 16, high the next 16.
fn nibbles_split(qs: &[u8], w: &mut [u8]) {
    let n = qs.len();
    for j in 0..n {
        w[j] = qs[j] & 15;
        w[j + n] = qs[j] >> 4;
    }
}

fn nibbles_join(w: &[u8], qs: &mut [u8]) {
    let n = qs.len();
    for j in 0..n {
        qs[j] = (w[j] & 15) | (w[j + n] << 4);
    }
}

/// Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's `get_scale_min_k4`).
fn k4_unpack(s: &[u8], sc: &mut [u16], mn: &mut [u16]) {
    for j in 0..4 {
        sc[j] = u16::from(s[j] & 63);
        mn[j] = u16::from(s[j + 4] & 63);
        sc[j + 4] = u16::from((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = u16::from((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

fn k4_pack(sc: &[u16], mn: &[u16], s: &mut [u8]) {
    let (sc, mn) = (|j: usize| sc[j] as u8, |j: usize| mn[j] as u8);
    for j in 0..4 {
        s[j] = (sc(j) & 63) | ((sc(j + 4) >> 4) << 6);
        s[j + 4] = (mn(j) & 63) | ((mn(j + 4) >> 4) << 6);
        s[j + 8] = (sc(j + 4) & 15) | ((mn(j + 4) & 15) << 4);
    }
}

/// Q3_K's 12 bytes of sixteen 6-bit scales (ggml's `kmask1`/`kmask2` unpacking).
fn q3_unpack(p: &[u8], s: &mut [u16]) {
    for i in 0..4 {
        let hi = |k: u32| (p[8 + i] >> (2 * k)) & 3;
        s[i] = u16::from((p[i] & 15) | (hi(0) << 4));
        s[4 + i] = u16::from((p[4 + i] & 15) | (hi(1) << 4));
        s[8 + i] = u16::from((p[i] >> 4) | (hi(2) << 4));
        s[12 + i] = u16::from((p[4 + i] >> 4) | (hi(3) << 4));
    }
}

fn q3_pack(s: &[u16], p: &mut [u8]) {
    let s = |j: usize| s[j] as u8;
    for i in 0..4 {
        p[i] = (s(i) & 15) | ((s(8 + i) & 15) << 4);
        p[4 + i] = (s(4 + i) & 15) | ((s(12 + i) & 15) << 4);
        p[8 + i] =
            (s(i) >> 4) | ((s(4 + i) >> 4) << 2) | ((s(8 + i) >> 4) << 4) | ((s(12 + i) >> 4) << 6);
    }
}

/// One block's bytes `b` to its codes `w` and field values `f` (fields concatenated in order).
fn split_block(ty: KType, b: &[u8], w: &mut [u8], f: &mut [u16]) {
    match ty {
        KType::Q4_0 | KType::Q4_1 | KType::Q5_0 | KType::Q5_1 => {
            let m = matches!(ty, KType::Q4_1 | KType::Q5_1);
            f[0] = half_at(b, 0);
            let mut at = 2;
            if m {
                f[1] = half_at(b, 2);
                at = 4;
            }
            if matches!(ty, KType::Q5_0 | KType::Q5_1) {
                let qh = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
                nibbles_split(&b[at + 4..at + 20], w);
                for (j, w) in w.iter_mut().enumerate() {
                    *w |= (((qh >> j) & 1) as u8) << 4;
                }
            } else {
                nibbles_split(&b[at..at + 16], w);
            }
        }
        KType::Q8_0 => {
            f[0] = half_at(b, 0);
            w.copy_from_slice(&b[2..34]);
        }
        KType::Q4K | KType::Q5K => {
            f[0] = half_at(b, 0);
            f[1] = half_at(b, 2);
            let (sc, mn) = f[2..18].split_at_mut(8);
            k4_unpack(&b[4..16], sc, mn);
            let (qh, qs) = match ty {
                KType::Q5K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for c in 0..4 {
                nibbles_split(&qs[32 * c..32 * c + 32], &mut w[64 * c..64 * c + 64]);
                if let Some(qh) = qh {
                    for l in 0..32 {
                        w[64 * c + l] |= ((qh[l] >> (2 * c)) & 1) << 4;
                        w[64 * c + 32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                }
            }
        }
        KType::Q6K => {
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..160 + 32 * n];
                let w = &mut w[128 * n..128 * n + 128];
                for l in 0..32 {
                    w[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
                    w[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                    w[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    w[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            f[0] = half_at(b, 208);
            for (v, &s) in f[1..17].iter_mut().zip(&b[192..208]) {
                *v = u16::from(s);
            }
        }
        KType::Q2K => {
            f[0] = half_at(b, 80);
            f[1] = half_at(b, 82);
            for i in 0..16 {
                f[2 + i] = u16::from(b[i] & 15);
                f[18 + i] = u16::from(b[i] >> 4);
            }
            let qs = &b[16..80];
            for (o, w) in w.iter_mut().enumerate() {
                let (h, j, p, l) = (o / 128, (o / 32) % 4, (o / 16) % 2, o % 16);
                *w = (qs[32 * h + 16 * p + l] >> (2 * j)) & 3;
            }
        }
        KType::Q3K => {
            let (hm, qs) = (&b[..32], &b[32..96]);
            f[0] = half_at(b, 108);
            q3_unpack(&b[96..108], &mut f[1..17]);
            for (o, w) in w.iter_mut().enumerate() {
                let (h, j, p, l) = (o / 128, (o / 32) % 4, (o / 16) % 2, o % 16);
                let k = 16 * p + l;
                let low = (qs[32 * h + k] >> (2 * j)) & 3;
                let high = (hm[k] >> (4 * h + j)) & 1;
                *w = low | (high << 2);
            }
        }
        KType::Iq4Nl => {
            f[0] = half_at(b, 0);
            nibbles_split(&b[2..18], w);
        }
        KType::Iq4Xs => {
            f[0] = half_at(b, 0);
            let sh = half_at(b, 2);
            for ib in 0..8 {
                let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
                f[1 + ib] = u16::from(lo) | (((sh >> (2 * ib)) & 3) << 4);
                nibbles_split(&b[8 + 16 * ib..24 + 16 * ib], &mut w[32 * ib..32 * ib + 32]);
            }
        }
        KType::Mxfp4 => {
            f[0] = u16::from(b[0]);
            nibbles_split(&b[1..17], w);
        }
        KType::Nvfp4 => {
            for s in 0..4 {
                f[s] = u16::from(b[s]);
                nibbles_split(&b[4 + 8 * s..12 + 8 * s], &mut w[16 * s..16 * s + 16]);
            }
        }
    }
}

/// The inverse of [`split_block`]: codes `w` and fields `f` to the block's bytes `b`.
fn join_block(ty: KType, w: &[u8], f: &[u16], b: &mut [u8]) {
    match ty {
        KType::Q4_0 | KType::Q4_1 | KType::Q5_0 | KType::Q5_1 => {
            let m = matches!(ty, KType::Q4_1 | KType::Q5_1);
            put_half(b, 0, f[0]);
            let mut at = 2;
            if m {
                put_half(b, 2, f[1]);
                at = 4;
            }
            if matches!(ty, KType::Q5_0 | KType::Q5_1) {
                let qh = w
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (j, &c)| acc | (u32::from(c >> 4) << j));
                b[at..at + 4].copy_from_slice(&qh.to_le_bytes());
                nibbles_join(w, &mut b[at + 4..at + 20]);
            } else {
                nibbles_join(w, &mut b[at..at + 16]);
            }
        }
        KType::Q8_0 => {
            put_half(b, 0, f[0]);
            b[2..34].copy_from_slice(w);
        }
        KType::Q4K | KType::Q5K => {
            put_half(b, 0, f[0]);
            put_half(b, 2, f[1]);
            k4_pack(&f[2..10], &f[10..18], &mut b[4..16]);
            let q5 = ty == KType::Q5K;
            let (head, qs) = b.split_at_mut(if q5 { 48 } else { 16 });
            for c in 0..4 {
                nibbles_join(&w[64 * c..64 * c + 64], &mut qs[32 * c..32 * c + 32]);
            }
            if q5 {
                let qh = &mut head[16..48];
                for (l, h) in qh.iter_mut().enumerate() {
                    *h = (0..4).fold(0, |acc, c| {
                        acc | ((w[64 * c + l] >> 4) << (2 * c))
                            | ((w[64 * c + 32 + l] >> 4) << (2 * c + 1))
                    });
                }
            }
        }
        KType::Q6K => {
            for n in 0..2 {
                let w = &w[128 * n..128 * n + 128];
                for l in 0..32 {
                    b[64 * n + l] = (w[l] & 15) | ((w[l + 64] & 15) << 4);
                    b[64 * n + l + 32] = (w[l + 32] & 15) | ((w[l + 96] & 15) << 4);
                    b[128 + 32 * n + l] = (w[l] >> 4)
                        | ((w[l + 32] >> 4) << 2)
                        | ((w[l + 64] >> 4) << 4)
                        | ((w[l + 96] >> 4) << 6);
                }
            }
            for (s, &v) in b[192..208].iter_mut().zip(&f[1..17]) {
                *s = v as u8;
            }
            put_half(b, 208, f[0]);
        }
        KType::Q2K => {
            for i in 0..16 {
                b[i] = (f[2 + i] as u8 & 15) | ((f[18 + i] as u8) << 4);
            }
            let qs = &mut b[16..80];
            qs.fill(0);
            for (o, &w) in w.iter().enumerate() {
                let (h, j, p, l) = (o / 128, (o / 32) % 4, (o / 16) % 2, o % 16);
                qs[32 * h + 16 * p + l] |= (w & 3) << (2 * j);
            }
            put_half(b, 80, f[0]);
            put_half(b, 82, f[1]);
        }
        KType::Q3K => {
            b[..96].fill(0);
            let (hm, qs) = b[..96].split_at_mut(32);
            for (o, &w) in w.iter().enumerate() {
                let (h, j, p, l) = (o / 128, (o / 32) % 4, (o / 16) % 2, o % 16);
                let k = 16 * p + l;
                qs[32 * h + k] |= (w & 3) << (2 * j);
                hm[k] |= ((w >> 2) & 1) << (4 * h + j);
            }
            q3_pack(&f[1..17], &mut b[96..108]);
            put_half(b, 108, f[0]);
        }
        KType::Iq4Nl => {
            put_half(b, 0, f[0]);
            nibbles_join(w, &mut b[2..18]);
        }
        KType::Iq4Xs => {
            put_half(b, 0, f[0]);
            let sh = (0..8).fold(0u16, |acc, ib| acc | ((f[1 + ib] >> 4) & 3) << (2 * ib));
            put_half(b, 2, sh);
            for i in 0..4 {
                b[4 + i] = (f[1 + 2 * i] as u8 & 15) | ((f[2 + 2 * i] as u8 & 15) << 4);
            }
            for ib in 0..8 {
                nibbles_join(&w[32 * ib..32 * ib + 32], &mut b[8 + 16 * ib..24 + 16 * ib]);
            }
        }
        KType::Mxfp4 => {
            b[0] = f[0] as u8;
            nibbles_join(w, &mut b[1..17]);
        }
        KType::Nvfp4 => {
            for s in 0..4 {
                b[s] = f[s] as u8;
                nibbles_join(&w[16 * s..16 * s + 16], &mut b[4 + 8 * s..12 + 8 * s]);
            }
        }
    }
}

/// Values of all of a block's fields together.
fn field_values(ty: KType) -> usize {
    ty.fields().iter().map(|f| f.per_block).sum()
}

/// Splits `bytes` (whole blocks of `ty`) into codes and fields. Errors say what is wrong with the
/// bytes; callers add the tensor's name.
pub fn split(ty: KType, bytes: &[u8]) -> Result<Split, String> {
    let (bb, bw, nf) = (ty.block_bytes(), ty.block_weights(), field_values(ty));
    if !bytes.len().is_multiple_of(bb) {
        return Err(format!(
            "{} bytes are not whole {} blocks of {bb} bytes",
            bytes.len(),
            ty.name()
        ));
    }
    let n = bytes.len() / bb;
    let mut codes = vec![0u8; n * bw];
    let mut all = vec![0u16; n * nf];
    for ((b, w), f) in bytes
        .chunks_exact(bb)
        .zip(codes.chunks_exact_mut(bw))
        .zip(all.chunks_exact_mut(nf))
    {
        split_block(ty, b, w, f);
    }
    // Regroup the interleaved values per field.
    let mut fields: Vec<Vec<u16>> = ty
        .fields()
        .iter()
        .map(|f| Vec::with_capacity(n * f.per_block))
        .collect();
    for f in all.chunks_exact(nf) {
        let mut at = 0;
        for (out, spec) in fields.iter_mut().zip(ty.fields()) {
            out.extend_from_slice(&f[at..at + spec.per_block]);
            at += spec.per_block;
        }
    }
    Ok(Split { ty, codes, fields })
}

/// Re-packs codes and fields into block bytes; the exact inverse of [`split`]. Values out of their
/// field's or code's range are errors.
pub fn join(s: &Split) -> Result<Vec<u8>, String> {
    let ty = s.ty;
    let (bb, bw, nf) = (ty.block_bytes(), ty.block_weights(), field_values(ty));
    if !s.codes.len().is_multiple_of(bw) {
        return Err(format!(
            "{} codes are not whole {} blocks of {bw}",
            s.codes.len(),
            ty.name()
        ));
    }
    let n = s.codes.len() / bw;
    let specs = ty.fields();
    if s.fields.len() != specs.len() {
        return Err(format!(
            "{} has {} fields, not {}",
            ty.name(),
            specs.len(),
            s.fields.len()
        ));
    }
    for (v, spec) in s.fields.iter().zip(specs) {
        if v.len() != n * spec.per_block {
            return Err(format!(
                "field {} of {n} {} blocks needs {} values, got {}",
                spec.name,
                ty.name(),
                n * spec.per_block,
                v.len()
            ));
        }
        if let FieldKind::Bits(bits) = spec.kind {
            if let Some(i) = v.iter().position(|&x| x >> bits != 0) {
                return Err(format!(
                    "field {} value {i} is {}, above its {bits} bits",
                    spec.name, v[i]
                ));
            }
        }
    }
    let max = (1u32 << ty.code_bits()) - 1;
    if let Some(i) = s.codes.iter().position(|&c| u32::from(c) > max) {
        return Err(format!(
            "code {i} is {}, above the {}-bit maximum of {}",
            s.codes[i],
            ty.code_bits(),
            ty.name()
        ));
    }
    let mut out = vec![0u8; n * bb];
    let mut f = vec![0u16; nf];
    for (i, (b, w)) in out
        .chunks_exact_mut(bb)
        .zip(s.codes.chunks_exact(bw))
        .enumerate()
    {
        let mut at = 0;
        for (v, spec) in s.fields.iter().zip(specs) {
            let k = spec.per_block;
            f[at..at + k].copy_from_slice(&v[i * k..i * k + k]);
            at += k;
        }
        join_block(ty, w, &f, b);
    }
    Ok(out)
}

/// `codes` of `bits` bits packed LSB first (the codes' stored form when coding does not pay).
pub fn pack_bits(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; (codes.len() * bits as usize).div_ceil(8)];
    for (i, &c) in codes.iter().enumerate() {
        let at = i * bits as usize;
        let v = u16::from(c) << (at % 8);
        out[at / 8] |= v as u8;
        if at % 8 + bits as usize > 8 {
            out[at / 8 + 1] |= (v >> 8) as u8;
        }
    }
    out
}

/// The inverse of [`pack_bits`]: `n` codes of `bits` bits (`None` if `bytes` is not their length).
pub fn unpack_bits(bytes: &[u8], bits: u32, n: usize) -> Option<Vec<u8>> {
    if bytes.len() != (n * bits as usize).div_ceil(8) {
        return None;
    }
    let mask = (1u16 << bits) - 1;
    Some(
        (0..n)
            .map(|i| {
                let at = i * bits as usize;
                let lo = u16::from(bytes[at / 8]);
                let hi = bytes.get(at / 8 + 1).map_or(0, |&b| u16::from(b));
                (((lo | (hi << 8)) >> (at % 8)) & mask) as u8
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut r = entrollm_codec::rng::SplitMix64::new(seed);
        (0..n).map(|_| (r.next_u64() >> 56) as u8).collect()
    }

    #[test]
    fn every_bit_of_a_block_is_one_code_or_field_bit() {
        for ty in KType::ALL {
            let field_bits: usize = ty
                .fields()
                .iter()
                .map(|f| {
                    f.per_block
                        * match f.kind {
                            FieldKind::Half => 16,
                            FieldKind::Bits(b) => b as usize,
                        }
                })
                .sum();
            let code_bits = ty.block_weights() * ty.code_bits() as usize;
            assert_eq!(field_bits + code_bits, 8 * ty.block_bytes(), "{ty:?}");
            assert_eq!(KType::from_name(ty.name()), Some(ty));
        }
    }

    #[test]
    fn join_inverts_split_on_random_blocks_of_every_type() {
        for (k, ty) in KType::ALL.into_iter().enumerate() {
            for seed in 0..16u64 {
                let n = 1 + (seed as usize * 5) % 11;
                let bytes = random_bytes(seed + 100 * k as u64, n * ty.block_bytes());
                let s = split(ty, &bytes).unwrap();
                assert_eq!(s.codes.len(), n * ty.block_weights());
                let max = (1u32 << ty.code_bits()) - 1;
                assert!(s.codes.iter().all(|&c| u32::from(c) <= max), "{ty:?}");
                for (v, f) in s.fields.iter().zip(ty.fields()) {
                    assert_eq!(v.len(), n * f.per_block);
                }
                assert_eq!(join(&s).unwrap(), bytes, "{ty:?} seed {seed}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(split(KType::Q4K, &[0; 143]).is_err());
        let mut s = split(KType::Q4K, &[0; 144]).unwrap();
        s.codes[7] = 16;
        assert!(join(&s).unwrap_err().contains("code 7"));
        s.codes[7] = 0;
        s.fields[2][1] = 64;
        assert!(join(&s).unwrap_err().contains("field sc"));
        s.fields[2][1] = 0;
        s.fields[0].push(0);
        assert!(join(&s).is_err());
        s.fields.pop();
        assert!(join(&s).is_err());
    }

    #[test]
    fn bit_packing_round_trips() {
        for bits in 1..=8u32 {
            for n in [0usize, 1, 7, 8, 9, 33, 256] {
                let codes: Vec<u8> = random_bytes(u64::from(bits) * 1000 + n as u64, n)
                    .iter()
                    .map(|&c| (u16::from(c) & ((1 << bits) - 1)) as u8)
                    .collect();
                let p = pack_bits(&codes, bits);
                assert_eq!(p.len(), (n * bits as usize).div_ceil(8));
                assert_eq!(unpack_bits(&p, bits, n).unwrap(), codes, "{bits} bits, {n}");
            }
        }
        assert!(unpack_bits(&[0; 3], 4, 8).is_none());
    }
}
