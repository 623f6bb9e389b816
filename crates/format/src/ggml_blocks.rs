//! The integer codes of the simple 32-element ggml block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), for
//! lossless re-coding of GGUF tensors: [`unpack_codes`] splits blocks into one code per weight plus
//! per-block f16 scales, and [`pack_codes`] rebuilds the exact original bytes.
//!
//! Codes are in weight order (element j of block b is `codes[32·b + j]`): Q4_0/Q4_1 0..=15,
//! Q5_0/Q5_1 0..=31 (the high bit from `qh`), Q8_0 the i8 value's bit pattern as u8. The weight is
//! `d·(code − offset) (+ m)` with the code read as two's complement for Q8_0
//! ([`crate::qtype::IntCodes`]).

use crate::qtype::{GgmlType, Store};

/// Weights per block.
pub const QK: usize = 32;

/// Whether this module handles `ty` (the types the container stores as [`Store::Codes`]).
pub fn handles(ty: GgmlType) -> bool {
    ty.row().store == Store::Codes
}

/// Whether blocks of `ty` carry an offset `m` besides the scale `d` (the `_1` types).
pub fn has_m(ty: GgmlType) -> bool {
    ty.int_codes().is_some_and(|i| i.mins)
}

/// The codes and scales of a tensor of blocks of one type [`handles`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantCodes {
    pub block: GgmlType,
    /// One code per weight, in weight order.
    pub codes: Vec<u8>,
    /// Per-block scale `d`, as f16 bits.
    pub d: Vec<u16>,
    /// Per-block offset `m` (f16 bits) of the `_1` types; `None` for the others.
    pub m: Option<Vec<u16>>,
}

/// Splits `bytes` (whole blocks of `block`) into codes and scales. Errors say what is wrong with
/// the bytes; callers add the tensor's name.
pub fn unpack_codes(block: GgmlType, bytes: &[u8]) -> Result<QuantCodes, String> {
    if !handles(block) {
        return Err(format!("{block} blocks are not of a 32-weight code type"));
    }
    let bb = block.type_size();
    if !bytes.len().is_multiple_of(bb) {
        return Err(format!(
            "{} bytes are not whole {} blocks of {bb} bytes",
            bytes.len(),
            block.name()
        ));
    }
    let n_blocks = bytes.len() / bb;
    let mut codes = Vec::with_capacity(n_blocks * QK);
    let mut d = Vec::with_capacity(n_blocks);
    let mut m = has_m(block).then(|| Vec::with_capacity(n_blocks));
    for b in bytes.chunks_exact(bb) {
        d.push(u16::from_le_bytes([b[0], b[1]]));
        let mut at = 2;
        if let Some(m) = &mut m {
            m.push(u16::from_le_bytes([b[2], b[3]]));
            at = 4;
        }
        match block.code_bits() {
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
    Ok(QuantCodes { block, codes, d, m })
}

/// Re-packs codes and scales into block bytes; the exact inverse of [`unpack_codes`].
pub fn pack_codes(q: &QuantCodes) -> Result<Vec<u8>, String> {
    let block = q.block;
    if !handles(block) {
        return Err(format!("{block} blocks are not of a 32-weight code type"));
    }
    let n_blocks = q.d.len();
    if q.codes.len() != n_blocks * QK {
        return Err(format!(
            "{} codes for {n_blocks} {} blocks; expected {}",
            q.codes.len(),
            block.name(),
            n_blocks * QK
        ));
    }
    match (&q.m, has_m(block)) {
        (Some(m), true) if m.len() == n_blocks => {}
        (None, false) => {}
        (m, has_m) => {
            return Err(format!(
                "{} needs {} per-block m values, got {}",
                block.name(),
                if has_m { n_blocks } else { 0 },
                m.as_ref()
                    .map_or_else(|| "none".to_string(), |m| m.len().to_string())
            ))
        }
    }
    let bits = block.code_bits();
    let max_code = if bits == 8 {
        u8::MAX
    } else {
        (1u8 << bits) - 1
    };
    if let Some(i) = q.codes.iter().position(|&c| c > max_code) {
        return Err(format!(
            "code {i} is {}, above the {bits}-bit maximum {max_code} of {}",
            q.codes[i],
            block.name()
        ));
    }
    let mut out = Vec::with_capacity(n_blocks * block.type_size());
    for (b, codes) in q.codes.chunks_exact(QK).enumerate() {
        out.extend_from_slice(&q.d[b].to_le_bytes());
        if let Some(m) = &q.m {
            out.extend_from_slice(&m[b].to_le_bytes());
        }
        match bits {
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
    use super::*;

    /// The types this module handles, in id order.
    fn legacy() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.into_iter().filter(|&t| handles(t))
    }

    /// Deterministic pseudo-random bytes.
    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut r = entrollm_codec::rng::SplitMix64::new(seed);
        (0..n).map(|_| (r.next_u64() >> 56) as u8).collect()
    }

    #[test]
    fn block_sizes_are_ggmls() {
        let sizes: Vec<usize> = legacy().map(|b| b.type_size()).collect();
        assert_eq!(sizes, [18, 20, 22, 24, 34]);
        assert_eq!(GgmlType::Q4_1.bits_per_weight(), 5.0);
    }

    #[test]
    fn pack_inverts_unpack_on_random_blocks_of_every_type() {
        for (k, block) in legacy().enumerate() {
            for seed in 0..20u64 {
                let n_blocks = 1 + (seed as usize * 7) % 13;
                let bytes = random_bytes(seed + 1000 * k as u64, n_blocks * block.type_size());
                let q = unpack_codes(block, &bytes).unwrap();
                assert_eq!(q.codes.len(), n_blocks * 32);
                assert_eq!(q.d.len(), n_blocks);
                assert_eq!(q.m.as_ref().map(Vec::len), has_m(block).then_some(n_blocks));
                let max = (1u32 << block.code_bits()) - 1;
                assert!(q.codes.iter().all(|&c| u32::from(c) <= max), "{block:?}");
                assert_eq!(pack_codes(&q).unwrap(), bytes, "{block:?} seed {seed}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(unpack_codes(GgmlType::Q4_0, &[0; 19]).is_err());
        let mut q = unpack_codes(GgmlType::Q4_0, &[0; 18]).unwrap();
        q.codes[3] = 16;
        assert!(pack_codes(&q).unwrap_err().contains("code 3"));
        q.codes[3] = 0;
        q.m = Some(vec![0]);
        assert!(pack_codes(&q).is_err());
        q.m = None;
        q.codes.pop();
        assert!(pack_codes(&q).is_err());
        let mut q = unpack_codes(GgmlType::Q5_1, &[0; 24]).unwrap();
        q.m = None;
        assert!(pack_codes(&q).is_err());
        assert!(unpack_codes(GgmlType::Q4_K, &[0; 144]).is_err());
    }
}
