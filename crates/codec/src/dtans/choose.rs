//! Size prediction and the choice of a coding: the cross-entropy of the table's model plus the
//! layout's overheads, computed from histograms without encoding (MINE §4.2).

use super::encode::{choose_values, tuple_histogram};
use super::*;
use crate::histogram::byte_histogram;
use rayon::prelude::*;

/// Bits a lane spends beyond its symbols' cost: the digits of its last quartet, which have no
/// reservoir to draw from (`log2 R`), and the unused part of the initial accumulator word it sends
/// (`32 − log2 x_init`). The accumulator's size is followed through the encoder's fold/emit rule
/// with every quartet taking the mean `log2 R`.
fn lane_overhead_bits(quartets: usize, log2_r: f64) -> f64 {
    let mut l = 0.0f64; // log2 of the reservoir; the encoder starts with x = 1
    for _ in 1..quartets {
        l = if l < log2_r {
            l + 32.0 - log2_r
        } else {
            l - log2_r
        };
    }
    32.0 - l + log2_r
}

/// Predicted stored bytes of a tensor coded with `table`, given the exact histogram of its packed
/// tuples over the padded tile grid and its escape count.
pub fn predict_bytes(
    g: &Geometry,
    table: &SymbolTable,
    log2_m: u8,
    hist: &[u64],
    escapes: u64,
) -> f64 {
    let coded_bits = table.coded_bits(hist, log2_m);
    let symbols: u64 = hist.iter().sum();
    let mut slots = vec![0u32; hist.len()];
    for (&s, &r) in table.symbols.iter().zip(&table.counts) {
        slots[s as usize] = r as u32;
    }
    let mean_log2_r = if symbols == 0 {
        0.0
    } else {
        hist.iter()
            .zip(&slots)
            .filter(|(&n, _)| n > 0)
            .map(|(&n, &r)| n as f64 * (r as f64).log2())
            .sum::<f64>()
            / symbols as f64
    };
    let lanes = (g.tiles() * LANES) as f64;
    let companion_bits = (g.companion_len() * 32) as f64;
    // The companion array holds log2 M − 8 of each symbol's bits; the ANS words hold the rest.
    let ans_bits = coded_bits - symbols as f64 * g.companion_bits_per_symbol as f64
        + lanes * lane_overhead_bits(g.quartets, 4.0 * mean_log2_r);
    let ans_words = ans_bits / 32.0 + escapes as f64;
    let headers = ans_words / (CHUNK_WORDS - 1) as f64 + g.tiles() as f64;
    let padding = g.tiles() as f64 * (STREAM_ALIGN as f64 - 1.0) / 2.0;
    4.0 * (ans_words + headers + padding)
        + companion_bits / 8.0
        + g.raw_len() as f64
        + 8.0 * g.tiles() as f64
        + 5.0 * table.symbols.len() as f64
}

impl DtansTensor {
    /// Predicted stored bytes of `codes` coded with `coding`, from its exact histogram.
    pub fn predict_bytes(
        payload: Payload,
        rows: usize,
        cols: usize,
        codes: &[u8],
        coding: Coding,
    ) -> Result<f64> {
        let g = Geometry::new(payload, &coding, rows, cols)?;
        let hist = byte_histogram(codes);
        let (coded_as, escaped, pad) = choose_values(payload, &hist, coding.t);
        let escapes = (0..256).filter(|&c| escaped[c]).map(|c| hist[c]).sum();
        let keys = tuple_histogram(
            &g,
            payload,
            codes,
            &hist,
            &coded_as,
            pad,
            coding.key_bits(payload),
        );
        let table = SymbolTable::build(&keys, coding.log2_m)?;
        Ok(predict_bytes(&g, &table, coding.log2_m, &keys, escapes))
    }
}

/// Histograms of code tuples (k = 1, 2, 4) over the unpadded matrix, for ranking codings quickly:
/// made once, they predict every coding of the matrix ([`TupleHistograms::predict`]).
pub struct TupleHistograms {
    codes: [u64; 256],
    pairs: Option<Vec<u64>>,
    quads: Option<Vec<u64>>,
}

impl TupleHistograms {
    /// The histograms of `codes` (rows of `cols`) that the modes of `payload` need.
    pub fn new(payload: Payload, cols: usize, codes: &[u8]) -> TupleHistograms {
        let cb = payload.code_bits();
        TupleHistograms {
            codes: byte_histogram(codes),
            pairs: (2 * cb <= 16).then(|| tuple_counts(codes, cols, 2, cb)),
            quads: (4 * cb <= 16).then(|| tuple_counts(codes, cols, 4, cb)),
        }
    }

    /// [`predict_many`] from these histograms.
    pub fn predict(
        &self,
        payload: Payload,
        rows: usize,
        cols: usize,
        candidates: &[Coding],
    ) -> Result<Vec<(Coding, f64)>> {
        predict_from(self, payload, rows, cols, candidates)
    }
}

fn tuple_counts(codes: &[u8], cols: usize, k: usize, cb: u32) -> Vec<u64> {
    let size = 1usize << (k as u32 * cb);
    codes
        .par_chunks(cols * (1usize << 16).div_ceil(cols))
        .map(|block| {
            let mut h = vec![0u64; size];
            for row in block.chunks(cols) {
                for t in row.chunks_exact(k) {
                    let key = t
                        .iter()
                        .enumerate()
                        .fold(0usize, |a, (j, &c)| a | (c as usize) << (j as u32 * cb));
                    h[key] += 1;
                }
            }
            h
        })
        .reduce(
            || vec![0u64; size],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                a
            },
        )
}

/// Ranking codings needs histograms, not every weight: for large tensors the choice looks at bands
/// of 32 rows spread over the matrix, about this many weights in all.
const CHOICE_SAMPLE: usize = 1 << 22;

/// The coding with the smallest predicted size among the modes, table sizes and kept-value counts
/// this payload allows, for slice width `sc`, and its predicted size (for a large tensor, ranked on
/// a sample of rows and scaled to the whole tensor).
pub fn choose_coding(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
    sc: u32,
) -> Result<(Coding, f64)> {
    payload.validate()?;
    let candidates = candidates(payload, sc);
    if rows * cols <= 2 * CHOICE_SAMPLE || rows < 8 * LANES {
        return choose_among(payload, rows, cols, codes, &candidates);
    }
    let bands = rows / LANES;
    let take = (CHOICE_SAMPLE / (LANES * cols)).clamp(1, bands);
    let mut sample = Vec::with_capacity(take * LANES * cols);
    for b in (0..bands).step_by(bands / take).take(take) {
        sample.extend_from_slice(&codes[b * LANES * cols..(b + 1) * LANES * cols]);
    }
    let sample_rows = sample.len() / cols;
    let (coding, bytes) = choose_among(payload, sample_rows, cols, &sample, &candidates)?;
    let tiles = |r| Geometry::new(payload, &coding, r, cols).map(|g| g.tiles() as f64);
    Ok((coding, bytes * tiles(rows)? / tiles(sample_rows)?))
}

/// [`choose_coding`] over slice widths too: the widest width dividing `cols`
/// ([`default_slice_width`]) and every wider one, whose last slice is padded. Wider slices cost less
/// per-lane overhead, padding costs symbols; for `cols` = 576, say, 128 beats 64.
pub fn choose_coding_and_width(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
) -> Result<(Coding, f64)> {
    let narrowest = default_slice_width(cols);
    let mut best: Option<(Coding, f64)> = None;
    for sc in SLICE_WIDTHS.into_iter().filter(|&sc| sc >= narrowest) {
        // Widths past twice the row only add padding.
        if sc as usize >= 2 * cols && sc > narrowest {
            break;
        }
        let c = choose_coding(payload, rows, cols, codes, sc)?;
        if best.as_ref().is_none_or(|b| c.1 < b.1) {
            best = Some(c);
        }
    }
    Ok(best.expect("the narrowest width is always tried"))
}

/// The codings the choice considers: every mode the payload allows, every table size, and for
/// Pair/Quad as many kept values as the table can combine (t^k ≤ M) and fewer.
fn candidates(payload: Payload, sc: u32) -> Vec<Coding> {
    let mut out = Vec::new();
    for mode in [Mode::Single, Mode::Pair, Mode::Quad] {
        let k = mode.values_per_symbol();
        if k as u32 * payload.code_bits() > 16 {
            continue;
        }
        for log2_m in TABLE_LOG2 {
            if k == 1 {
                out.push(Coding {
                    mode,
                    log2_m,
                    sc,
                    t: None,
                });
                continue;
            }
            let cap = ((1u64 << log2_m) as f64).powf(1.0 / k as f64).floor() as usize;
            for t in [cap, cap * 3 / 4, cap / 2] {
                let c = Coding {
                    mode,
                    log2_m,
                    sc,
                    t: Some(t as u16),
                };
                if t >= 1 && t <= payload.alphabet() && !out.contains(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// The smallest of `candidates` by predicted size, from histograms (no encoding).
fn choose_among(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
    candidates: &[Coding],
) -> Result<(Coding, f64)> {
    predict_many(payload, rows, cols, codes, candidates)?
        .into_iter()
        .fold(None, |best: Option<(Coding, f64)>, c| match best {
            Some(b) if b.1 <= c.1 => Some(b),
            _ => Some(c),
        })
        .ok_or_else(|| {
            CodecError::Unsupported(format!("no dtANS coding fits this {payload:?} tensor"))
        })
}

/// The predicted stored bytes of each of `candidates` that can code this tensor (in their order;
/// codings whose table cannot be built are left out), from histograms shared by all of them: the
/// tuner's size estimate of every variant it considers.
pub fn predict_many(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
    candidates: &[Coding],
) -> Result<Vec<(Coding, f64)>> {
    let cb = payload.code_bits();
    let needs = |k: usize| candidates.iter().any(|c| c.mode.values_per_symbol() == k);
    let th = TupleHistograms {
        codes: byte_histogram(codes),
        pairs: (needs(2) && 2 * cb <= 16).then(|| tuple_counts(codes, cols, 2, cb)),
        quads: (needs(4) && 4 * cb <= 16).then(|| tuple_counts(codes, cols, 4, cb)),
    };
    predict_from(&th, payload, rows, cols, candidates)
}

fn predict_from(
    th: &TupleHistograms,
    payload: Payload,
    rows: usize,
    cols: usize,
    candidates: &[Coding],
) -> Result<Vec<(Coding, f64)>> {
    let cb = payload.code_bits();
    let mut out = Vec::with_capacity(candidates.len());
    for &coding in candidates {
        coding.validate(payload)?;
        let k = coding.mode.values_per_symbol();
        let raw_hist = match coding.mode {
            Mode::Single => None,
            Mode::Pair => th.pairs.as_ref(),
            Mode::Quad => th.quads.as_ref(),
        };
        if k > 1 && raw_hist.is_none() {
            continue;
        }
        let g = Geometry::new(payload, &coding, rows, cols)?;
        let (coded_as, escaped, pad) = choose_values(payload, &th.codes, coding.t);
        let escapes: u64 = (0..256).filter(|&c| escaped[c]).map(|c| th.codes[c]).sum();
        // Map code tuples to coded tuples; padding tuples go to the pad tuple.
        let mut keys = vec![0u64; 1 << coding.key_bits(payload)];
        match raw_hist {
            None => {
                for c in 0..payload.alphabet() {
                    keys[coded_as[c] as usize] += th.codes[c];
                }
            }
            Some(h) => {
                let mask = (1usize << cb) - 1;
                for (key, &n) in h.iter().enumerate().filter(|(_, &n)| n > 0) {
                    let mapped = (0..k).fold(0usize, |a, j| {
                        a | (coded_as[(key >> (j as u32 * cb)) & mask] as usize) << (j as u32 * cb)
                    });
                    keys[mapped] += n;
                }
            }
        }
        let counted = (rows * (cols / k)) as u64;
        let total = (g.bands * LANES * g.slices * g.sc / k) as u64;
        let pad_key = (0..k).fold(0usize, |a, j| a | (pad as usize) << (j as u32 * cb));
        keys[pad_key] += total - counted;
        let Ok(table) = SymbolTable::build(&keys, coding.log2_m) else {
            continue;
        };
        out.push((
            coding,
            predict_bytes(&g, &table, coding.log2_m, &keys, escapes),
        ));
    }
    Ok(out)
}

/// The widest slice width that divides `cols` (fewest per-lane overheads), else the widest that
/// wastes least padding.
pub fn default_slice_width(cols: usize) -> u32 {
    if let Some(&sc) = SLICE_WIDTHS
        .iter()
        .rev()
        .find(|&&sc| cols.is_multiple_of(sc as usize))
    {
        return sc;
    }
    *SLICE_WIDTHS
        .iter()
        .rev()
        .min_by_key(|&&sc| cols.next_multiple_of(sc as usize) - cols)
        .unwrap()
}
