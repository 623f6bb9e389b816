//! Histograms, entropy and cross-entropy: the numbers the size predictor and the tuner use.

use rayon::prelude::*;

/// Counts of each byte value, computed in parallel.
pub fn byte_histogram(codes: &[u8]) -> [u64; 256] {
    const CHUNK: usize = 1 << 20;
    codes
        .par_chunks(CHUNK)
        .map(|chunk| {
            // Four sub-histograms break the store-to-load dependency on runs of equal bytes.
            let mut h = [[0u32; 256]; 4];
            let mut quads = chunk.chunks_exact(4);
            for q in &mut quads {
                h[0][q[0] as usize] += 1;
                h[1][q[1] as usize] += 1;
                h[2][q[2] as usize] += 1;
                h[3][q[3] as usize] += 1;
            }
            for &c in quads.remainder() {
                h[0][c as usize] += 1;
            }
            let mut out = [0u64; 256];
            for sub in &h {
                for (o, &v) in out.iter_mut().zip(sub) {
                    *o += v as u64;
                }
            }
            out
        })
        .reduce(
            || [0u64; 256],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
                a
            },
        )
}

/// Shannon entropy in bits per symbol of a histogram (0 for an empty one).
pub fn entropy_bits(counts: &[u64]) -> f64 {
    let n: u64 = counts.iter().sum();
    if n == 0 {
        return 0.0;
    }
    let nf = n as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / nf;
            -p * p.log2()
        })
        .sum()
}

/// Shannon entropy in bits per value of 16-bit values taken as whole symbols (a GGUF block's f16
/// scales).
pub fn u16_entropy_bits(values: &[u16]) -> f64 {
    let mut counts = vec![0u64; 1 << 16];
    for &v in values {
        counts[v as usize] += 1;
    }
    entropy_bits(&counts)
}

/// Total bits to code a histogram with a model that gives symbol `s` probability `q[s]`
/// (cross-entropy times the count). Symbols with a count but zero probability make it infinite.
pub fn cross_entropy_total_bits(counts: &[u64], q: impl Fn(usize) -> f64) -> f64 {
    counts
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(s, &c)| -(c as f64) * q(s).log2())
        .sum()
}

/// Indices of the `t` most frequent entries (ties broken by the smaller index), most frequent first.
pub fn top_t(counts: &[u64], t: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
    idx.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    idx.truncate(t);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_16_bit_values_are_the_symbols() {
        assert_eq!(u16_entropy_bits(&[]), 0.0);
        assert_eq!(u16_entropy_bits(&[7, 7, 7]), 0.0);
        // Four values once each: 2 bits, though their high bytes are all equal.
        let e = u16_entropy_bits(&[0x3c00, 0x3c01, 0x3c02, 0x3c03]);
        assert!((e - 2.0).abs() < 1e-12, "{e}");
        // 256 values sharing a low byte: 8 bits.
        let v: Vec<u16> = (0..256u16).map(|h| h << 8 | 0x55).collect();
        assert!((u16_entropy_bits(&v) - 8.0).abs() < 1e-9);
    }

    #[test]
    fn histogram_counts_every_byte() {
        let data: Vec<u8> = (0..3_000_001u32).map(|i| (i * 7 % 251) as u8).collect();
        let h = byte_histogram(&data);
        assert_eq!(h.iter().sum::<u64>(), data.len() as u64);
        let mut naive = [0u64; 256];
        for &b in &data {
            naive[b as usize] += 1;
        }
        assert_eq!(h, naive);
    }

    #[test]
    fn entropy_of_known_distributions() {
        assert_eq!(entropy_bits(&[5]), 0.0);
        assert!((entropy_bits(&[1, 1, 1, 1]) - 2.0).abs() < 1e-12);
        assert!((entropy_bits(&[2, 1, 1]) - 1.5).abs() < 1e-12);
        assert_eq!(entropy_bits(&[]), 0.0);
    }

    #[test]
    fn cross_entropy_equals_entropy_for_the_true_model() {
        let c = [6u64, 3, 1];
        let ce = cross_entropy_total_bits(&c, |s| c[s] as f64 / 10.0);
        assert!((ce - 10.0 * entropy_bits(&c)).abs() < 1e-9);
        assert!(cross_entropy_total_bits(&c, |s| if s == 2 { 0.0 } else { 0.5 }).is_infinite());
    }

    #[test]
    fn top_t_orders_by_count_then_index() {
        assert_eq!(top_t(&[3, 0, 5, 3, 1], 3), vec![2, 0, 3]);
        assert_eq!(top_t(&[0, 0], 2), Vec::<usize>::new());
    }
}
