//! Chunked, interleaved rANS over a static order-0 model: the coder for streams where dtANS's
//! per-tile costs do not pay (narrow matrices, short side streams). It codes within a few
//! thousandths of a bit of the symbols' entropy, but only decodes whole chunks, so a matrix stored
//! this way is decoded before it is served.
//!
//! Layout: symbols `0..alphabet` (≤ 256) with frequencies summing to 2^[`PROB_BITS`] (every
//! occurring symbol ≥ 1); the sequence cut into chunks of [`CHUNK`] symbols, each coded on its own
//! with [`STATES`] interleaved 32-bit states (symbol i of a chunk on state i mod 4) renormalised by
//! 16-bit words. A chunk's words are the final states (low half first) then the renormalisation
//! words in decoding order; `offsets[c]` is where chunk c's words start.

use crate::{CodecError, Result};
use rayon::prelude::*;

/// Frequencies sum to 2^PROB_BITS.
pub const PROB_BITS: u32 = 15;
/// Symbols a chunk (decoded on its own).
pub const CHUNK: usize = 1 << 16;
/// Interleaved states a chunk.
pub const STATES: usize = 4;
const L: u32 = 1 << 16;
const M: u32 = 1 << PROB_BITS;

/// A coded sequence of symbols.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RansStream {
    /// Symbols coded.
    pub n: usize,
    /// Frequency of each symbol `0..freqs.len()`.
    pub freqs: Vec<u16>,
    /// Word offset of each chunk in `words`.
    pub offsets: Vec<u32>,
    pub words: Vec<u16>,
}

/// Frequencies summing to 2^`bits` that minimise the coded size of `counts` (each occurring
/// symbol at least 1): proportional shares, then single-slot moves by marginal cost.
pub fn normalise_to(counts: &[u64], bits: u32) -> Result<Vec<u16>> {
    let total: u64 = counts.iter().sum();
    let used = counts.iter().filter(|&&c| c > 0).count();
    let m = 1u32 << bits.min(PROB_BITS);
    if total == 0 {
        return Err(CodecError::Shape("no symbols to code".into()));
    }
    if used as u32 > m {
        return Err(CodecError::Shape(format!(
            "{used} distinct symbols exceed the {m} slots"
        )));
    }
    let mut f: Vec<u32> = counts
        .iter()
        .map(|&c| match c {
            0 => 0,
            c => ((c as f64 * m as f64 / total as f64).floor() as u32).max(1),
        })
        .collect();
    let gain = |c: u64, f: u32| c as f64 * ((f + 1) as f64 / f as f64).log2();
    let loss = |c: u64, f: u32| c as f64 * (f as f64 / (f - 1) as f64).log2();
    let mut sum: u32 = f.iter().sum();
    while sum < m {
        let s = (0..f.len())
            .filter(|&s| counts[s] > 0)
            .max_by(|&a, &b| gain(counts[a], f[a]).total_cmp(&gain(counts[b], f[b])))
            .expect("a symbol occurs");
        f[s] += 1;
        sum += 1;
    }
    while sum > m {
        let s = (0..f.len())
            .filter(|&s| f[s] > 1)
            .min_by(|&a, &b| loss(counts[a], f[a]).total_cmp(&loss(counts[b], f[b])))
            .expect("more slots than symbols");
        f[s] -= 1;
        sum -= 1;
    }
    Ok(f.into_iter().map(|x| x as u16).collect())
}

/// Bits of coding `counts` with frequencies `f` summing to 2^`bits`.
fn cross_entropy_bits(counts: &[u64], f: &[u16], bits: u32) -> f64 {
    counts
        .iter()
        .zip(f)
        .filter(|(&c, _)| c > 0)
        .map(|(&c, &f)| c as f64 * (f64::from(bits) - f64::from(f).log2()))
        .sum()
}

/// The model that stores `counts` smallest, table included: frequencies at the precision 2^k
/// (k ≤ [`PROB_BITS`]) that minimises coded bits plus table bytes, scaled to 2^PROB_BITS for the
/// coder. A short stream cannot pay for a fine table; a long one gains from it.
fn best_model(counts: &[u64]) -> Result<(Vec<u16>, f64)> {
    let used = counts.iter().filter(|&&c| c > 0).count().max(1);
    let lowest = usize::BITS - (used - 1).leading_zeros();
    let mut best: Option<(Vec<u16>, f64)> = None;
    for k in lowest..=PROB_BITS {
        let f = normalise_to(counts, k)?;
        let bytes = cross_entropy_bits(counts, &f, k) / 8.0;
        let scaled: Vec<u16> = f.iter().map(|&x| x << (PROB_BITS - k)).collect();
        let total = bytes + table_bytes(&scaled).len() as f64;
        if best.as_ref().is_none_or(|(_, b)| total < *b) {
            best = Some((scaled, total));
        }
    }
    Ok(best.expect("one precision is tried"))
}

/// LSB-first bit writer of a table.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, v: u64, bits: u32) {
        debug_assert!(bits <= 32);
        self.acc |= v << self.n;
        self.n += bits;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }
    /// Elias gamma of `v ≥ 1`.
    fn gamma(&mut self, v: u32) {
        let len = 31 - v.leading_zeros();
        self.put(0, len);
        self.put(1, 1);
        self.put(u64::from(v) & ((1 << len) - 1), len);
    }
    fn rice(&mut self, v: u32, r: u32) {
        for _ in 0..v >> r {
            self.put(0, 1);
        }
        self.put(1, 1);
        self.put(u64::from(v) & ((1 << r) - 1), r);
    }
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// LSB-first bit reader of a table; reading past its end is an error.
struct BitReader<'a> {
    b: &'a [u8],
    at: usize,
}

impl BitReader<'_> {
    fn bit(&mut self) -> std::result::Result<u32, String> {
        let byte = self.b.get(self.at / 8).ok_or("the table ends early")?;
        let v = (byte >> (self.at % 8)) & 1;
        self.at += 1;
        Ok(u32::from(v))
    }
    fn get(&mut self, bits: u32) -> std::result::Result<u32, String> {
        (0..bits).try_fold(0, |v, i| Ok(v | self.bit()? << i))
    }
    fn gamma(&mut self) -> std::result::Result<u32, String> {
        let mut len = 0;
        while self.bit()? == 0 {
            len += 1;
            if len > 16 {
                return Err("a table count is out of range".into());
            }
        }
        Ok(1 << len | self.get(len)?)
    }
    fn rice(&mut self, r: u32) -> std::result::Result<u32, String> {
        let mut q = 0u32;
        while self.bit()? == 0 {
            q += 1;
            if q << r > M {
                return Err("a table frequency is out of range".into());
            }
        }
        Ok(q << r | self.get(r)?)
    }
}

/// The frequency table as stored: a byte of the shift s (all frequencies are multiples of 2^s)
/// and the Rice parameter r, then bits (LSB first): gamma(symbols used), gamma(1 + absent
/// symbols before each used one), and Rice_r(f/2^s − 1) for each used symbol but the last, whose
/// frequency is what remains of 2^(15−s). No symbols coded: an empty table.
pub fn table_bytes(freqs: &[u16]) -> Vec<u8> {
    let used: Vec<(usize, u32)> = freqs
        .iter()
        .enumerate()
        .filter(|(_, &f)| f > 0)
        .map(|(s, &f)| (s, u32::from(f)))
        .collect();
    if used.is_empty() {
        return Vec::new();
    }
    let shift = used
        .iter()
        .map(|&(_, f)| f.trailing_zeros())
        .min()
        .expect("a symbol is used")
        .min(PROB_BITS);
    let values: Vec<u32> = used[..used.len() - 1]
        .iter()
        .map(|&(_, f)| (f >> shift) - 1)
        .collect();
    let rice_bits = |r: u32| -> u64 { values.iter().map(|&v| u64::from((v >> r) + 1 + r)).sum() };
    let r = (0..15).min_by_key(|&r| rice_bits(r)).expect("a parameter");
    let mut w = Bits {
        out: vec![(shift | r << 4) as u8],
        acc: 0,
        n: 0,
    };
    w.gamma(used.len() as u32);
    let mut next = 0;
    for &(s, _) in &used {
        w.gamma((s - next + 1) as u32);
        next = s + 1;
    }
    for &v in &values {
        w.rice(v, r);
    }
    w.finish()
}

/// Frequencies of an `alphabet`-symbol stream from [`table_bytes`]; a damaged table is an error.
pub fn table_freqs(b: &[u8], alphabet: usize) -> Result<Vec<u16>> {
    let mut f = vec![0u16; alphabet];
    let Some((&head, rest)) = b.split_first() else {
        return Ok(f);
    };
    let corrupt = |m: String| CodecError::Corrupt(format!("rANS table: {m}"));
    let (shift, r) = (u32::from(head & 15), u32::from(head >> 4));
    let mut rd = BitReader { b: rest, at: 0 };
    let used = rd.gamma().map_err(corrupt)? as usize;
    if used > alphabet {
        return Err(corrupt(format!(
            "{used} symbols in an alphabet of {alphabet}"
        )));
    }
    let mut symbols = Vec::with_capacity(used);
    let mut next = 0usize;
    for _ in 0..used {
        let s = next + rd.gamma().map_err(corrupt)? as usize - 1;
        if s >= alphabet {
            return Err(corrupt(format!("symbol {s} outside the alphabet")));
        }
        symbols.push(s);
        next = s + 1;
    }
    let mut left = M >> shift;
    for &s in &symbols[..used - 1] {
        let v = rd.rice(r).map_err(corrupt)? + 1;
        if v >= left {
            return Err(corrupt("frequencies exceed the total".into()));
        }
        left -= v;
        f[s] = (v << shift) as u16;
    }
    f[symbols[used - 1]] = (left << shift) as u16;
    if rd.at.div_ceil(8) != rest.len() {
        return Err(corrupt("bytes left after the table".into()));
    }
    Ok(f)
}

fn starts(freqs: &[u16]) -> Vec<u32> {
    let mut acc = 0u32;
    freqs
        .iter()
        .map(|&f| {
            let s = acc;
            acc += u32::from(f);
            s
        })
        .collect()
}

fn encode_chunk(symbols: &[u8], freqs: &[u16], start: &[u32]) -> Vec<u16> {
    let mut x = [L; STATES];
    let mut out: Vec<u16> = Vec::with_capacity(symbols.len() / 2 + 2 * STATES);
    for (i, &s) in symbols.iter().enumerate().rev() {
        let (f, st) = (u32::from(freqs[s as usize]), start[s as usize]);
        let x = &mut x[i % STATES];
        let x_max = (u64::from(L >> PROB_BITS) << 16) * u64::from(f);
        if u64::from(*x) >= x_max {
            out.push(*x as u16);
            *x >>= 16;
        }
        *x = ((*x / f) << PROB_BITS) + (*x % f) + st;
    }
    // Final states, read first: pushed last, in reverse (the whole vector is reversed).
    for &s in x.iter().rev() {
        out.push(s as u16);
        out.push((s >> 16) as u16);
    }
    out.reverse();
    out
}

impl RansStream {
    /// Codes `symbols` (each `< alphabet`, `alphabet ≤ 256`).
    pub fn encode(symbols: &[u8], alphabet: usize) -> Result<RansStream> {
        if alphabet == 0 || alphabet > 256 {
            return Err(CodecError::Shape(format!(
                "rANS codes alphabets of 1 to 256 symbols, not {alphabet}"
            )));
        }
        let mut counts = vec![0u64; 256];
        for &s in symbols {
            counts[s as usize] += 1;
        }
        if let Some(s) = (alphabet..256).find(|&s| counts[s] > 0) {
            return Err(CodecError::Shape(format!(
                "symbol {s} is outside the alphabet of {alphabet}"
            )));
        }
        counts.truncate(alphabet);
        let freqs = match symbols.is_empty() {
            true => vec![0; alphabet],
            false => best_model(&counts)?.0,
        };
        let start = starts(&freqs);
        let chunks: Vec<Vec<u16>> = symbols
            .par_chunks(CHUNK)
            .map(|c| encode_chunk(c, &freqs, &start))
            .collect();
        let mut offsets = Vec::with_capacity(chunks.len());
        let mut words = Vec::with_capacity(chunks.iter().map(Vec::len).sum());
        for c in chunks {
            offsets.push(u32::try_from(words.len()).map_err(|_| {
                CodecError::Shape("rANS stream exceeds 2^32 words; split the tensor".into())
            })?);
            words.extend_from_slice(&c);
        }
        Ok(RansStream {
            n: symbols.len(),
            freqs,
            offsets,
            words,
        })
    }

    /// Bytes the stream stores: its table ([`table_bytes`]), offsets, words.
    pub fn stored_bytes(&self) -> usize {
        table_bytes(&self.freqs).len() + 4 * self.offsets.len() + 2 * self.words.len()
    }

    /// Predicted stored bytes of coding symbols with histogram `counts` (`counts.len()` the
    /// alphabet): the chosen model's cross-entropy and table, plus the states and offsets.
    pub fn predict_bytes(counts: &[u64]) -> Result<f64> {
        let n: u64 = counts.iter().sum();
        if n == 0 {
            return Ok(0.0);
        }
        let (_, bytes) = best_model(counts)?;
        let chunks = (n as usize).div_ceil(CHUNK);
        // Each state flushes 32 bits and starts with up to 16 unused ones.
        let per_chunk = 4.0 + (STATES * 4) as f64 + STATES as f64;
        Ok(bytes + chunks as f64 * per_chunk)
    }

    /// Checks the structure (sizes, frequencies, offsets) without decoding.
    pub fn validate(&self) -> Result<()> {
        let corrupt = |m: String| Err(CodecError::Corrupt(m));
        if self.freqs.is_empty() || self.freqs.len() > 256 {
            return corrupt(format!("rANS table of {} symbols", self.freqs.len()));
        }
        let sum: u32 = self.freqs.iter().map(|&f| u32::from(f)).sum();
        if self.n > 0 && sum != M {
            return corrupt(format!("rANS frequencies sum to {sum}, not {M}"));
        }
        if self.offsets.len() != self.n.div_ceil(CHUNK) {
            return corrupt(format!(
                "{} rANS chunks for {} symbols",
                self.offsets.len(),
                self.n
            ));
        }
        let mut prev = 0usize;
        for (c, &o) in self.offsets.iter().enumerate() {
            let o = o as usize;
            if o < prev || (c == 0 && o != 0) || o + 2 * STATES > self.words.len() {
                return corrupt(format!("rANS chunk {c} starts at a bad offset {o}"));
            }
            prev = o + 2 * STATES;
        }
        Ok(())
    }

    /// The symbols, chunks decoded in parallel. Damaged streams are errors, never panics.
    pub fn decode(&self) -> Result<Vec<u8>> {
        self.validate()?;
        // A one-symbol model codes any number of symbols in a few words: the count is the
        // stream's to claim, so memory for it is asked for, not assumed.
        let mut out = Vec::new();
        out.try_reserve_exact(self.n).map_err(|_| {
            CodecError::Corrupt(format!("{} rANS symbols do not fit in memory", self.n))
        })?;
        out.resize(self.n, 0);
        if self.n == 0 {
            return Ok(out);
        }
        let mut lookup = vec![0u8; M as usize];
        let start = starts(&self.freqs);
        for (s, (&f, &st)) in self.freqs.iter().zip(&start).enumerate() {
            lookup[st as usize..(st + u32::from(f)) as usize].fill(s as u8);
        }
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .try_for_each(|(c, out)| {
                let from = self.offsets[c] as usize;
                let to = self
                    .offsets
                    .get(c + 1)
                    .map_or(self.words.len(), |&o| o as usize);
                self.decode_chunk(&self.words[from..to], &lookup, &start, out)
                    .map_err(|m| CodecError::Corrupt(format!("rANS chunk {c}: {m}")))
            })?;
        Ok(out)
    }

    fn decode_chunk(
        &self,
        words: &[u16],
        lookup: &[u8],
        start: &[u32],
        out: &mut [u8],
    ) -> std::result::Result<(), String> {
        let mut x = [0u32; STATES];
        for (k, x) in x.iter_mut().enumerate() {
            *x = u32::from(words[2 * k]) << 16 | u32::from(words[2 * k + 1]);
            if *x < L {
                return Err(format!("state {k} below the lower bound"));
            }
        }
        let mut at = 2 * STATES;
        for (i, o) in out.iter_mut().enumerate() {
            let x = &mut x[i % STATES];
            let slot = *x & (M - 1);
            let s = lookup[slot as usize];
            *o = s;
            let f = u32::from(self.freqs[s as usize]);
            // Wrapping: a damaged stream must fail its end check, not overflow.
            *x = f
                .wrapping_mul(*x >> PROB_BITS)
                .wrapping_add(slot)
                .wrapping_sub(start[s as usize]);
            if *x < L {
                let Some(&w) = words.get(at) else {
                    return Err("stream ends early".into());
                };
                *x = (*x << 16) | u32::from(w);
                at += 1;
            }
        }
        if at != words.len() || x.iter().any(|&x| x != L) {
            return Err("stream does not end where its symbols do".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::histogram::{byte_histogram, entropy_bits};

    fn skewed(n: usize, alphabet: usize, seed: u64) -> Vec<u8> {
        let mut g = crate::rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| {
                // Geometric-ish: many small symbols, a long tail.
                let r = g.unit();
                ((-r.max(1e-12).ln() * alphabet as f64 / 6.0) as usize).min(alphabet - 1) as u8
            })
            .collect()
    }

    #[test]
    fn round_trips_every_size_and_alphabet() {
        for alphabet in [1usize, 2, 3, 16, 64, 256] {
            for n in [
                0usize,
                1,
                3,
                4,
                5,
                1000,
                CHUNK - 1,
                CHUNK,
                CHUNK + 7,
                3 * CHUNK + 1,
            ] {
                let v = skewed(n, alphabet, (n * 31 + alphabet) as u64);
                let r = RansStream::encode(&v, alphabet).unwrap();
                assert_eq!(r.decode().unwrap(), v, "alphabet {alphabet}, {n} symbols");
            }
        }
    }

    #[test]
    fn codes_within_a_hundredth_of_a_bit_of_the_entropy_beside_its_table() {
        for alphabet in [4usize, 16, 64, 256] {
            let n = 300_000;
            let v = skewed(n, alphabet, alphabet as u64);
            let r = RansStream::encode(&v, alphabet).unwrap();
            let h = entropy_bits(&byte_histogram(&v));
            let bits = r.stored_bytes() as f64 * 8.0 / n as f64;
            let table = 16.0 * alphabet as f64 / n as f64;
            assert!(
                bits >= h - 1e-9 && bits < h + table + 0.01,
                "{alphabet}: {bits} vs {h}"
            );
            let counts: Vec<u64> = byte_histogram(&v)[..alphabet].to_vec();
            let p = RansStream::predict_bytes(&counts).unwrap();
            let actual = r.stored_bytes() as f64;
            assert!(
                (p - actual).abs() < 0.002 * actual + 64.0,
                "{p} vs {actual}"
            );
        }
    }

    #[test]
    fn normalised_frequencies_sum_to_the_table_and_keep_every_symbol() {
        let counts = [1u64, 0, 1_000_000, 3, 0, 7];
        let f = normalise_to(&counts, PROB_BITS).unwrap();
        assert_eq!(f.iter().map(|&x| u32::from(x)).sum::<u32>(), M);
        assert!(f[0] >= 1 && f[1] == 0 && f[3] >= 1 && f[4] == 0);
        assert!(normalise_to(&[0, 0], PROB_BITS).is_err());
    }

    #[test]
    fn tables_round_trip_at_every_precision_and_sparsity() {
        let mut rng = crate::rng::SplitMix64::new(0x5eed);
        let mut next = move || rng.next_u64();
        assert!(table_bytes(&[0; 16]).is_empty());
        assert_eq!(table_freqs(&[], 16).unwrap(), vec![0; 16]);
        for case in 0..400 {
            let alphabet = [1usize, 2, 16, 32, 64, 255, 256][case % 7];
            let n = 1 + (next() % 200_000) as usize;
            // A random sparsity and skew: some symbols absent, the rest of random weight.
            let keep = 1 + next() % 8;
            let counts: Vec<u64> = (0..alphabet)
                .map(|s| match s == 0 || next() % 8 < keep {
                    true => 1 + next() % (1 + (next() % n as u64)),
                    false => 0,
                })
                .collect();
            let k = 8 + (case as u32 % 8);
            let used = counts.iter().filter(|&&c| c > 0).count();
            let k = k.max(usize::BITS - (used - 1).leading_zeros());
            let f: Vec<u16> = normalise_to(&counts, k)
                .unwrap()
                .iter()
                .map(|&x| x << (PROB_BITS - k))
                .collect();
            let t = table_bytes(&f);
            assert_eq!(table_freqs(&t, alphabet).unwrap(), f, "case {case}");
            let (best, bytes) = best_model(&counts).unwrap();
            assert_eq!(best.iter().map(|&x| u32::from(x)).sum::<u32>(), M);
            assert_eq!(table_freqs(&table_bytes(&best), alphabet).unwrap(), best);
            assert!(bytes > 0.0);
        }
    }

    #[test]
    fn short_streams_get_small_tables() {
        // 3456 near-uniform bytes (a small matrix's scale low bytes): the 15-bit table would be
        // 512 bytes; a coarse one costs little more than the values themselves.
        let v: Vec<u8> = skewed(3456 * 7, 256, 5)
            .chunks(7)
            .map(|c| {
                c.iter()
                    .fold(0u8, |a, &b| a.wrapping_mul(31).wrapping_add(b))
            })
            .collect();
        let r = RansStream::encode(&v, 256).unwrap();
        assert_eq!(r.decode().unwrap(), v);
        assert!(r.stored_bytes() < 3456 + 200, "{}", r.stored_bytes());
        let counts: Vec<u64> = byte_histogram(&v).to_vec();
        let p = RansStream::predict_bytes(&counts).unwrap();
        assert!((p - r.stored_bytes() as f64).abs() < 40.0, "{p}");
    }

    #[test]
    fn damaged_tables_are_errors_or_tables() {
        let v = skewed(50_000, 64, 3);
        let r = RansStream::encode(&v, 64).unwrap();
        let t = table_bytes(&r.freqs);
        for cut in 0..t.len() {
            assert!(table_freqs(&t[..cut], 64).is_err() || cut == 0);
        }
        let mut long = t.clone();
        long.push(0);
        assert!(table_freqs(&long, 64).is_err());
        assert!(table_freqs(&t, 8).is_err());
        for k in 0..8 * t.len() {
            let mut bad = t.clone();
            bad[k / 8] ^= 1 << (k % 8);
            if let Ok(f) = table_freqs(&bad, 64) {
                let sum: u32 = f.iter().map(|&x| u32::from(x)).sum();
                assert_eq!(sum, M, "a table that parses sums to the total");
            }
        }
    }

    #[test]
    fn damaged_streams_are_errors() {
        let v = skewed(CHUNK + 500, 16, 9);
        let r = RansStream::encode(&v, 16).unwrap();
        assert!(RansStream::encode(&[16], 16).is_err());
        let mut bad = r.clone();
        bad.words.truncate(bad.words.len() - 3);
        assert!(bad.decode().is_err());
        let mut bad = r.clone();
        bad.offsets[1] = u32::MAX;
        assert!(bad.decode().is_err());
        let mut bad = r.clone();
        bad.freqs[0] += 1;
        assert!(bad.decode().is_err());
        let mut bad = r.clone();
        bad.n += CHUNK;
        assert!(bad.decode().is_err());
        // Flipped words decode to something or fail; never panic.
        for k in 0..64 {
            let mut bad = r.clone();
            let i = (k * 7919) % bad.words.len();
            bad.words[i] ^= 0x5a5a;
            let _ = bad.decode();
        }
    }
}
