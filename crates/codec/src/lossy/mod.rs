//! Lossy coding at a named rate: rows normalised by their RMS, quantised by a [`Quantizer`] (E8
//! lattice as EntroPack, or entropy-coded TCQ), the integer fields coded by tiled rANS under shared
//! tables, one FP32 scale per row fitted by least squares to the chosen points.
//!
//! The step is chosen by a secant search on a size estimate from sampled complete rows (the seed's
//! §3.4), and then corrected on the whole tensor's real size, so the stored rate — every byte counted, see
//! [`LossyTensor::to_bytes`] — lands within a fraction of a percent of the target.
//!
//! Tiles are whole rows (at least [`TILE_WEIGHTS`] weights by default, [`Options::tile_weights`]),
//! so one warp decoding a tile owns complete outputs of a fused matrix-vector product. Smaller
//! tiles give a GPU more tiles to decode at once, at 32 states (132 bytes) a tile.

pub mod e8;
pub mod gptq;
pub mod low;
pub mod rans;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod tcq;

use crate::{CodecError, Result};
use rans::{DecodeTable, Reader, Sym, Table, LANES, STATE_MIN};
use rayon::prelude::*;

/// Weights a tile holds at least (whole rows), by default.
pub const TILE_WEIGHTS: usize = 32768;
/// The smallest [`Options::tile_weights`] (the largest is [`TILE_WEIGHTS`]); a stored tile holds
/// fewer than 2 × [`TILE_WEIGHTS`] weights, or one row.
pub const MIN_TILE_WEIGHTS: usize = 1024;
/// Smallest and largest step the search considers (units of a row's RMS).
const STEP_RANGE: (f64, f64) = (1e-3, 8.0);
const MAGIC: &[u8; 4] = b"ELY1";
/// Wider rows than this are hostile (no model has them); rows are bounded by the 4 bytes of scale
/// each one stores.
const MAX_COLS: usize = 1 << 20;
/// Fields larger than this are hostile: every real coded value is far smaller.
const FIELD_LIMIT: i64 = 1 << 24;

/// How rows are quantised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantizer {
    /// Blocks of eight on the E8 lattice (EntroPack).
    E8,
    /// Entropy-coded TCQ with 2^log2_states trellis states.
    Tcq { log2_states: u8 },
}

impl Quantizer {
    fn method(self) -> Box<dyn Method> {
        match self {
            Quantizer::E8 => Box::new(e8::E8),
            Quantizer::Tcq { log2_states } => Box::new(tcq::Tcq::new(log2_states)),
        }
    }
    /// Rows must have a multiple of this many columns.
    pub fn row_multiple(self) -> usize {
        self.method().item()
    }
    fn code(self) -> (u8, u8) {
        match self {
            Quantizer::E8 => (0, 0),
            Quantizer::Tcq { log2_states } => (1, log2_states),
        }
    }
    fn from_code(kind: u8, arg: u8) -> Result<Quantizer> {
        match (kind, arg) {
            (0, 0) => Ok(Quantizer::E8),
            (1, s) if tcq::LOG2_STATES.contains(&s) => Ok(Quantizer::Tcq { log2_states: s }),
            _ => Err(CodecError::Corrupt(format!(
                "unknown lossy quantiser {kind}/{arg}"
            ))),
        }
    }
}

impl std::fmt::Display for Quantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Quantizer::E8 => write!(f, "e8"),
            Quantizer::Tcq { log2_states } => write!(f, "tcq{}", 1u32 << log2_states),
        }
    }
}

impl std::str::FromStr for Quantizer {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "e8" {
            return Ok(Quantizer::E8);
        }
        let n: u32 = s
            .strip_prefix("tcq")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("unknown quantiser {s:?}: use e8 or tcqN (N = 4 … 256)"))?;
        let l = n.trailing_zeros() as u8;
        if !n.is_power_of_two() || !tcq::LOG2_STATES.contains(&l) {
            return Err(format!(
                "tcq{n}: states must be a power of two from 4 to 256"
            ));
        }
        Ok(Quantizer::Tcq { log2_states: l })
    }
}

/// Encoder settings.
#[derive(Clone, Debug)]
pub struct Options {
    /// Target stored bits per weight, every byte of the stored form counted.
    pub bits: f64,
    pub quantizer: Quantizer,
    /// Table precision; `None` searches from 11 bits (12 above 7 bits a weight) and keeps the
    /// smallest precision within 0.1 % of the best size.
    pub prob_bits: Option<u8>,
    /// Weights of sampled rows the step search quantises per candidate.
    pub sample_weights: usize,
    /// Most size estimates the step search makes.
    pub search_steps: u32,
    /// TCQ: weight of the rate term in the trellis search against the slope the distortion predicts
    /// (0: least squared error). It buys about 0.015 bit on heavy-tailed rows at 1–1.5 bits a weight
    /// and nothing measurable on Gaussian ones, at twice the encode time.
    pub rate_weight: f32,
    /// Weights a tile holds at least (whole rows), [`MIN_TILE_WEIGHTS`]..=[`TILE_WEIGHTS`].
    pub tile_weights: usize,
    /// Per input column, how much its squared error counts (the activation energy a calibration
    /// text gives: the diagonal of the layer's input Hessian). The row scale fit, the TCQ search
    /// and the per-row RDO then minimise the weighted error, which is the layer's output error.
    /// None: every column alike.
    pub col_weights: Option<Vec<f32>>,
    /// Per-row rate–distortion optimisation: each row takes the step multiplier, of this many
    /// geometric candidates in [`RDO_RANGE`], that minimises its error (absolute, not relative to
    /// the row) plus λ·bits under the tensor's code model; 0 or 1: off.
    pub rdo: usize,
}

/// The step multipliers the per-row RDO chooses between.
pub const RDO_RANGE: (f64, f64) = (0.70, 1.45);

impl Options {
    pub fn new(bits: f64, quantizer: Quantizer) -> Options {
        Options {
            bits,
            quantizer,
            prob_bits: None,
            sample_weights: 1 << 21,
            search_steps: 12,
            rate_weight: 0.0,
            tile_weights: TILE_WEIGHTS,
            col_weights: None,
            rdo: 0,
        }
    }
}

/// Per-table code lengths for a rate-aware search.
pub struct RateModel {
    pub lambda: f32,
    mins: Vec<i32>,
    lengths: Vec<Vec<f32>>,
}

impl RateModel {
    /// Bits of value `k` in table `t`; values outside the table cost as much as its rarest one, plus
    /// a margin.
    #[inline]
    pub fn bits(&self, t: usize, k: i32) -> f32 {
        let l = &self.lengths[t];
        let i = k - self.mins[t];
        if i >= 0 && (i as usize) < l.len() {
            l[i as usize]
        } else {
            l.iter().copied().fold(0.0, f32::max) + 2.0
        }
    }

    fn from_counts(counts: &[(i32, Vec<u64>)], lambda: f32) -> RateModel {
        let mut mins = vec![];
        let mut lengths = vec![];
        for (min, c) in counts {
            let total: u64 = c.iter().sum::<u64>().max(1);
            let width = c.len() as f64;
            mins.push(*min);
            // Add-half smoothing, so a value the sample never saw is not free or forbidden.
            lengths.push(
                c.iter()
                    .map(|&n| -(((n as f64 + 0.5) / (total as f64 + 0.5 * width)).log2()) as f32)
                    .collect(),
            );
        }
        RateModel {
            lambda,
            mins,
            lengths,
        }
    }
}

/// A symbol in decoder order: value, table, lane.
#[derive(Clone, Copy)]
pub struct CSym {
    pub value: i32,
    pub table: u8,
    pub lane: u8,
}

/// What quantising one tile gives: its symbols in decoder order and per-row sums for the scale fit.
#[derive(Default)]
pub struct TileCode {
    pub syms: Vec<CSym>,
    /// Per row: Σ x·q and Σ q² (x normalised, q the chosen points).
    pub row_num: Vec<f64>,
    pub row_den: Vec<f64>,
}

impl TileCode {
    #[inline]
    pub fn push(&mut self, table: u8, value: i32, lane: u8) {
        self.syms.push(CSym { value, table, lane });
    }
}

/// One quantiser: how a tile becomes symbols, and how symbols become points again.
pub trait Method: Sync + Send {
    fn tables(&self) -> usize;
    /// Weights per coded item (the row length must be a multiple).
    fn item(&self) -> usize;
    fn quantize_tile(
        &self,
        xn: &[f32],
        cols: usize,
        step: f32,
        col_weights: Option<&[f32]>,
        model: Option<&RateModel>,
        code: &mut TileCode,
    );
    /// Decodes a tile's points (unscaled) into `out`, reading words after each step.
    fn decode_tile(
        &self,
        dec: &Decoder,
        x: &mut [u32; LANES],
        r: &mut Reader,
        out: &mut [f32],
    ) -> Result<()>;
    /// The trellis's next-state table (`next[2·state + branch]`), for quantisers with one.
    fn trellis(&self) -> Option<Vec<u16>> {
        None
    }
    /// [`Method::decode_tile`] with AVX2, the same points and the same errors; `None` where there is
    /// no vector decode (this quantiser, or this CPU: the decoder built no [`simd::Flat`]).
    #[cfg(target_arch = "x86_64")]
    fn decode_tile_simd(
        &self,
        _dec: &Decoder,
        _x: &mut [u32; LANES],
        _r: &mut Reader,
        _out: &mut [f32],
    ) -> Option<Result<()>> {
        None
    }
}

/// Which decoder a tile's points come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecodePath {
    /// The scalar reference.
    #[cfg_attr(not(test), allow(dead_code))]
    Scalar,
    /// AVX2 where the CPU has it (else the scalar reference).
    Vector,
}

/// A [`Decoder`]'s tables laid out flat for a GPU decoder: table `t`'s slot `s` at
/// `t · 2^prob_bits + s` (`slot`: symbol index | (frequency − 1) << 16; `bias`: the slot's distance
/// from its symbol's first slot), each table's smallest value, and the trellis's next states
/// (empty for E8).
#[derive(Clone, Debug, PartialEq)]
pub struct FlatTables {
    pub prob_bits: u8,
    pub mins: Vec<i32>,
    pub slot: Vec<u32>,
    pub bias: Vec<u16>,
    pub next: Vec<u16>,
}

/// What decoding a tensor needs besides its payload: its quantiser and decoder tables, built once
/// ([`LossyTensor::decoder`]) and kept by whoever multiplies by the matrix repeatedly.
pub struct Decoder {
    method: Box<dyn Method>,
    pub(crate) prob_bits: u8,
    pub(crate) tables: Vec<DecodeTable>,
    /// The tables for the AVX2 decode, built only where the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    pub(crate) simd: Option<simd::Flat>,
}

impl Decoder {
    /// [`FlatTables`] of these tables.
    pub fn flat(&self) -> FlatTables {
        FlatTables {
            prob_bits: self.prob_bits,
            mins: self.tables.iter().map(|t| t.min).collect(),
            slot: self
                .tables
                .iter()
                .flat_map(|t| t.slot.iter().copied())
                .collect(),
            bias: self
                .tables
                .iter()
                .flat_map(|t| t.bias.iter().copied())
                .collect(),
            next: self.method.trellis().unwrap_or_default(),
        }
    }
}

/// `n` zeros, or `None` where the allocator cannot give them. Zeroed memory is asked for as such
/// (as `vec![0.0; n]` does), so its pages are first touched by the decode that fills them.
fn zeroed(n: usize) -> Option<Vec<f32>> {
    let layout = std::alloc::Layout::array::<f32>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size; all-zero bits are 0.0f32; a non-null pointer from
    // `alloc_zeroed` with this layout is what `Vec::from_raw_parts` takes for `n` elements of
    // capacity `n`.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut f32;
        (!p.is_null()).then(|| Vec::from_raw_parts(p, n, n))
    }
}

/// A lossy-coded matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct LossyTensor {
    pub rows: usize,
    pub cols: usize,
    pub quantizer: Quantizer,
    pub prob_bits: u8,
    pub tile_rows: usize,
    pub tables: Vec<Table>,
    /// Per row: weight = scale · point.
    pub scales: Vec<f32>,
    /// Per tile, the decoder's 32 initial states.
    pub states: Vec<u32>,
    /// Per tile, its first payload word; one more at the end.
    pub offsets: Vec<u32>,
    pub payload: Vec<u16>,
}

/// What an encode measured.
#[derive(Clone, Debug)]
pub struct EncodeReport {
    pub step: f64,
    /// The sampled estimate at the chosen step, bits a weight.
    pub estimate: f64,
    /// Whole-tensor encodes it took (1 = the estimate was close enough).
    pub passes: u32,
}

fn tile_rows_for(cols: usize, tile_weights: usize) -> usize {
    tile_weights.div_ceil(cols.max(1))
}

/// Rows normalised by their RMS (f64 sums), and the RMS.
fn normalise(w: &[f32], cols: usize) -> (Vec<f32>, Vec<f32>) {
    let mut xn = vec![0f32; w.len()];
    let rms: Vec<f32> = xn
        .par_chunks_mut(cols)
        .zip(w.par_chunks(cols))
        .map(|(o, r)| {
            let ss: f64 = r.iter().map(|&v| v as f64 * v as f64).sum();
            let rms = ((ss / cols as f64).sqrt() as f32).max(1e-30);
            for (o, &v) in o.iter_mut().zip(r) {
                *o = v / rms;
            }
            rms
        })
        .collect();
    (xn, rms)
}

/// Rows of the step search: a permutation seeded by the shape, whole tiles' worth.
fn sample_rows(rows: usize, cols: usize, want: usize, tile_rows: usize) -> Vec<usize> {
    let n = want.div_ceil(cols).div_ceil(tile_rows) * tile_rows;
    let mut idx: Vec<usize> = (0..rows).collect();
    if n >= rows {
        return idx;
    }
    let mut r = crate::rng::SplitMix64::new((rows as u64) * 1_000_003 + cols as u64);
    for i in 0..n {
        let j = i + r.below((rows - i) as u64) as usize;
        idx.swap(i, j);
    }
    idx.truncate(n);
    idx.sort_unstable();
    idx
}

/// Histograms per table over tiles' symbols: (min, counts from min).
fn histograms(codes: &[TileCode], tables: usize) -> Vec<(i32, Vec<u64>)> {
    let mut lo = vec![i32::MAX; tables];
    let mut hi = vec![i32::MIN; tables];
    for c in codes {
        for s in &c.syms {
            let t = s.table as usize;
            lo[t] = lo[t].min(s.value);
            hi[t] = hi[t].max(s.value);
        }
    }
    let mut h: Vec<(i32, Vec<u64>)> = (0..tables)
        .map(|t| {
            if lo[t] > hi[t] {
                (0, vec![])
            } else {
                (
                    lo[t],
                    vec![0u64; (hi[t] as i64 - lo[t] as i64 + 1) as usize],
                )
            }
        })
        .collect();
    for c in codes {
        for s in &c.syms {
            let (min, v) = &mut h[s.table as usize];
            v[(s.value - *min) as usize] += 1;
        }
    }
    h
}

/// Stored bytes other than the payload and the tables.
fn fixed_bytes(rows: usize, tiles: usize) -> usize {
    header_bytes() + 4 * rows + tiles * (4 * LANES + 4) + 4
}

const fn header_bytes() -> usize {
    4 + 4 + 4 * 4
}

/// Tables for the histograms, or the largest alphabet if one does not fit 2^prob_bits.
fn build_tables(h: &[(i32, Vec<u64>)], prob_bits: u8) -> std::result::Result<Vec<Table>, usize> {
    let widest = h.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
    if widest > 1 << prob_bits {
        return Err(widest);
    }
    Ok(h.iter()
        .map(|(min, c)| {
            if c.is_empty() {
                Table {
                    min: 0,
                    freqs: vec![],
                }
            } else {
                Table::build(*min, c, prob_bits).expect("fits")
            }
        })
        .collect())
}

struct Sized {
    /// Payload plus tables, bits (payload net of what the final states carry).
    payload_bits: f64,
    table_bytes: usize,
}

fn size_of(h: &[(i32, Vec<u64>)], tables: &[Table], prob_bits: u8, tiles: usize) -> Sized {
    let bits: f64 = h
        .iter()
        .zip(tables)
        .map(|((_, c), t)| t.coded_bits(c, prob_bits))
        .sum();
    // A lane's final state holds about 16 bits the payload does not.
    Sized {
        payload_bits: (bits - (16 * LANES * tiles) as f64).max(0.0),
        table_bytes: tables.iter().map(Table::stored_bytes).sum(),
    }
}

impl LossyTensor {
    /// Codes `w` (`rows × cols`, row-major) at `opts.bits` stored bits a weight.
    pub fn encode(
        w: &[f32],
        rows: usize,
        cols: usize,
        opts: &Options,
    ) -> Result<(LossyTensor, EncodeReport)> {
        let method = opts.quantizer.method();
        let hw = check_input(w, rows, cols, opts, method.as_ref())?;
        let hw = hw.as_deref();
        let (mut xn, mut rms) = normalise(w, cols);
        let tile_rows = tile_rows_for(cols, opts.tile_weights);
        let tiles = rows.div_ceil(tile_rows);
        let n = (rows * cols) as f64;
        let mut prob_bits = opts
            .prob_bits
            .unwrap_or(if opts.bits <= 7.0 { 11 } else { 12 });
        if !rans::PROB_BITS.contains(&prob_bits) {
            return Err(CodecError::Unsupported(format!(
                "table precision {prob_bits} bits: use 9 to 15"
            )));
        }
        let fixed = fixed_bytes(rows, tiles) as f64;

        let sample = sample_rows(rows, cols, opts.sample_weights, tile_rows);
        let mut xs = Vec::with_capacity(sample.len() * cols);
        for &r in &sample {
            xs.extend_from_slice(&xn[r * cols..(r + 1) * cols]);
        }
        let ns = xs.len() as f64;
        let quantize = |x: &[f32], step: f64, model: Option<&RateModel>| -> Vec<TileCode> {
            quantize_tiles(method.as_ref(), x, cols, tile_rows, step, hw, model)
        };
        // The rate-aware model for a step: code lengths from a nearest-point pass on the sample,
        // λ from the distortion that pass measured (the slope of D(R) is 2 ln 2 · D).
        let model_at = |step: f64| -> Option<RateModel> {
            if !matches!(opts.quantizer, Quantizer::Tcq { .. }) || opts.rate_weight <= 0.0 {
                return None;
            }
            let codes = quantize(&xs, step, None);
            let h = histograms(&codes, method.tables());
            let d = distortion_units(&xs, cols, &codes, step, hw);
            Some(RateModel::from_counts(
                &h,
                opts.rate_weight * 2.0 * std::f32::consts::LN_2 * d as f32,
            ))
        };
        // Estimated stored bits a weight at a step (and the codes, when they are the tensor's).
        // When the sample is every row, the search's last quantisation is the tensor's.
        let whole = sample.len() == rows;
        let estimate = |step: f64, prob_bits: u8| -> (f64, Option<Vec<TileCode>>) {
            let model = model_at(step);
            let codes = quantize(&xs, step, model.as_ref());
            let h = histograms(&codes, method.tables());
            let widest = h.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
            let b = prob_bits.max(needed_bits(widest).min(15));
            let tables = match build_tables(&h, b) {
                Ok(t) => t,
                Err(_) => return (f64::INFINITY, None),
            };
            let sample_tiles = sample.len().div_ceil(tile_rows);
            let s = size_of(&h, &tables, b, sample_tiles);
            let bits = s.payload_bits / ns * n + 8.0 * (s.table_bytes as f64 + fixed);
            (bits / n, whole.then_some(codes))
        };

        // Secant search on log2(step), kept inside a bracket: at high rate the rate falls by one bit a
        // weight per doubling of the step, so a few estimates reach the target.
        let target = opts.bits;
        let tol = 5e-4 * target;
        let mut lo = (STEP_RANGE.0.log2(), f64::INFINITY);
        let mut hi = (STEP_RANGE.1.log2(), f64::NEG_INFINITY);
        let mut l = (1.5 - target).clamp(lo.0, hi.0);
        let mut found = (l, f64::INFINITY);
        let mut found_codes = None;
        for _ in 0..opts.search_steps {
            let (r, codes) = estimate(l.exp2(), prob_bits);
            if (r - target).abs() < (found.1 - target).abs() {
                found = (l, r);
                found_codes = codes;
            }
            if (r - target).abs() <= tol {
                break;
            }
            if r > target {
                lo = (l, r);
            } else {
                hi = (l, r);
            }
            let mut next = if lo.1.is_finite() && hi.1.is_finite() {
                lo.0 + (lo.1 - target) / (lo.1 - hi.1) * (hi.0 - lo.0)
            } else if r.is_finite() {
                l + (r - target)
            } else {
                l + 1.0
            };
            // Stay strictly inside the bracket, away from its ends.
            let (a, b) = (lo.0, hi.0);
            let margin = 0.05 * (b - a);
            if !(next > a + margin && next < b - margin) {
                next = 0.5 * (a + b);
            }
            l = next;
        }
        let mut step = found.0.exp2();
        let est = found.1;
        if opts.rdo > 1 {
            let m = row_multipliers(
                method.as_ref(),
                &xn,
                &rms,
                cols,
                &sample,
                step,
                hw,
                opts.rdo,
            );
            for ((row, r), m) in xn.chunks_exact_mut(cols).zip(&mut rms).zip(m) {
                for v in row {
                    *v /= m;
                }
                *r *= m;
            }
            // The rows moved: the passes below requantise them and correct the rate.
            found_codes = None;
        }

        let mut passes = 0;
        let mut best: Option<(f64, f64, LossyTensor)> = None;
        loop {
            passes += 1;
            let codes = match found_codes.take() {
                Some(c) => c,
                None => quantize(&xn, step, model_at(step).as_ref()),
            };
            let h = histograms(&codes, method.tables());
            let tables = if opts.prob_bits.is_some() {
                build_tables(&h, prob_bits).ok()
            } else {
                // The smallest precision within 0.1 % of the best size: finer tables price rare
                // values better, coarser ones are cheaper to hold in a decoder's shared memory.
                let sized: Vec<(u8, f64, Vec<Table>)> = (prob_bits..=15)
                    .filter_map(|b| {
                        let t = build_tables(&h, b).ok()?;
                        let s = size_of(&h, &t, b, tiles);
                        Some((b, s.payload_bits + 8.0 * s.table_bytes as f64, t))
                    })
                    .collect();
                let best = sized.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
                sized
                    .into_iter()
                    .find(|s| s.1 <= best * 1.001)
                    .map(|(b, _, t)| {
                        prob_bits = b;
                        t
                    })
            };
            let Some(tables) = tables else {
                // The largest table tried is too small: coarsen the step until the alphabet fits.
                let widest = h.iter().map(|(_, c)| c.len()).max().unwrap_or(1);
                let slots = match opts.prob_bits {
                    Some(b) => 1u64 << b,
                    None => 1 << *rans::PROB_BITS.end(),
                };
                step *= widest as f64 / slots as f64 * 1.05;
                if passes > 8 {
                    return Err(CodecError::Unsupported(
                        "the values' range is too wide for a lossy table at this rate".into(),
                    ));
                }
                continue;
            };
            let t = assemble(
                opts.quantizer,
                rows,
                cols,
                tile_rows,
                prob_bits,
                &rms,
                &codes,
                tables,
            )?;
            let rate = t.bits_per_weight();
            let off = rate / opts.bits - 1.0;
            let closer = best
                .as_ref()
                .is_none_or(|(r, _, _)| (rate - opts.bits).abs() < (r - opts.bits).abs());
            if closer {
                best = Some((rate, step, t));
            }
            // A rate per weight moves by about one bit when the step halves.
            if off.abs() <= 1e-3 || passes >= 3 {
                break;
            }
            step *= (rate - opts.bits).exp2();
        }
        let (_, step, t) = best.expect("one pass");
        Ok((
            t,
            EncodeReport {
                step,
                estimate: est,
                passes,
            },
        ))
    }

    /// Points of this matrix's rate–distortion curve, estimated on sampled rows (about
    /// `opts.sample_weights` weights) with no row RDO: (stored bits a weight, every byte counted as
    /// [`encode`](Self::encode) counts them; weighted squared error over weighted energy, with
    /// `opts.col_weights`), at steps half a bit apart, spanning at least `bits.0..=bits.1`.
    /// `opts.bits` is not used. What an allocation of rates across tensors prices them by.
    pub fn rd_curve(
        w: &[f32],
        rows: usize,
        cols: usize,
        opts: &Options,
        bits: (f64, f64),
    ) -> Result<Vec<(f64, f64)>> {
        let method = opts.quantizer.method();
        let hw = check_input(
            w,
            rows,
            cols,
            &Options {
                bits: bits.0.clamp(0.05, 16.0),
                ..opts.clone()
            },
            method.as_ref(),
        )?;
        let hw = hw.as_deref();
        let tile_rows = tile_rows_for(cols, opts.tile_weights);
        let sample = sample_rows(rows, cols, opts.sample_weights, tile_rows);
        let mut xs = Vec::with_capacity(sample.len() * cols);
        let mut s2 = Vec::with_capacity(sample.len());
        for &r in &sample {
            let (x, rms) = normalise(&w[r * cols..(r + 1) * cols], cols);
            xs.extend_from_slice(&x);
            s2.push(rms[0] as f64 * rms[0] as f64);
        }
        let energy: f64 = xs
            .chunks_exact(cols)
            .zip(&s2)
            .map(|(x, s2)| s2 * fitted_error(x, hw, 0.0, 0.0))
            .sum();
        let n = (rows * cols) as f64;
        let fixed = fixed_bytes(rows, rows.div_ceil(tile_rows)) as f64;
        let sample_tiles = sample.len().div_ceil(tile_rows);
        // The rate falls by about a bit a weight per doubling of the step, from about 1.5 − log2(step)
        // (the step search's start); a bit of margin each side.
        let (l_lo, l_hi) = (1.5 - bits.1 - 1.5, 1.5 - bits.0 + 1.5);
        let steps = ((l_hi - l_lo) / 0.5).ceil() as usize + 1;
        let mut out = vec![];
        for i in 0..steps {
            let l = (l_lo + 0.5 * i as f64).clamp(STEP_RANGE.0.log2(), STEP_RANGE.1.log2());
            let codes = quantize_tiles(method.as_ref(), &xs, cols, tile_rows, l.exp2(), hw, None);
            let h = histograms(&codes, method.tables());
            let widest = h.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
            let b = needed_bits(widest).clamp(11, 15);
            let Ok(tables) = build_tables(&h, b) else {
                continue;
            };
            let sz = size_of(&h, &tables, b, sample_tiles);
            let rate =
                (sz.payload_bits / xs.len() as f64 * n + 8.0 * (sz.table_bytes as f64 + fixed)) / n;
            let err: f64 = codes
                .iter()
                .flat_map(|c| c.row_num.iter().zip(&c.row_den))
                .zip(xs.chunks_exact(cols).zip(&s2))
                .map(|((&num, &den), (x, s2))| s2 * fitted_error(x, hw, num, den))
                .sum();
            out.push((rate, if energy > 0.0 { err / energy } else { 0.0 }));
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        out.dedup_by(|a, b| a.0 == b.0);
        Ok(out)
    }

    /// Stored bits a weight.
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / (self.rows * self.cols) as f64
    }

    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(self.tile_rows)
    }

    /// Size of [`LossyTensor::to_bytes`].
    pub fn stored_bytes(&self) -> usize {
        fixed_bytes(self.rows, self.tiles())
            + self.tables.iter().map(Table::stored_bytes).sum::<usize>()
            + 2 * self.payload.len()
    }

    /// This tensor's [`Decoder`].
    pub fn decoder(&self) -> Result<Decoder> {
        let tables = self
            .tables
            .iter()
            .map(|t| {
                if t.freqs.is_empty() {
                    // A table no symbol uses: any valid one serves (it is never read).
                    DecodeTable::new(
                        &Table {
                            min: 0,
                            freqs: vec![1 << (self.prob_bits - 1); 2],
                        },
                        self.prob_bits,
                    )
                } else {
                    DecodeTable::new(t, self.prob_bits)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let method = self.quantizer.method();
        #[cfg(target_arch = "x86_64")]
        let simd = simd::available()
            .then(|| simd::Flat::new(&tables, self.prob_bits, method.trellis().as_deref()));
        Ok(Decoder {
            method,
            prob_bits: self.prob_bits,
            tables,
            #[cfg(target_arch = "x86_64")]
            simd,
        })
    }

    /// Rows of tile `tile`: `tile · tile_rows ..` up to `tile_rows` of them (fewer in the last).
    pub fn tile_row_range(&self, tile: usize) -> std::ops::Range<usize> {
        let r0 = tile * self.tile_rows;
        r0..(r0 + self.tile_rows).min(self.rows)
    }

    /// Decodes tile `tile`'s weights (its rows, point · row scale, row-major) into `out`, which
    /// holds exactly those rows: what a fused product decodes one tile at a time, never holding
    /// more of the matrix. `dec` is this tensor's [`decoder`](Self::decoder).
    pub fn decode_tile(&self, dec: &Decoder, tile: usize, out: &mut [f32]) -> Result<()> {
        let rows = self.tile_row_range(tile);
        if tile >= self.tiles() || out.len() != rows.len() * self.cols {
            return Err(CodecError::Shape(format!(
                "tile {tile} of {} ({} rows of {}) into {} values",
                self.tiles(),
                rows.len(),
                self.cols,
                out.len()
            )));
        }
        self.decode_points_into(dec, tile, out)?;
        let row0 = tile * self.tile_rows;
        for (i, row) in out.chunks_exact_mut(self.cols).enumerate() {
            let s = self.scales[row0 + i];
            for v in row {
                *v *= s;
            }
        }
        Ok(())
    }

    /// Decodes tile `tile`'s points (the quantiser's reconstruction, unscaled) into `out`.
    fn decode_points_into(&self, dec: &Decoder, tile: usize, out: &mut [f32]) -> Result<()> {
        self.decode_points_with(dec, tile, out, DecodePath::Vector)
    }

    /// [`decode_points_into`](Self::decode_points_into) by the decoder `path` asks for.
    pub(crate) fn decode_points_with(
        &self,
        dec: &Decoder,
        tile: usize,
        out: &mut [f32],
        path: DecodePath,
    ) -> Result<()> {
        let (a, b) = (self.offsets[tile] as usize, self.offsets[tile + 1] as usize);
        let mut r = Reader {
            words: &self.payload[a..b],
            pos: 0,
        };
        let mut x = [0u32; LANES];
        x.copy_from_slice(&self.states[tile * LANES..(tile + 1) * LANES]);
        let vector = match path {
            #[cfg(target_arch = "x86_64")]
            DecodePath::Vector => dec.method.decode_tile_simd(dec, &mut x, &mut r, out),
            _ => None,
        };
        match vector {
            Some(done) => done?,
            None => dec.method.decode_tile(dec, &mut x, &mut r, out)?,
        }
        if r.pos != r.words.len() || x.iter().any(|&s| s != STATE_MIN) {
            return Err(CodecError::Corrupt(format!(
                "tile {tile} does not decode to its end (payload or states damaged)"
            )));
        }
        Ok(())
    }

    /// The reconstructed matrix, row-major f32.
    pub fn decode(&self) -> Result<Vec<f32>> {
        let dec = self.decoder()?;
        // A small stored form can hold a huge matrix (rows of one value cost no payload), so the
        // size is asked of the allocator, not trusted: too large is an error, not an abort.
        let n = self.rows * self.cols;
        let mut out = zeroed(n).ok_or_else(|| {
            CodecError::Unsupported(format!(
                "a {} × {} matrix decodes to {:.1} GB of f32, more memory than can be had",
                self.rows,
                self.cols,
                n as f64 * 4e-9
            ))
        })?;
        out.par_chunks_mut(self.tile_rows * self.cols)
            .enumerate()
            .try_for_each(|(t, o)| self.decode_tile(&dec, t, o))?;
        Ok(out)
    }

    /// The stored form, little-endian: magic "ELY1", quantiser kind and argument, table precision, a
    /// zero byte; rows, cols, tile rows, table count (u32); per table min (i32), alphabet (u32) and
    /// frequencies (u16); row scales (f32); 32 states (u32) per tile; tiles + 1 payload offsets (u32,
    /// in words); the payload (u16).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.stored_bytes());
        b.extend_from_slice(MAGIC);
        let (k, a) = self.quantizer.code();
        b.extend_from_slice(&[k, a, self.prob_bits, 0]);
        for v in [self.rows, self.cols, self.tile_rows, self.tables.len()] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        for t in &self.tables {
            b.extend_from_slice(&t.min.to_le_bytes());
            b.extend_from_slice(&(t.freqs.len() as u32).to_le_bytes());
            for f in &t.freqs {
                b.extend_from_slice(&f.to_le_bytes());
            }
        }
        for s in &self.scales {
            b.extend_from_slice(&s.to_le_bytes());
        }
        for v in self.states.iter().chain(&self.offsets) {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for w in &self.payload {
            b.extend_from_slice(&w.to_le_bytes());
        }
        debug_assert_eq!(b.len(), self.stored_bytes());
        b
    }

    /// Reads and checks a stored form: every length, table, state and offset is validated, so
    /// decoding it cannot panic or run away; damage inside the payload is caught by the decoder.
    pub fn from_bytes(b: &[u8]) -> Result<LossyTensor> {
        let mut r = Cursor { b, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err(CodecError::Corrupt("not a lossy tensor (bad magic)".into()));
        }
        let h = r.take(4)?;
        let quantizer = Quantizer::from_code(h[0], h[1])?;
        let prob_bits = h[2];
        if !rans::PROB_BITS.contains(&prob_bits) || h[3] != 0 {
            return Err(CodecError::Corrupt(format!("table precision {prob_bits}")));
        }
        let rows = r.u32()? as usize;
        let cols = r.u32()? as usize;
        let tile_rows = r.u32()? as usize;
        let ntab = r.u32()? as usize;
        let method = quantizer.method();
        if rows == 0 || cols == 0 || cols > MAX_COLS || !cols.is_multiple_of(method.item()) {
            return Err(CodecError::Corrupt(format!("shape {rows} × {cols}")));
        }
        // Whole rows, fewer than 2 × TILE_WEIGHTS weights (or one row): what encode makes.
        if tile_rows == 0 || (tile_rows > 1 && tile_rows * cols >= 2 * TILE_WEIGHTS) {
            return Err(CodecError::Corrupt(format!(
                "{tile_rows} rows a tile for {cols} columns"
            )));
        }
        if ntab != method.tables() {
            return Err(CodecError::Corrupt(format!(
                "{ntab} tables for {quantizer}"
            )));
        }
        let mut tables = Vec::with_capacity(ntab);
        for _ in 0..ntab {
            let min = r.u32()? as i32;
            let len = r.u32()? as usize;
            if len > 1 << prob_bits
                || (min as i64).abs() > FIELD_LIMIT
                || (min as i64 + len as i64).abs() > FIELD_LIMIT
            {
                return Err(CodecError::Corrupt(format!(
                    "a table of {len} values from {min}"
                )));
            }
            let freqs = (0..len).map(|_| r.u16()).collect::<Result<Vec<_>>>()?;
            let t = Table { min, freqs };
            if len > 0 {
                t.validate(prob_bits)?;
            }
            tables.push(t);
        }
        if quantizer == Quantizer::E8
            && (tables[0].min < 0 || tables[0].min as usize + tables[0].freqs.len() > 2)
        {
            return Err(CodecError::Corrupt(
                "the coset table holds values other than 0 and 1".into(),
            ));
        }
        let tiles = rows.div_ceil(tile_rows);
        let need = rows
            .checked_mul(cols)
            .and_then(|_| rows.checked_mul(4))
            .and_then(|s| s.checked_add(tiles * (4 * LANES + 4) + 4))
            .ok_or_else(|| CodecError::Corrupt("shape overflows".into()))?;
        if need > b.len() - r.pos.min(b.len()) {
            return Err(CodecError::Corrupt(format!(
                "truncated: {} bytes left for {need} bytes of scales, states and offsets",
                b.len() - r.pos
            )));
        }
        let scales = (0..rows).map(|_| r.f32()).collect::<Result<Vec<_>>>()?;
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            return Err(CodecError::Corrupt(format!(
                "row {i}'s scale is not finite"
            )));
        }
        let states = (0..tiles * LANES)
            .map(|_| r.u32())
            .collect::<Result<Vec<_>>>()?;
        if states.iter().any(|&s| s < STATE_MIN) {
            return Err(CodecError::Corrupt("a tile's state is below 2^16".into()));
        }
        let offsets = (0..=tiles).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        if offsets[0] != 0 || offsets.windows(2).any(|w| w[1] < w[0]) {
            return Err(CodecError::Corrupt(
                "payload offsets are not increasing from 0".into(),
            ));
        }
        let words = offsets[tiles] as usize;
        if b.len() - r.pos != 2 * words {
            return Err(CodecError::Corrupt(format!(
                "{} payload bytes where the offsets say {}",
                b.len() - r.pos,
                2 * words
            )));
        }
        let payload = (0..words).map(|_| r.u16()).collect::<Result<Vec<_>>>()?;
        Ok(LossyTensor {
            rows,
            cols,
            quantizer,
            prob_bits,
            tile_rows,
            tables,
            scales,
            states,
            offsets,
            payload,
        })
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let s = self
            .b
            .get(self.pos..self.pos + n)
            .ok_or_else(|| CodecError::Corrupt(format!("truncated at byte {}", self.pos)))?;
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
}

/// Checks an encoder's input; returns the column weights scaled to mean 1.
fn check_input(
    w: &[f32],
    rows: usize,
    cols: usize,
    opts: &Options,
    method: &dyn Method,
) -> Result<Option<Vec<f32>>> {
    if cols > MAX_COLS {
        return Err(CodecError::Shape(format!(
            "rows of {cols} columns: lossy coding takes at most {MAX_COLS}"
        )));
    }
    if rows == 0 || cols == 0 || w.len() != rows * cols {
        return Err(CodecError::Shape(format!(
            "{} values for a {rows} × {cols} matrix",
            w.len()
        )));
    }
    if !cols.is_multiple_of(method.item()) {
        return Err(CodecError::Shape(format!(
            "{} codes rows in blocks of {}; this row has {cols} columns",
            opts.quantizer,
            method.item()
        )));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(CodecError::Unsupported(format!(
            "value {} at row {}, column {} is not finite",
            w[i],
            i / cols,
            i % cols
        )));
    }
    if !(0.05..=16.0).contains(&opts.bits) {
        return Err(CodecError::Unsupported(format!(
            "a target of {} bits a weight: use 0.05 to 16",
            opts.bits
        )));
    }
    if !(MIN_TILE_WEIGHTS..=TILE_WEIGHTS).contains(&opts.tile_weights) {
        return Err(CodecError::Shape(format!(
            "tiles of {} weights (the range is {MIN_TILE_WEIGHTS}..={TILE_WEIGHTS})",
            opts.tile_weights
        )));
    }
    let Some(h) = &opts.col_weights else {
        return Ok(None);
    };
    if h.len() != cols {
        return Err(CodecError::Shape(format!(
            "{} column weights for rows of {cols} columns",
            h.len()
        )));
    }
    if let Some(v) = h.iter().find(|v| !v.is_finite() || **v < 0.0) {
        return Err(CodecError::Unsupported(format!(
            "column weight {v}: weights must be finite and not negative"
        )));
    }
    let mean = h.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
    if mean <= 0.0 {
        return Ok(None);
    }
    Ok(Some(h.iter().map(|&v| (v as f64 / mean) as f32).collect()))
}

/// Quantises `x` (whole tiles of `tile_rows` rows) at `step`, tile-parallel.
fn quantize_tiles(
    method: &dyn Method,
    x: &[f32],
    cols: usize,
    tile_rows: usize,
    step: f64,
    hw: Option<&[f32]>,
    model: Option<&RateModel>,
) -> Vec<TileCode> {
    x.par_chunks(tile_rows * cols)
        .map(|t| {
            let mut c = TileCode::default();
            method.quantize_tile(t, cols, step as f32, hw, model, &mut c);
            c
        })
        .collect()
}

/// Weighted squared error of one row's points after its scale fit, in the row's normalised units:
/// Σh·x² − (Σh·x·q)² / Σh·q².
fn fitted_error(x: &[f32], hw: Option<&[f32]>, num: f64, den: f64) -> f64 {
    let ss: f64 = x
        .iter()
        .enumerate()
        .map(|(c, &v)| hw.map_or(1.0, |h| h[c] as f64) * v as f64 * v as f64)
        .sum();
    let fit = if den > 0.0 { num * num / den } else { 0.0 };
    (ss - fit).max(0.0)
}

/// The per-row RDO ([`Options::rdo`]): each row's step multiplier. Rows are priced one at a time:
/// error in the matrix's own units (the row's RMS squared times its normalised error), bits under
/// the code model of the sampled rows' choices. λ is the sample's operational slope −ΔD/ΔR around
/// multiplier 1, so the average row keeps about its rate; two rounds on the sample refine the
/// model, then every row chooses.
#[allow(clippy::too_many_arguments)]
fn row_multipliers(
    method: &dyn Method,
    xn: &[f32],
    rms: &[f32],
    cols: usize,
    sample: &[usize],
    step: f64,
    hw: Option<&[f32]>,
    k: usize,
) -> Vec<f32> {
    let (lo, hi) = RDO_RANGE;
    let cands: Vec<f64> = (0..k)
        .map(|i| lo * (hi / lo).powf(i as f64 / (k - 1) as f64))
        .collect();
    let code_row = |r: usize, m: f64, model: Option<&RateModel>| -> TileCode {
        let mut c = TileCode::default();
        let x = &xn[r * cols..(r + 1) * cols];
        method.quantize_tile(x, cols, (step * m) as f32, hw, model, &mut c);
        c
    };
    // Error and bits of row r at each candidate.
    let price = |r: usize, model: &RateModel| -> Vec<(f64, f64)> {
        let x = &xn[r * cols..(r + 1) * cols];
        let s2 = rms[r] as f64 * rms[r] as f64;
        cands
            .iter()
            .map(|&m| {
                let c = code_row(r, m, None);
                let bits: f64 = c
                    .syms
                    .iter()
                    .map(|s| model.bits(s.table as usize, s.value) as f64)
                    .sum();
                (s2 * fitted_error(x, hw, c.row_num[0], c.row_den[0]), bits)
            })
            .collect()
    };
    let model_of =
        |codes: &[TileCode]| RateModel::from_counts(&histograms(codes, method.tables()), 0.0);
    let one = cands
        .iter()
        .position(|&m| m >= 1.0)
        .unwrap_or(k - 1)
        .clamp(1, k - 1);
    let mut model = model_of(
        &sample
            .par_iter()
            .map(|&r| code_row(r, 1.0, None))
            .collect::<Vec<_>>(),
    );
    let mut lambda = 0.0;
    let choose = |p: &[(f64, f64)], lambda: f64| -> usize {
        (0..p.len())
            .min_by(|&a, &b| (p[a].0 + lambda * p[a].1).total_cmp(&(p[b].0 + lambda * p[b].1)))
            .unwrap_or(0)
    };
    for _ in 0..2 {
        let priced: Vec<Vec<(f64, f64)>> = sample.par_iter().map(|&r| price(r, &model)).collect();
        let total = |i: usize| -> (f64, f64) {
            priced
                .iter()
                .fold((0.0, 0.0), |(d, b), p| (d + p[i].0, b + p[i].1))
        };
        let ((d0, b0), (d1, b1)) = (total(one - 1), total(one));
        lambda = if b0 > b1 { (d1 - d0) / (b0 - b1) } else { 0.0 };
        let chosen: Vec<TileCode> = sample
            .par_iter()
            .zip(&priced)
            .map(|(&r, p)| code_row(r, cands[choose(p, lambda)], None))
            .collect();
        model = model_of(&chosen);
    }
    (0..rms.len())
        .into_par_iter()
        .map(|r| cands[choose(&price(r, &model), lambda)] as f32)
        .collect()
}

fn needed_bits(alphabet: usize) -> u8 {
    (alphabet.max(2).next_power_of_two().trailing_zeros() as u8).max(*rans::PROB_BITS.start())
}

/// Mean (weighted) squared error in units of the step, of the points the codes choose (before the
/// row refit).
fn distortion_units(
    xs: &[f32],
    cols: usize,
    codes: &[TileCode],
    step: f64,
    hw: Option<&[f32]>,
) -> f64 {
    // Σh(x − s·q)² = Σhx² − 2sΣhxq + s²Σhq², from the row sums.
    let ss: f64 = xs
        .iter()
        .enumerate()
        .map(|(i, &x)| hw.map_or(1.0, |h| h[i % cols] as f64) * x as f64 * x as f64)
        .sum();
    let (num, den): (f64, f64) = codes
        .iter()
        .flat_map(|c| c.row_num.iter().zip(&c.row_den))
        .fold((0.0, 0.0), |(a, b), (n, d)| (a + n, b + d));
    ((ss - 2.0 * step * num + step * step * den) / xs.len() as f64).max(0.0) / (step * step)
}

#[allow(clippy::too_many_arguments)]
fn assemble(
    quantizer: Quantizer,
    rows: usize,
    cols: usize,
    tile_rows: usize,
    prob_bits: u8,
    rms: &[f32],
    codes: &[TileCode],
    tables: Vec<Table>,
) -> Result<LossyTensor> {
    let cums: Vec<Vec<u32>> = tables.iter().map(rans::cumulative).collect();
    let encoded: Vec<([u32; LANES], Vec<u16>)> = codes
        .par_iter()
        .map(|c| {
            let syms: Vec<Sym> = c
                .syms
                .iter()
                .map(|s| {
                    let t = s.table as usize;
                    let i = (s.value - tables[t].min) as usize;
                    Sym {
                        freq: tables[t].freqs[i] as u32,
                        cum: cums[t][i],
                    }
                })
                .collect();
            let lanes: Vec<u8> = c.syms.iter().map(|s| s.lane).collect();
            rans::encode_tile(&syms, &lanes, prob_bits)
        })
        .collect();
    let mut states = Vec::with_capacity(codes.len() * LANES);
    let mut offsets = vec![0u32];
    let mut payload = vec![];
    for (x, w) in encoded {
        states.extend_from_slice(&x);
        payload.extend_from_slice(&w);
        offsets.push(u32::try_from(payload.len()).map_err(|_| {
            CodecError::Unsupported("more than 2^32 payload words in one lossy tensor".into())
        })?);
    }
    let mut scales = Vec::with_capacity(rows);
    for c in codes {
        for (n, d) in c.row_num.iter().zip(&c.row_den) {
            let r = scales.len();
            scales.push(if *d > 0.0 {
                (rms[r] as f64 * n / d) as f32
            } else {
                0.0
            });
        }
    }
    Ok(LossyTensor {
        rows,
        cols,
        quantizer,
        prob_bits,
        tile_rows,
        tables,
        scales,
        states,
        offsets,
        payload,
    })
}

#[cfg(test)]
mod tests;
