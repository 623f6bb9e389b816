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

use crate::qtype::GgmlType;

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

pub(crate) const fn field(name: &'static str, per_block: usize, kind: FieldKind) -> Field {
    Field {
        name,
        per_block,
        kind,
    }
}

/// A tensor's blocks split: codes in weight order, and each field's values (blocks in order, a
/// block's values together), as `u16`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub ty: GgmlType,
    pub codes: Vec<u8>,
    pub fields: Vec<Vec<u16>>,
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
fn split_block(ty: GgmlType, b: &[u8], w: &mut [u8], f: &mut [u16]) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let m = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            f[0] = half_at(b, 0);
            let mut at = 2;
            if m {
                f[1] = half_at(b, 2);
                at = 4;
            }
            if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                let qh = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
                nibbles_split(&b[at + 4..at + 20], w);
                for (j, w) in w.iter_mut().enumerate() {
                    *w |= (((qh >> j) & 1) as u8) << 4;
                }
            } else {
                nibbles_split(&b[at..at + 16], w);
            }
        }
        GgmlType::Q8_0 => {
            f[0] = half_at(b, 0);
            w.copy_from_slice(&b[2..34]);
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            f[0] = half_at(b, 0);
            f[1] = half_at(b, 2);
            let (sc, mn) = f[2..18].split_at_mut(8);
            k4_unpack(&b[4..16], sc, mn);
            let (qh, qs) = match ty {
                GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
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
        GgmlType::Q6_K => {
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
        GgmlType::Q2_K => {
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
        GgmlType::Q3_K => {
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
        GgmlType::IQ4_NL => {
            f[0] = half_at(b, 0);
            nibbles_split(&b[2..18], w);
        }
        GgmlType::IQ4_XS => {
            f[0] = half_at(b, 0);
            let sh = half_at(b, 2);
            for ib in 0..8 {
                let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
                f[1 + ib] = u16::from(lo) | (((sh >> (2 * ib)) & 3) << 4);
                nibbles_split(&b[8 + 16 * ib..24 + 16 * ib], &mut w[32 * ib..32 * ib + 32]);
            }
        }
        GgmlType::MXFP4 => {
            f[0] = u16::from(b[0]);
            nibbles_split(&b[1..17], w);
        }
        GgmlType::NVFP4 => {
            for s in 0..4 {
                f[s] = u16::from(b[s]);
                nibbles_split(&b[4 + 8 * s..12 + 8 * s], &mut w[16 * s..16 * s + 16]);
            }
        }
        _ => unreachable!("split and join take types that split"),
    }
}

/// The inverse of [`split_block`]: codes `w` and fields `f` to the block's bytes `b`.
fn join_block(ty: GgmlType, w: &[u8], f: &[u16], b: &mut [u8]) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let m = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            put_half(b, 0, f[0]);
            let mut at = 2;
            if m {
                put_half(b, 2, f[1]);
                at = 4;
            }
            if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
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
        GgmlType::Q8_0 => {
            put_half(b, 0, f[0]);
            b[2..34].copy_from_slice(w);
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            put_half(b, 0, f[0]);
            put_half(b, 2, f[1]);
            k4_pack(&f[2..10], &f[10..18], &mut b[4..16]);
            let q5 = ty == GgmlType::Q5_K;
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
        GgmlType::Q6_K => {
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
        GgmlType::Q2_K => {
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
        GgmlType::Q3_K => {
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
        GgmlType::IQ4_NL => {
            put_half(b, 0, f[0]);
            nibbles_join(w, &mut b[2..18]);
        }
        GgmlType::IQ4_XS => {
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
        GgmlType::MXFP4 => {
            b[0] = f[0] as u8;
            nibbles_join(w, &mut b[1..17]);
        }
        GgmlType::NVFP4 => {
            for s in 0..4 {
                b[s] = f[s] as u8;
                nibbles_join(&w[16 * s..16 * s + 16], &mut b[4 + 8 * s..12 + 8 * s]);
            }
        }
        _ => unreachable!("split and join take types that split"),
    }
}

/// Values of all of a block's fields together.
fn field_values(ty: GgmlType) -> usize {
    ty.fields().iter().map(|f| f.per_block).sum()
}

/// Splits `bytes` (whole blocks of `ty`) into codes and fields. Errors say what is wrong with the
/// bytes; callers add the tensor's name.
pub fn split(ty: GgmlType, bytes: &[u8]) -> Result<Split, String> {
    if !ty.splits() {
        return Err(format!("{ty} blocks do not split into codes and fields"));
    }
    let (bb, bw, nf) = (ty.type_size(), ty.block_size(), field_values(ty));
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
    if !ty.splits() {
        return Err(format!("{ty} blocks do not split into codes and fields"));
    }
    let (bb, bw, nf) = (ty.type_size(), ty.block_size(), field_values(ty));
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
    fn join_inverts_split_on_random_blocks_of_every_type() {
        for (k, ty) in GgmlType::ALL.into_iter().filter(|t| t.splits()).enumerate() {
            for seed in 0..16u64 {
                let n = 1 + (seed as usize * 5) % 11;
                let bytes = random_bytes(seed + 100 * k as u64, n * ty.type_size());
                let s = split(ty, &bytes).unwrap();
                assert_eq!(s.codes.len(), n * ty.block_size());
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
        assert!(split(GgmlType::Q4_K, &[0; 143]).is_err());
        let mut s = split(GgmlType::Q4_K, &[0; 144]).unwrap();
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
        assert!(split(GgmlType::Q8_K, &[0; 292]).is_err());
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
