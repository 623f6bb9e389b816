//! Decoding a lossy matrix to FP8 E4M3 or INT8 codes under one f32 scale a row, the form FP8 and
//! INT8 weights are served in (raw weights of about 0.02 would sit in E4M3's subnormals, so the codes
//! hold the row's points and the scale the rest).
//!
//! A point is the quantiser's reconstruction in units of the encoder's step (the step itself is
//! folded into the row scales and not stored): E8 points are vectors of D8 ∪ (D8 + ½), so every
//! coordinate is a multiple of ½; TCQ points are integers. Row `r`'s code of point `p` is
//! `code(p · mul[r])` and its weight `value(code) · scale[r]`, with `scale[r] = scales[r] / mul[r]`:
//!
//! - FP8 E4M3 (round to nearest, ties to even), per row the better of two multipliers, by the
//!   row's squared error (ties: the first):
//!   - `2^-k` for the smallest `k ≥ 0` that keeps the row's largest |p| within ±448. A power of two
//!     changes no significand, and every nonzero point (at least ½) stays normal, where E4M3's
//!     relative precision is the same at every exponent: no other power of two does better, and
//!     this one keeps the small points (integers up to 16, halves up to 8) exact, the whole row at
//!     low rates, with an exact scale.
//!   - `448 / max|p|`, the row's maximum stretched to E4M3's. Where most points lie in binades
//!     coarser than their grid (high rates), grid points under a power of two fall on E4M3's
//!     midpoints, the worst case of rounding; off the grid they round like random values, and the
//!     row's error is lower.
//!
//!   `tests::fp8_rows_take_the_better_multiplier` measures both on every row.
//! - INT8: the unit `u` of the quantiser's grid (½ for E8, 1 for TCQ), `mul = 1/u`, whenever the
//!   row's largest |p| is at most 127 units: the codes are the points' grid indices, exact, and
//!   `code · (scales[r]·u)` is bit for bit the f32 decode's `p · scales[r]` (u is a power of two, so
//!   both are one rounding of the same real product). A row reaching further takes the max-abs unit
//!   instead, `mul = 127 / max|p|` (f32): codes are `p · mul` rounded to nearest, ties to even,
//!   within ±127 (−128 unused). That is lossy beyond the coder; [`LowRows::inexact_rows`] counts
//!   such rows so callers can say so. A common factor of a row's indices (a row of integer E8 points)
//!   is not looked for: such rows are vanishingly rare at sizes that matter.
//!
//! This is the scalar reference the GPU's `lossy_decode` (LOSSY_OUT 3 and 4) matches bit for bit:
//! the kernel multiplies each point by `mul[r]` where the f32 decode multiplies by the row scale, then
//! converts, so its host side uploads [`LowRows::mul`] from [`LossyTensor::low_rows`].

use super::{Decoder, LossyTensor, Quantizer};
use crate::payload::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};
use crate::Result;
use rayon::prelude::*;

/// E4M3's largest finite magnitude.
const FP8_MAX: f32 = 448.0;
/// INT8's largest magnitude used (symmetric: −128 is never written).
const INT8_MAX: f32 = 127.0;

/// A low-precision output of [`LossyTensor::decode_low`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LowPrecision {
    /// FP8 E4M3 codes (OCP: bias 7, no infinities, ±448 largest).
    Fp8E4m3,
    /// INT8 codes as i8 bit patterns, within ±127.
    Int8,
}

impl LowPrecision {
    pub const ALL: [LowPrecision; 2] = [LowPrecision::Fp8E4m3, LowPrecision::Int8];

    /// The code of `v` (a point times its row's multiplier): FP8 rounded to nearest, ties to even,
    /// saturating at ±448; INT8 rounded to nearest, ties to even, clamped to ±127.
    #[inline]
    pub fn code(self, v: f32) -> u8 {
        match self {
            LowPrecision::Fp8E4m3 => f32_to_fp8_e4m3(v),
            LowPrecision::Int8 => v.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8 as u8,
        }
    }

    /// A code's value, before its row scale.
    #[inline]
    pub fn value(self, code: u8) -> f32 {
        match self {
            LowPrecision::Fp8E4m3 => fp8_e4m3_to_f32(code),
            LowPrecision::Int8 => code as i8 as f32,
        }
    }

    /// The multiplier of a row of `q`'s points (module docs: the rule and why).
    pub fn multiplier(self, q: Quantizer, row: &[f32]) -> f32 {
        let max_abs = row.iter().fold(0f32, |m, p| m.max(p.abs()));
        match self {
            LowPrecision::Fp8E4m3 => {
                let mut pow2 = 1.0f32;
                while max_abs * pow2 > FP8_MAX {
                    pow2 *= 0.5;
                }
                if max_abs == 0.0 {
                    return pow2;
                }
                let stretch = FP8_MAX / max_abs;
                if self.row_error(row, stretch) < self.row_error(row, pow2) {
                    stretch
                } else {
                    pow2
                }
            }
            LowPrecision::Int8 => {
                let u = grid_unit(q);
                if max_abs / u <= INT8_MAX {
                    1.0 / u
                } else {
                    INT8_MAX / max_abs
                }
            }
        }
    }

    /// Squared error of a row of points coded under multiplier `m`, in units of the points.
    pub fn row_error(self, row: &[f32], m: f32) -> f64 {
        row.iter()
            .map(|&p| (self.value(self.code(p * m)) as f64 / m as f64 - p as f64).powi(2))
            .sum()
    }
}

impl std::fmt::Display for LowPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LowPrecision::Fp8E4m3 => "FP8 E4M3",
            LowPrecision::Int8 => "INT8",
        })
    }
}

/// The spacing of `q`'s points in every coordinate (a power of two: dividing by it is exact).
pub fn grid_unit(q: Quantizer) -> f32 {
    match q {
        Quantizer::E8 => 0.5,
        Quantizer::Tcq { .. } => 1.0,
    }
}

/// How each row of a low-precision decode maps points to codes and codes to weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LowRows {
    pub kind: LowPrecision,
    /// Per row: a point's code is `kind.code(point · mul)`.
    pub mul: Vec<f32>,
    /// Per row: a weight is `kind.value(code) · scale`.
    pub scales: Vec<f32>,
    /// Rows whose weights differ somewhere from [`LossyTensor::decode`]'s (FP8: a point E4M3 does
    /// not hold; INT8: a row beyond 127 units, on the max-abs unit).
    pub inexact_rows: usize,
}

/// A low-precision decode: codes row-major, one byte a weight, and their rows' scales.
#[derive(Clone, Debug, PartialEq)]
pub struct LowDecode {
    pub codes: Vec<u8>,
    pub rows: LowRows,
}

impl LowDecode {
    /// The weights the codes stand for (`value · row scale`), row-major f32.
    pub fn weights(&self, cols: usize) -> Vec<f32> {
        let k = self.rows.kind;
        self.codes
            .chunks_exact(cols)
            .zip(&self.rows.scales)
            .flat_map(|(r, &s)| r.iter().map(move |&c| k.value(c) * s))
            .collect()
    }
}

/// One tile's rows: (multiplier, scale, inexact) each, and the codes if kept.
type TileLow = (Vec<(f32, f32, bool)>, Vec<u8>);

impl LossyTensor {
    /// The matrix as `kind` codes under per-row scales (module docs: the rules), decoded tile by
    /// tile in parallel.
    pub fn decode_low(&self, kind: LowPrecision) -> Result<LowDecode> {
        let (rows, codes) = self.low(kind, true)?;
        Ok(LowDecode { codes, rows })
    }

    /// [`Self::decode_low`]'s per-row multipliers and scales without the codes: what a GPU decoder
    /// uploads (it writes the codes itself).
    pub fn low_rows(&self, kind: LowPrecision) -> Result<LowRows> {
        Ok(self.low(kind, false)?.0)
    }

    fn low(&self, kind: LowPrecision, keep_codes: bool) -> Result<(LowRows, Vec<u8>)> {
        let dec = self.decoder()?;
        let tiles: Vec<TileLow> = (0..self.tiles())
            .into_par_iter()
            .map(|t| self.low_tile(&dec, kind, t, keep_codes))
            .collect::<Result<_>>()?;
        let mut rows = LowRows {
            kind,
            mul: Vec::with_capacity(self.rows),
            scales: Vec::with_capacity(self.rows),
            inexact_rows: 0,
        };
        let mut codes = Vec::with_capacity(if keep_codes { self.rows * self.cols } else { 0 });
        for (r, c) in tiles {
            for (m, s, inexact) in r {
                rows.mul.push(m);
                rows.scales.push(s);
                rows.inexact_rows += inexact as usize;
            }
            codes.extend_from_slice(&c);
        }
        Ok((rows, codes))
    }

    fn low_tile(
        &self,
        dec: &Decoder,
        kind: LowPrecision,
        tile: usize,
        keep_codes: bool,
    ) -> Result<TileLow> {
        let r0 = tile * self.tile_rows;
        let nr = self.tile_rows.min(self.rows - r0);
        let mut points = vec![0f32; nr * self.cols];
        self.decode_points_into(dec, tile, &mut points)?;
        let mut codes = Vec::with_capacity(if keep_codes { points.len() } else { 0 });
        let mut rows = Vec::with_capacity(nr);
        for (i, row) in points.chunks_exact(self.cols).enumerate() {
            let s = self.scales[r0 + i];
            let mul = kind.multiplier(self.quantizer, row);
            // A power of two divides exactly; other multipliers round once, from f64.
            let scale = (s as f64 / mul as f64) as f32;
            let mut inexact = false;
            for &p in row {
                let c = kind.code(p * mul);
                inexact |= (kind.value(c) * scale).to_bits() != (p * s).to_bits();
                if keep_codes {
                    codes.push(c);
                }
            }
            rows.push((mul, scale, inexact));
        }
        Ok((rows, codes))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::rel_l2;
    use super::super::{Options, MIN_TILE_WEIGHTS};
    use super::*;
    use crate::rng::SplitMix64 as Rng;

    const QUANTIZERS: [Quantizer; 3] = [
        Quantizer::E8,
        Quantizer::Tcq { log2_states: 2 },
        Quantizer::Tcq { log2_states: 5 },
    ];
    /// Rows not filling the last tile (small tiles: several a matrix), rows shorter than a step.
    const SHAPES: [(usize, usize); 4] = [(37, 264), (9, 72), (13, 1032), (70, 520)];
    const RATES: [f64; 3] = [2.0, 4.0, 6.0];

    /// N(0, σ²) rows with σ varying by row (heavier rows, as models have).
    fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        let mut w = Vec::with_capacity(rows * cols);
        for _ in 0..rows {
            let s = 0.02 * (0.5 * r.normal()).exp();
            w.extend((0..cols).map(|_| (r.normal() * s) as f32));
        }
        w
    }

    fn encode(w: &[f32], rows: usize, cols: usize, bits: f64, q: Quantizer) -> LossyTensor {
        let mut o = Options::new(bits, q);
        o.tile_weights = MIN_TILE_WEIGHTS;
        LossyTensor::encode(w, rows, cols, &o).unwrap().0
    }

    /// The points, row-major, checked against the f32 decode (point · scale, bit for bit).
    fn points(t: &LossyTensor) -> Vec<f32> {
        let dec = t.decoder().unwrap();
        let mut p = vec![0f32; t.rows * t.cols];
        for (i, o) in p.chunks_mut(t.tile_rows * t.cols).enumerate() {
            t.decode_points_into(&dec, i, o).unwrap();
        }
        let f = t.decode().unwrap();
        for (i, (a, b)) in p.iter().zip(&f).enumerate() {
            assert_eq!((a * t.scales[i / t.cols]).to_bits(), b.to_bits());
        }
        p
    }

    /// Rows where `got` differs from `want` anywhere.
    fn rows_differing(got: &[f32], want: &[f32], cols: usize) -> usize {
        got.chunks(cols)
            .zip(want.chunks(cols))
            .filter(|(g, w)| g.iter().zip(*w).any(|(a, b)| a.to_bits() != b.to_bits()))
            .count()
    }

    fn every_case(
        rates: &[f64],
        mut f: impl FnMut(Quantizer, usize, usize, f64, &[f32], &LossyTensor),
    ) {
        let mut seed = 0u64;
        for q in QUANTIZERS {
            for (rows, cols) in SHAPES {
                if cols % q.row_multiple() != 0 {
                    continue;
                }
                for &bits in rates {
                    seed += 1;
                    let w = weights(rows, cols, seed);
                    let t = encode(&w, rows, cols, bits, q);
                    assert!(
                        t.tiles() > 1 || rows < t.tile_rows,
                        "{rows}×{cols}: one tile"
                    );
                    f(q, rows, cols, bits, &w, &t);
                }
            }
        }
    }

    /// The FP8 multipliers the rule allows for a row: the smallest power of two keeping it within
    /// ±448, and the stretch of its maximum to 448.
    fn fp8_candidates(row: &[f32]) -> (f32, f32) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let k = (0..).find(|&k| max <= 448.0 * 2f32.powi(k)).unwrap();
        (2f32.powi(-k), if max > 0.0 { 448.0 / max } else { 1.0 })
    }

    /// FP8 codes are E4M3's rounding of each point under the row's multiplier, one of the two the
    /// rule allows; the weights are the f32 decode's wherever E4M3 holds a point under a power of
    /// two, and the rows differing anywhere are the ones counted.
    #[test]
    fn fp8_codes_are_the_rounded_points_on_ragged_shapes() {
        let (mut pow2_rows, mut stretched_rows) = (0, 0);
        every_case(&RATES, |q, rows, cols, bits, _, t| {
            let p = points(t);
            let d = t.decode_low(LowPrecision::Fp8E4m3).unwrap();
            assert_eq!(t.low_rows(LowPrecision::Fp8E4m3).unwrap(), d.rows);
            assert_eq!(d.codes.len(), rows * cols);
            let want = t.decode().unwrap();
            let got = d.weights(cols);
            for r in 0..rows {
                let row = &p[r * cols..(r + 1) * cols];
                let (pow2, stretch) = fp8_candidates(row);
                let m = d.rows.mul[r];
                assert!(m == pow2 || m == stretch, "{q} row {r}: {m}");
                if m == pow2 {
                    pow2_rows += 1;
                } else {
                    stretched_rows += 1;
                }
                let s = d.rows.scales[r];
                assert_eq!(s, (t.scales[r] as f64 / m as f64) as f32);
                for (i, &v) in row.iter().enumerate() {
                    let k = r * cols + i;
                    let c = d.codes[k];
                    assert_eq!(c, f32_to_fp8_e4m3(v * m), "{q} {bits} bits row {r}: {v}");
                    assert_eq!(got[k], fp8_e4m3_to_f32(c) * s);
                    if m == pow2 && fp8_e4m3_to_f32(c) == v * m {
                        assert_eq!(got[k].to_bits(), want[k].to_bits(), "{q} {bits} bits {k}");
                    }
                }
            }
            assert_eq!(d.rows.inexact_rows, rows_differing(&got, &want, cols));
        });
        assert!(
            pow2_rows > 0 && stretched_rows > 0,
            "{pow2_rows} {stretched_rows}"
        );
    }

    /// INT8 is the f32 decode bit for bit on every row within 127 grid units (codes: the grid
    /// indices); a row beyond takes the max-abs unit (its largest code ±127, every weight within half
    /// a unit of the decode's), and those rows are exactly the ones counted.
    #[test]
    fn int8_is_the_f32_decode_exactly_where_rows_fit() {
        let (mut exact_rows, mut coarse_rows) = (0, 0);
        every_case(&[2.0, 4.0, 6.0, 8.0], |q, rows, cols, bits, _, t| {
            let p = points(t);
            let u = grid_unit(q);
            let d = t.decode_low(LowPrecision::Int8).unwrap();
            assert_eq!(t.low_rows(LowPrecision::Int8).unwrap(), d.rows);
            let want = t.decode().unwrap();
            let got = d.weights(cols);
            let mut coarse = 0;
            for r in 0..rows {
                let row = &p[r * cols..(r + 1) * cols];
                let codes = &d.codes[r * cols..(r + 1) * cols];
                let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = d.rows.scales[r];
                if max <= 127.0 * u {
                    exact_rows += 1;
                    assert_eq!(s, t.scales[r] * u);
                    for (i, (&c, &v)) in codes.iter().zip(row).enumerate() {
                        assert_eq!(c as i8 as f32 * u, v, "{q} {bits} bits row {r}");
                        let k = r * cols + i;
                        assert_eq!(got[k].to_bits(), want[k].to_bits());
                    }
                } else {
                    coarse += 1;
                    let top = codes.iter().map(|&c| (c as i8).unsigned_abs()).max();
                    assert_eq!(top, Some(127), "{q} {bits} bits row {r}");
                    assert!(codes.iter().all(|&c| c as i8 != -128));
                    for k in r * cols..(r + 1) * cols {
                        let e = (got[k] - want[k]).abs();
                        // Half a unit, and the f32 roundings of both weights (up to 127 units).
                        assert!(e <= 0.5 * s.abs() * (1.0 + 1e-4), "row {r}: {e} vs {s}");
                    }
                }
            }
            coarse_rows += coarse;
            assert_eq!(d.rows.inexact_rows, rows_differing(&got, &want, cols));
            assert!(d.rows.inexact_rows <= coarse);
        });
        // Both rules ran.
        assert!(
            exact_rows > 0 && coarse_rows > 0,
            "{exact_rows} {coarse_rows}"
        );
    }

    /// One weight far out in a row of a wide matrix: its points reach past 127 grid units and past
    /// 448, so INT8 gives that row (only) a coarser unit and FP8 halves its points.
    #[test]
    fn an_outlier_row_takes_a_coarser_unit() {
        let (rows, cols) = (8, 4096);
        for q in QUANTIZERS {
            let mut w = weights(rows, cols, 77);
            for v in &mut w[3 * cols..4 * cols] {
                *v *= 0.05;
            }
            w[3 * cols + 100] = 1.0;
            let t = encode(&w, rows, cols, 6.0, q);
            let i8d = t.decode_low(LowPrecision::Int8).unwrap();
            let f8 = t.low_rows(LowPrecision::Fp8E4m3).unwrap();
            let p = points(&t);
            let outlier = p[3 * cols + 100].abs();
            assert!(outlier > 448.0, "{q}: {outlier}");
            assert!(
                f8.mul[3] < 1.0 && f8.mul[3] * outlier <= 448.0 * (1.0 + 1e-6),
                "{q}"
            );
            assert_eq!(i8d.rows.mul[3], 127.0 / outlier, "{q}");
            assert_eq!(i8d.codes[3 * cols + 100] as i8, 127, "{q}");
            let u = grid_unit(q);
            for r in (0..rows).filter(|&r| r != 3) {
                let max = p[r * cols..(r + 1) * cols]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(i8d.rows.mul[r] == 1.0 / u, max <= 127.0 * u, "{q} row {r}");
            }
            assert!(i8d.rows.inexact_rows >= 1, "{q}");
            // The coarse row's weights are within half its unit of the decode's.
            let (got, want) = (i8d.weights(cols), t.decode().unwrap());
            let s = i8d.rows.scales[3];
            for k in 3 * cols..4 * cols {
                assert!((got[k] - want[k]).abs() <= 0.5 * s.abs() * (1.0 + 1e-4));
            }
        }
    }

    /// Errors against the original weights: the low-precision decodes are finite, never better
    /// than the f32 decode they round (beyond chance), and exact where every point fits.
    #[test]
    fn low_precision_errors_are_sensible() {
        every_case(&RATES, |q, _, cols, bits, w, t| {
            let e32 = rel_l2(w, &t.decode().unwrap());
            let d8 = t.decode_low(LowPrecision::Fp8E4m3).unwrap();
            let di = t.decode_low(LowPrecision::Int8).unwrap();
            let e8 = rel_l2(w, &d8.weights(cols));
            let ei = rel_l2(w, &di.weights(cols));
            println!("{q} {bits} bits: f32 {e32:.5}, fp8 {e8:.5}, int8 {ei:.5}");
            for (e, d) in [(e8, &d8), (ei, &di)] {
                // At 2 bits the smallest shapes' fixed bytes leave nothing: every point 0, error 1.
                assert!(e.is_finite() && e <= 1.0);
                assert!(e >= e32 * (1.0 - 1e-3), "{q} {bits}: {e} < {e32}");
                if d.rows.inexact_rows == 0 {
                    assert_eq!(e, e32);
                }
            }
        });
    }

    /// Each row's FP8 multiplier departs no further from the row's points than the other candidate,
    /// measured here independently of the rule's own sums; so the matrix departs no further from
    /// the f32 decode than under either candidate alone (the FP8 error the coder did not make).
    #[test]
    fn fp8_rows_take_the_better_multiplier() {
        every_case(&RATES, |q, rows, cols, bits, _, t| {
            let f = t.decode().unwrap();
            let p = points(t);
            let d = t.decode_low(LowPrecision::Fp8E4m3).unwrap();
            let chosen = rel_l2(&f, &d.weights(cols));
            let mut only = [vec![0f32; rows * cols], vec![0f32; rows * cols]];
            for r in 0..rows {
                let row = &p[r * cols..(r + 1) * cols];
                let (pow2, stretch) = fp8_candidates(row);
                let err = |m: f32| -> f64 {
                    row.iter()
                        .map(|&v| {
                            let e = fp8_e4m3_to_f32(f32_to_fp8_e4m3(v * m)) as f64 / m as f64;
                            (e - v as f64).powi(2)
                        })
                        .sum()
                };
                let m = d.rows.mul[r];
                assert!(err(m) <= err(pow2).min(err(stretch)), "{q} {bits} row {r}");
                for (o, m) in only.iter_mut().zip([pow2, stretch]) {
                    for (o, &v) in o[r * cols..].iter_mut().zip(row) {
                        *o = fp8_e4m3_to_f32(f32_to_fp8_e4m3(v * m)) * (t.scales[r] / m);
                    }
                }
            }
            let (a, b) = (rel_l2(&f, &only[0]), rel_l2(&f, &only[1]));
            println!("{q} {bits} bits: chosen {chosen:.5}, powers of two {a:.5}, stretched {b:.5}");
            // Rows chosen in point units: the scales' own roundings are all that is left.
            assert!(chosen <= a.min(b) * (1.0 + 1e-6), "{q} {bits} bits");
        });
    }

    #[test]
    fn int8_codes_round_ties_to_even_and_clamp() {
        let k = LowPrecision::Int8;
        for (v, c) in [
            (2.5f32, 2i8),
            (3.5, 4),
            (-2.5, -2),
            (-0.4, 0),
            (126.6, 127),
            (127.4, 127),
            (300.0, 127),
            (-1e9, -127),
        ] {
            assert_eq!(k.code(v) as i8, c, "{v}");
            assert_eq!(k.value(k.code(v)), c as f32);
        }
        assert_eq!(k.multiplier(Quantizer::E8, &[0.5, -63.5]), 2.0);
        assert_eq!(k.multiplier(Quantizer::E8, &[-64.0, 1.0]), 127.0 / 64.0);
        assert_eq!(
            k.multiplier(Quantizer::Tcq { log2_states: 5 }, &[127.0]),
            1.0
        );
        let f = LowPrecision::Fp8E4m3;
        // Under the powers of two these rows are exact; stretched they are not.
        assert_eq!(f.multiplier(Quantizer::E8, &[448.0, 3.5, -7.0]), 1.0);
        assert_eq!(f.multiplier(Quantizer::E8, &[480.0, 16.0, 16.0]), 0.5);
        assert_eq!(f.multiplier(Quantizer::E8, &[1792.0, 4.0, 8.0]), 0.25);
        assert_eq!(f.multiplier(Quantizer::E8, &[0.0; 4]), 1.0);
        // Odd integers past 16 sit on E4M3's midpoints under 1; 448/33 moves them off.
        let odd: Vec<f32> = (0..8)
            .map(|i| 17.0 + 2.0 * i as f32)
            .chain([33.0])
            .collect();
        assert_eq!(
            f.multiplier(Quantizer::Tcq { log2_states: 2 }, &odd),
            448.0 / 33.0
        );
    }
}
