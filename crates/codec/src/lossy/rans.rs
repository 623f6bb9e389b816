//! Tiled, 32-way interleaved rANS with 32-bit states and 16-bit words (ryg_rans' word coder; the
//! seed's App. C.3): one warp decodes a tile, lane `l` the tile's items `l, l + 32, …`.
//!
//! The decoder reads words forward. In each *step* it decodes one symbol for every lane that is still
//! live, lanes in ascending order, and after that step each lane whose state fell below 2^16 takes the
//! next word, again in lane order (a warp ballot and prefix popcount on the GPU). The encoder visits the
//! same symbols in exactly the reverse order and reverses its words, so the two agree word for word.

use crate::{CodecError, Result};

pub const LANES: usize = 32;
/// Lower bound of a normalised state.
pub const STATE_MIN: u32 = 1 << 16;
/// Probability precisions the decoder supports (one payload word per symbol at most).
pub const PROB_BITS: std::ops::RangeInclusive<u8> = 9..=15;

/// A symbol distribution over `min .. min + freqs.len()`, frequencies summing to 2^prob_bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub min: i32,
    pub freqs: Vec<u16>,
}

impl Table {
    /// The table that codes `counts` (over `min ..`) in about the fewest bits: every symbol that occurs
    /// gets a slot, the rest go where they gain most (n·log2((f+1)/f), one slot at a time).
    pub fn build(min: i32, counts: &[u64], prob_bits: u8) -> Result<Table> {
        let m = 1u64 << prob_bits;
        let total: u64 = counts.iter().sum();
        let used = counts.iter().filter(|&&n| n > 0).count() as u64;
        if total == 0 {
            return Err(CodecError::Shape("no symbols to build a table from".into()));
        }
        if used > m {
            return Err(CodecError::Unsupported(format!(
                "{used} distinct symbols do not fit a table of 2^{prob_bits} slots"
            )));
        }
        let mut f: Vec<u64> = counts
            .iter()
            .map(|&n| if n == 0 { 0 } else { (n * m / total).max(1) })
            .collect();
        let mut sum: u64 = f.iter().sum();
        // Adjust one slot at a time by the exact marginal cost; a heap keeps this O(M log n).
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let key = |x: f64| (x * 1e9) as u64;
        if sum < m {
            let mut heap: BinaryHeap<(u64, Reverse<usize>)> = (0..f.len())
                .filter(|&i| counts[i] > 0)
                .map(|i| (key(gain(counts[i], f[i])), Reverse(i)))
                .collect();
            while sum < m {
                let (_, Reverse(i)) = heap.pop().expect("a used symbol");
                f[i] += 1;
                sum += 1;
                heap.push((key(gain(counts[i], f[i])), Reverse(i)));
            }
        } else if sum > m {
            let mut heap: BinaryHeap<(Reverse<u64>, usize)> = (0..f.len())
                .filter(|&i| f[i] > 1)
                .map(|i| (Reverse(key(gain(counts[i], f[i] - 1))), i))
                .collect();
            while sum > m {
                let (_, i) = heap.pop().expect("a symbol with more than one slot");
                f[i] -= 1;
                sum -= 1;
                if f[i] > 1 {
                    heap.push((Reverse(key(gain(counts[i], f[i] - 1))), i));
                }
            }
        }
        Ok(Table {
            min,
            freqs: f.into_iter().map(|x| x as u16).collect(),
        })
    }

    /// Bits this table spends on `counts` (same indexing as [`Table::build`]).
    pub fn coded_bits(&self, counts: &[u64], prob_bits: u8) -> f64 {
        counts
            .iter()
            .zip(&self.freqs)
            .filter(|(&n, _)| n > 0)
            .map(|(&n, &f)| n as f64 * (prob_bits as f64 - (f as f64).log2()))
            .sum()
    }

    /// Stored size: min (4), alphabet (4), frequencies.
    pub fn stored_bytes(&self) -> usize {
        8 + 2 * self.freqs.len()
    }

    pub fn validate(&self, prob_bits: u8) -> Result<()> {
        let sum: u64 = self.freqs.iter().map(|&f| f as u64).sum();
        if sum != 1u64 << prob_bits {
            return Err(CodecError::Corrupt(format!(
                "a frequency table sums to {sum}, not 2^{prob_bits}"
            )));
        }
        Ok(())
    }
}

fn gain(n: u64, f: u64) -> f64 {
    n as f64 * ((f + 1) as f64 / f as f64).log2()
}

/// Encoder-side symbol: frequency and cumulative frequency.
#[derive(Clone, Copy, Debug)]
pub struct Sym {
    pub freq: u32,
    pub cum: u32,
}

/// Cumulative frequencies of a table, for the encoder.
pub fn cumulative(t: &Table) -> Vec<u32> {
    let mut c = Vec::with_capacity(t.freqs.len());
    let mut run = 0u32;
    for &f in &t.freqs {
        c.push(run);
        run += f as u32;
    }
    c
}

/// Encodes one tile whose symbols, in the decoder's order, are `syms` with `lanes[i]` the lane of
/// symbol `i`. Returns the tile's final states (the decoder's initial ones) and its words in read order.
pub fn encode_tile(syms: &[Sym], lanes: &[u8], prob_bits: u8) -> ([u32; LANES], Vec<u16>) {
    debug_assert_eq!(syms.len(), lanes.len());
    let mut x = [STATE_MIN; LANES];
    let mut words = Vec::with_capacity(syms.len() / 2);
    let shift = 32 - prob_bits as u32;
    // The decoder reads a lane's word right after the step that decoded its symbol, in lane order;
    // reversed, that is: before encoding a symbol, emit if the state would overflow.
    for (s, &l) in syms.iter().zip(lanes).rev() {
        let l = l as usize;
        let mut st = x[l] as u64;
        if st >= (s.freq as u64) << shift {
            words.push(st as u16);
            st >>= 16;
        }
        let f = s.freq as u64;
        st = ((st / f) << prob_bits) + st % f + s.cum as u64;
        x[l] = st as u32;
    }
    words.reverse();
    (x, words)
}

/// Decoder table for one distribution: per slot, the symbol (offset from `min`), its frequency and
/// this slot's distance from the symbol's first slot.
#[derive(Clone, Debug)]
pub struct DecodeTable {
    pub min: i32,
    /// `sym | (freq - 1) << 16`: freq up to 2^15 fits.
    pub slot: Vec<u32>,
    pub bias: Vec<u16>,
}

impl DecodeTable {
    pub fn new(t: &Table, prob_bits: u8) -> Result<DecodeTable> {
        t.validate(prob_bits)?;
        let m = 1usize << prob_bits;
        let mut slot = Vec::with_capacity(m);
        let mut bias = Vec::with_capacity(m);
        for (s, &f) in t.freqs.iter().enumerate() {
            for b in 0..f {
                slot.push(s as u32 | ((f as u32 - 1) << 16));
                bias.push(b);
            }
        }
        Ok(DecodeTable {
            min: t.min,
            slot,
            bias,
        })
    }
}

/// One lane's decoder state over a tile's words.
pub struct Reader<'a> {
    pub words: &'a [u16],
    pub pos: usize,
}

impl Reader<'_> {
    #[inline]
    pub fn word(&mut self) -> Result<u16> {
        let w = *self
            .words
            .get(self.pos)
            .ok_or_else(|| CodecError::Corrupt("a tile's payload ends early".into()))?;
        self.pos += 1;
        Ok(w)
    }
}

/// Decodes one symbol from state `x` (no renormalisation: the caller does it after the step, in lane
/// order). Returns the symbol's value (table min added).
#[inline]
pub fn decode_sym(x: &mut u32, t: &DecodeTable, prob_bits: u8) -> i32 {
    let mask = (1u32 << prob_bits) - 1;
    let slot = (*x & mask) as usize;
    let e = t.slot[slot];
    let f = (e >> 16) + 1;
    *x = f * (*x >> prob_bits) + t.bias[slot] as u32;
    t.min + (e & 0xFFFF) as i32
}

/// After a step: every lane in `live` whose state is below 2^16 takes the next word, in lane order.
#[inline]
pub fn renorm(x: &mut [u32; LANES], live: usize, r: &mut Reader) -> Result<()> {
    for s in x.iter_mut().take(live) {
        if *s < STATE_MIN {
            *s = (*s << 16) | r.word()? as u32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_sums_to_its_size_and_never_drops_a_symbol() {
        for (counts, b) in [
            (vec![1u64, 0, 1_000_000, 3], 9u8),
            (vec![5; 512], 9),
            (vec![1; 300], 9),
            ((0..2000).map(|i| (i * 7919 % 97) as u64).collect(), 12),
        ] {
            let t = Table::build(-3, &counts, b).unwrap();
            t.validate(b).unwrap();
            for (n, f) in counts.iter().zip(&t.freqs) {
                assert_eq!(*n > 0, *f > 0);
            }
        }
        assert!(Table::build(0, &[1; 513], 9).is_err());
    }

    #[test]
    fn interleaved_lanes_round_trip_with_ragged_ends() {
        let mut r = crate::rng::SplitMix64::new(7);
        for b in [9u8, 11, 15] {
            let counts: Vec<u64> = (0..40).map(|i| 1 + (40 - i) * (40 - i)).collect();
            let t = Table::build(-20, &counts, b).unwrap();
            let cum = cumulative(&t);
            let dt = DecodeTable::new(&t, b).unwrap();
            for n in [0usize, 1, 31, 32, 33, 1000, 4097] {
                // Symbols in decoder order: step k covers items 32k.., lane = item % 32.
                let vals: Vec<i32> = (0..n).map(|_| (r.below(40)) as i32 - 20).collect();
                let syms: Vec<Sym> = vals
                    .iter()
                    .map(|&v| {
                        let i = (v - t.min) as usize;
                        Sym {
                            freq: t.freqs[i] as u32,
                            cum: cum[i],
                        }
                    })
                    .collect();
                let lanes: Vec<u8> = (0..n).map(|i| (i % LANES) as u8).collect();
                let (mut x, words) = encode_tile(&syms, &lanes, b);
                let mut r = Reader {
                    words: &words,
                    pos: 0,
                };
                let mut out = vec![];
                for step in 0..n.div_ceil(LANES) {
                    let live = (n - step * LANES).min(LANES);
                    for s in x.iter_mut().take(live) {
                        out.push(decode_sym(s, &dt, b));
                    }
                    renorm(&mut x, live, &mut r).unwrap();
                }
                assert_eq!(out, vals);
                assert_eq!(r.pos, words.len());
                assert!(
                    x.iter().all(|&s| s == STATE_MIN),
                    "states return to the start"
                );
            }
        }
    }
}
