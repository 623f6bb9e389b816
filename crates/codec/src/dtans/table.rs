//! The dtANS-LLM decoding table: which symbols exist and how many of the M slots each owns.
//!
//! A symbol is a tuple of k codes (k = 1, 2, 4 for Single, Pair, Quad) packed into 16 bits, code j
//! in bits `j·code_bits ..`: exactly the payload a table entry carries. A symbol with r slots costs
//! log2(M / r) bits; r is limited to 1..=255 because the entry stores it in 8 bits.
//! Slots are laid out contiguously in table order (the slot order does not change the rate: the
//! mixed-radix digits return exactly log2 r bits whichever slot a digit names).

use crate::{CodecError, Result};
use std::collections::BinaryHeap;

/// Most slots one symbol may own.
pub const MAX_SLOTS: u32 = 255;

/// The stored form of a table: symbols (packed code tuples) and their slot counts, summing to M.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolTable {
    pub symbols: Vec<u16>,
    pub counts: Vec<u8>,
}

/// What the encoder needs: symbol index per key, and each symbol's first slot and slot count.
pub(crate) struct EncoderTable {
    /// Indexed by the packed tuple; `u16::MAX` where the tuple has no symbol.
    pub key_to_symbol: Vec<u16>,
    pub start: Vec<u16>,
    pub count: Vec<u32>,
    /// `⌈2^40 / r⌉` per symbol: divides any 32-bit value by r ≤ 255 exactly with one multiply
    /// (the rounding error, below 2^32·r / (r·2^40) = 2^-8, never reaches 1/r).
    pub reciprocal: Vec<u64>,
}

impl EncoderTable {
    /// (n / r_s, n mod r_s) for symbol s.
    #[inline(always)]
    pub fn divmod(&self, n: u32, s: usize) -> (u32, u32) {
        let q = ((n as u128 * self.reciprocal[s] as u128) >> 40) as u32;
        (q, n - q * self.count[s])
    }
}

impl SymbolTable {
    /// Checks a table read from untrusted data against the coding it claims to serve.
    pub fn validate(&self, key_bits: u32, log2_m: u8) -> Result<()> {
        let m = 1usize << log2_m;
        if self.symbols.len() != self.counts.len() {
            return Err(CodecError::Corrupt(format!(
                "table has {} symbols but {} slot counts",
                self.symbols.len(),
                self.counts.len()
            )));
        }
        if self.symbols.is_empty() || self.symbols.len() > m {
            return Err(CodecError::Corrupt(format!(
                "table has {} symbols; it needs 1 to M = {m}",
                self.symbols.len()
            )));
        }
        if let Some(i) = self.counts.iter().position(|&c| c == 0) {
            return Err(CodecError::Corrupt(format!(
                "symbol {i} of the table owns no slot"
            )));
        }
        let total: usize = self.counts.iter().map(|&c| c as usize).sum();
        if total != m {
            return Err(CodecError::Corrupt(format!(
                "table slot counts sum to {total}, not M = {m}"
            )));
        }
        let mut seen = vec![false; 1 << key_bits];
        for &s in &self.symbols {
            if (s as usize) >> key_bits != 0 {
                return Err(CodecError::Corrupt(format!(
                    "table symbol {s:#x} does not fit {key_bits} bits"
                )));
            }
            if std::mem::replace(&mut seen[s as usize], true) {
                return Err(CodecError::Corrupt(format!(
                    "table symbol {s:#x} appears twice"
                )));
            }
        }
        Ok(())
    }

    /// The M 32-bit entries the decoder looks up: base r (bits 0..8), digit d (8..16), payload (16..32).
    pub fn decoder_entries(&self) -> Vec<u32> {
        let mut e = Vec::with_capacity(self.counts.iter().map(|&c| c as usize).sum());
        for (&s, &r) in self.symbols.iter().zip(&self.counts) {
            for d in 0..r as u32 {
                e.push(r as u32 | d << 8 | (s as u32) << 16);
            }
        }
        e
    }

    pub(crate) fn encoder(&self, key_bits: u32) -> EncoderTable {
        let mut key_to_symbol = vec![u16::MAX; 1 << key_bits];
        let mut start = Vec::with_capacity(self.symbols.len());
        let mut count = Vec::with_capacity(self.symbols.len());
        let mut slot = 0u32;
        for (i, (&s, &r)) in self.symbols.iter().zip(&self.counts).enumerate() {
            key_to_symbol[s as usize] = i as u16;
            start.push(slot as u16);
            count.push(r as u32);
            slot += r as u32;
        }
        let reciprocal = count
            .iter()
            .map(|&r| (1u64 << 40).div_ceil(r as u64))
            .collect();
        EncoderTable {
            key_to_symbol,
            start,
            count,
            reciprocal,
        }
    }

    /// Bits to code `hist` (counts per key) with this table: Σ n·log2(M / r). Infinite if a key
    /// with a count has no symbol.
    pub fn coded_bits(&self, hist: &[u64], log2_m: u8) -> f64 {
        let m = (1u64 << log2_m) as f64;
        let mut slots = vec![0u32; hist.len()];
        for (&s, &r) in self.symbols.iter().zip(&self.counts) {
            if (s as usize) < slots.len() {
                slots[s as usize] = r as u32;
            }
        }
        hist.iter()
            .zip(&slots)
            .filter(|(&n, _)| n > 0)
            .map(|(&n, &r)| {
                if r == 0 {
                    f64::INFINITY
                } else {
                    n as f64 * (m / r as f64).log2()
                }
            })
            .sum()
    }

    /// The table that codes `hist` (counts per packed key, `hist.len() == 2^key_bits`) in the
    /// fewest bits with M = 2^log2_m slots: every key with a count gets at least one slot, slots go
    /// one at a time to the largest marginal gain n·log2((r+1)/r) (optimal for this separable concave
    /// objective), and slots that capped symbols cannot take go to unused keys ("dummies").
    pub fn build(hist: &[u64], log2_m: u8) -> Result<SymbolTable> {
        let m = 1u32 << log2_m;
        let used: Vec<usize> = (0..hist.len()).filter(|&k| hist[k] > 0).collect();
        if used.is_empty() {
            return Err(CodecError::Shape("no symbols to build a table from".into()));
        }
        if used.len() > m as usize {
            return Err(CodecError::Unsupported(format!(
                "{} distinct symbols do not fit a table of M = {m} slots; keep fewer values (t) or use a larger M",
                used.len()
            )));
        }
        let mut r = vec![1u32; used.len()];
        let mut left = m - used.len() as u32;
        // Max-heap of (gain, index); gain compared as raw f64 bits (all gains are ≥ 0).
        let gain = |n: u64, r: u32| n as f64 * ((r + 1) as f64 / r as f64).log2();
        let mut heap: BinaryHeap<(u64, std::cmp::Reverse<usize>)> = used
            .iter()
            .enumerate()
            .map(|(i, &k)| (gain(hist[k], 1).to_bits(), std::cmp::Reverse(i)))
            .collect();
        while left > 0 {
            let Some((_, std::cmp::Reverse(i))) = heap.pop() else {
                break;
            };
            r[i] += 1;
            left -= 1;
            if r[i] < MAX_SLOTS {
                heap.push((gain(hist[used[i]], r[i]).to_bits(), std::cmp::Reverse(i)));
            }
        }
        let mut symbols: Vec<u16> = used.iter().map(|&k| k as u16).collect();
        let mut counts: Vec<u8> = r.iter().map(|&c| c as u8).collect();
        if left > 0 {
            // Every symbol is capped: the rest of the table goes to keys that never occur.
            let mut dummies = (0..hist.len()).filter(|&k| hist[k] == 0);
            while left > 0 {
                let Some(k) = dummies.next() else {
                    return Err(CodecError::Unsupported(format!(
                        "the alphabet has too few tuples to fill M = {m} slots (at most {MAX_SLOTS} each); use a smaller M"
                    )));
                };
                let c = left.min(MAX_SLOTS);
                symbols.push(k as u16);
                counts.push(c as u8);
                left -= c;
            }
        }
        Ok(SymbolTable { symbols, counts })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute_force_best(hist: &[u64], m: u32) -> f64 {
        // Exhaustive over slot splits for two or three used symbols.
        let used: Vec<u64> = hist.iter().copied().filter(|&n| n > 0).collect();
        let mut best = f64::INFINITY;
        let cost = |r: &[u32]| -> f64 {
            used.iter()
                .zip(r)
                .map(|(&n, &r)| n as f64 * (m as f64 / r as f64).log2())
                .sum()
        };
        match used.len() {
            2 => {
                for a in 1..=MAX_SLOTS.min(m - 1) {
                    let b = m - a;
                    if (1..=MAX_SLOTS).contains(&b) {
                        best = best.min(cost(&[a, b]));
                    } else if b > MAX_SLOTS {
                        best = best.min(cost(&[a, MAX_SLOTS]));
                    }
                }
            }
            3 => {
                for a in 1..=MAX_SLOTS {
                    for b in 1..=MAX_SLOTS {
                        if a + b >= m {
                            continue;
                        }
                        let c = (m - a - b).min(MAX_SLOTS);
                        best = best.min(cost(&[a, b, c]));
                    }
                }
            }
            _ => unreachable!(),
        }
        best
    }

    #[test]
    fn greedy_allocation_is_optimal_on_small_cases() {
        for hist in [
            vec![10u64, 0, 3],
            vec![1000, 1, 0, 0, 5],
            vec![7, 7, 7],
            vec![1, 0, 1_000_000],
        ] {
            let t = SymbolTable::build(&hist, 8).unwrap();
            let got = t.coded_bits(&hist, 8);
            let best = brute_force_best(&hist, 256);
            assert!((got - best).abs() < 1e-9, "{hist:?}: {got} vs {best}");
            t.validate(8, 8).unwrap();
        }
    }

    #[test]
    fn one_symbol_fills_with_dummies() {
        let mut hist = vec![0u64; 256];
        hist[17] = 1000;
        let t = SymbolTable::build(&hist, 12).unwrap();
        t.validate(8, 12).unwrap();
        assert_eq!(t.symbols[0], 17);
        assert_eq!(t.counts[0], 255);
        assert_eq!(t.counts.iter().map(|&c| c as u32).sum::<u32>(), 4096);
        assert!(!t.symbols[1..].contains(&17));
    }

    #[test]
    fn too_many_symbols_or_too_small_alphabet_is_an_error() {
        let hist = vec![1u64; 512];
        assert!(matches!(
            SymbolTable::build(&hist, 8),
            Err(CodecError::Unsupported(_))
        ));
        let hist = vec![5u64, 5, 5, 5]; // int2 Single: 4 tuples cannot fill 4096 slots
        assert!(matches!(
            SymbolTable::build(&hist, 12),
            Err(CodecError::Unsupported(_))
        ));
        assert!(SymbolTable::build(&[0, 0], 8).is_err());
    }

    #[test]
    fn reciprocal_division_is_exact_for_every_slot_count() {
        let t = SymbolTable {
            symbols: (0..255).collect(),
            counts: (1..=255).collect(),
        };
        let e = t.encoder(8);
        for s in 0..255 {
            let r = s as u32 + 1;
            let edge = u32::MAX / r * r;
            for n in [
                0,
                1,
                r - 1,
                r,
                r + 1,
                12345,
                u32::MAX - 1,
                u32::MAX,
                edge,
                edge - 1,
            ] {
                assert_eq!(e.divmod(n, s), (n / r, n % r), "n = {n}, r = {r}");
            }
        }
    }

    #[test]
    fn decoder_entries_follow_the_layout() {
        let t = SymbolTable {
            symbols: vec![3, 9],
            counts: vec![1, 255],
        };
        let e = t.decoder_entries();
        assert_eq!(e.len(), 256);
        assert_eq!(e[0], 1 | 3 << 16);
        assert_eq!(e[1], 255 | 9 << 16);
        assert_eq!(e[255], 255 | 254 << 8 | 9 << 16);
    }

    #[test]
    fn validate_rejects_bad_tables() {
        let ok = SymbolTable {
            symbols: vec![3, 9],
            counts: vec![1, 255],
        };
        ok.validate(8, 8).unwrap();
        let bad = [
            SymbolTable {
                symbols: vec![3],
                counts: vec![1, 255],
            },
            SymbolTable {
                symbols: vec![3, 9],
                counts: vec![0, 255],
            },
            SymbolTable {
                symbols: vec![3, 9],
                counts: vec![2, 255],
            },
            SymbolTable {
                symbols: vec![3, 3],
                counts: vec![1, 255],
            },
            SymbolTable {
                symbols: vec![3, 300],
                counts: vec![1, 255],
            },
            SymbolTable {
                symbols: vec![],
                counts: vec![],
            },
        ];
        for t in bad {
            assert!(t.validate(8, 8).is_err(), "{t:?}");
        }
    }
}
