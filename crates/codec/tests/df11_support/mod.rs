//! Test inputs for the DFloat11 tests and benchmark: the integer-only generators that
//! tools/df11_golden.py also implements, and BF16 weight distributions.
#![allow(dead_code)] // each test target uses a different subset

// The codec's SplitMix64, which tools/df11_golden.py implements too (its `next_u64` stream).
use entrollm_codec::rng::SplitMix64;

/// Sign and mantissa bits of a BF16 taken from a random word (golden generator convention).
fn sign_mantissa_bits(r: u64) -> u16 {
    (((r >> 63) << 15) | ((r >> 48) & 0x7F)) as u16
}

/// Golden generator "geometric": exponent `base - trailing_zeros(r | 1 << cap)`.
pub fn geometric(seed: u64, n: usize, base: u32, cap: u32) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let r = rng.next_u64();
            let e = base - (r | (1u64 << cap)).trailing_zeros();
            sign_mantissa_bits(r) | (e << 7) as u16
        })
        .collect()
}

/// Golden generator "histogram": exponents repeated by count, Fisher-Yates shuffled, `tail`
/// appended, then sign and mantissa from the generator.
pub fn from_histogram(seed: u64, counts: &[(u8, usize)], tail: &[u8]) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed);
    let mut exps: Vec<u8> = counts
        .iter()
        .flat_map(|&(e, c)| std::iter::repeat_n(e, c))
        .collect();
    for i in (1..exps.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        exps.swap(i, j);
    }
    exps.extend_from_slice(tail);
    exps.iter()
        .map(|&e| sign_mantissa_bits(rng.next_u64()) | ((e as u16) << 7))
        .collect()
}

/// BF16 bits of `n` draws of N(0, sigma^2).
pub fn normal_bf16(seed: u64, n: usize, sigma: f64) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| half::bf16::from_f64(rng.normal() * sigma).to_bits())
        .collect()
}

/// BF16 bits of a heavy-tailed distribution: a normal divided by a uniform (slash distribution).
pub fn heavy_tailed_bf16(seed: u64, n: usize, scale: f64) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| half::bf16::from_f64(rng.normal() * scale / (1.0 - rng.unit())).to_bits())
        .collect()
}

/// Standard base64 (with padding) decoding, for the golden file.
pub fn base64_decode(s: &str) -> Vec<u8> {
    fn value(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a') as u32 + 26,
            b'0'..=b'9' => (c - b'0') as u32 + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for quad in s.as_bytes().chunks(4) {
        let digits: Vec<u8> = quad.iter().copied().filter(|&c| c != b'=').collect();
        let mut acc = 0u32;
        for &c in &digits {
            acc = (acc << 6) | value(c);
        }
        acc <<= 6 * (4 - digits.len()) as u32;
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..digits.len()]);
    }
    out
}
