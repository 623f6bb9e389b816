//! Error-feedback rounding from a layer's input Hessian (GPTQ, Frantar et al. 2022): columns are
//! rounded one at a time, and each one's rounding error is spread over the columns not yet
//! rounded so that the layer's *output* error ‖X·(W − Ŵ)ᵀ‖ is what is minimised, not ‖W − Ŵ‖.
//!
//! With H = XᵀX/n (the calibration inputs' second moments) and U the upper Cholesky factor of
//! H⁻¹ (H⁻¹ = UᵀU), rounding column j with error e moves the later columns k of the row by
//! −e·U[j][k]/U[j][j]. Columns go in falling order of H's diagonal (GPTQ's "act order": the
//! channels that matter most are rounded first, while the most columns remain to absorb their
//! error); the grid and group scales are the ones plain rounding uses, fixed before the pass
//! ("static groups"), so the codes are served as any other.

use crate::{CodecError, Result};
use rayon::prelude::*;

/// Diagonal damping, as a fraction of the mean diagonal (GPTQ's default).
pub const DAMP: f64 = 0.01;
/// Rows rounded together: each row of U is read once per block.
const ROW_BLOCK: usize = 16;

/// A matrix's feedback factor: the column order and U (in that order).
#[derive(Clone, PartialEq)]
pub struct Feedback {
    cols: usize,
    /// Position → column.
    order: Vec<usize>,
    /// U row-major in `order`'s positions (upper triangle used).
    u: Vec<f32>,
}

impl std::fmt::Debug for Feedback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Feedback({} columns)", self.cols)
    }
}

impl Feedback {
    /// From H (`cols × cols`, symmetric, row-major: Σ xxᵀ over the inputs, any positive scale).
    /// Channels the inputs never reach get a unit diagonal; the diagonal is damped by [`DAMP`]
    /// of its mean, more where the factorisation needs it.
    pub fn new(h: &[f64], cols: usize) -> Result<Feedback> {
        if cols == 0 || h.len() != cols * cols || h.iter().any(|v| !v.is_finite()) {
            return Err(CodecError::Shape(format!(
                "a Hessian of {} finite values for {cols} columns",
                h.len()
            )));
        }
        let mut diag: Vec<f64> = (0..cols).map(|j| h[j * cols + j]).collect();
        for d in &mut diag {
            if *d <= 0.0 {
                *d = 1.0;
            }
        }
        let mean = diag.iter().sum::<f64>() / cols as f64;
        let mut order: Vec<usize> = (0..cols).collect();
        order.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]).then(a.cmp(&b)));
        let mut damp = DAMP;
        for _ in 0..8 {
            // B = J·A·J, A = H permuted and damped (J reverses): the lower Cholesky factor L of
            // B gives A = V·Vᵀ with V = J·L·J upper, so A⁻¹ = UᵀU with U = V⁻¹ = J·L⁻¹·J.
            let n = cols;
            let mut b = vec![0f64; n * n];
            b.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
                let a = order[n - 1 - i];
                for (k, v) in row.iter_mut().enumerate() {
                    let c = order[n - 1 - k];
                    *v = if a == c {
                        diag[a] + damp * mean
                    } else {
                        h[a * n + c]
                    };
                }
            });
            let Some(l) = cholesky(&b, n) else {
                damp *= 10.0;
                continue;
            };
            let mt = lower_inverse_transposed(&l, n);
            // U[a][c] = M[n-1-a][n-1-c] = Mt[n-1-c][n-1-a], c ≥ a.
            let mut u = vec![0f32; n * n];
            u.par_chunks_mut(n).enumerate().for_each(|(a, row)| {
                for (c, v) in row.iter_mut().enumerate().skip(a) {
                    *v = mt[(n - 1 - c) * n + (n - 1 - a)] as f32;
                }
            });
            if u.iter().any(|v| !v.is_finite()) {
                damp *= 10.0;
                continue;
            }
            return Ok(Feedback { cols, order, u });
        }
        Err(CodecError::Unsupported(
            "the calibration Hessian stays singular after damping".into(),
        ))
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Rounds `w` (`rows × cols`) to integer codes in `lo..=hi` with feedback: `steps` holds each
    /// row's group steps (`cols / group` a row), weights under (½ + `dead_zone`) steps become 0.
    pub(crate) fn round(
        &self,
        w: &[f32],
        rows: usize,
        group: usize,
        steps: &[f32],
        (lo, hi): (i32, i32),
        dead_zone: f32,
    ) -> Vec<i32> {
        let n = self.cols;
        let per_row = n / group;
        let mut out = vec![0i32; rows * n];
        out.par_chunks_mut(ROW_BLOCK * n)
            .zip(w.par_chunks(ROW_BLOCK * n))
            .zip(steps.par_chunks(ROW_BLOCK * per_row))
            .for_each(|((out, w), steps)| {
                let r = w.len() / n;
                // The rows in feedback order, updated as columns are rounded.
                let mut work = vec![0f32; r * n];
                for (dst, src) in work.chunks_mut(n).zip(w.chunks(n)) {
                    for (d, &c) in dst.iter_mut().zip(&self.order) {
                        *d = src[c];
                    }
                }
                for (j, &c) in self.order.iter().enumerate() {
                    let urow = &self.u[j * n..(j + 1) * n];
                    let ujj = urow[j];
                    for i in 0..r {
                        let row = &mut work[i * n..(i + 1) * n];
                        let step = steps[i * per_row + c / group];
                        let x = row[j];
                        let k = if step > 0.0 {
                            let t = x / step;
                            if t.abs() < 0.5 + dead_zone {
                                0
                            } else {
                                (t.round() as i32).clamp(lo, hi)
                            }
                        } else {
                            0
                        };
                        out[i * n + c] = k;
                        let e = (x - k as f32 * step) / ujj;
                        for (v, &u) in row[j + 1..].iter_mut().zip(&urow[j + 1..]) {
                            *v -= e * u;
                        }
                    }
                }
            });
        out
    }
}

/// The lower Cholesky factor of the symmetric positive definite `a` (`n × n`, row-major), or
/// `None` where a pivot is not positive.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let (ri, rj) = (&l[i * n..i * n + j], &l[j * n..j * n + j]);
            let s = a[i * n + j] - dot(ri, rj);
            if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return None;
                }
                l[i * n + i] = s.sqrt();
            } else {
                l[i * n + j] = s / l[j * n + j];
            }
        }
    }
    Some(l)
}

/// (L⁻¹)ᵀ of the lower triangular `l`, row-major: row j holds column j of L⁻¹ (from j on).
fn lower_inverse_transposed(l: &[f64], n: usize) -> Vec<f64> {
    let mut mt = vec![0f64; n * n];
    mt.par_chunks_mut(n).enumerate().for_each(|(j, m)| {
        // Forward substitution of L·m = e_j.
        m[j] = 1.0 / l[j * n + j];
        for i in j + 1..n {
            let s = dot(&l[i * n + j..i * n + i], &m[j..i]);
            m[i] = -s / l[i * n + i];
        }
    });
    mt
}

#[inline]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    // Four sums so that the loop vectorises.
    let mut s = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            s[k] += x[k] * y[k];
        }
    }
    let mut t = (s[0] + s[1]) + (s[2] + s[3]);
    for (x, y) in ra.iter().zip(rb) {
        t += x * y;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64 as Rng;

    /// UᵀU is the damped, permuted H's inverse: (UᵀU)·A = I.
    #[test]
    fn the_factor_inverts_the_damped_hessian() {
        let mut rng = Rng::new(5);
        for n in [1, 2, 7, 33, 96] {
            let x: Vec<f64> = (0..4 * n * n).map(|_| rng.normal()).collect();
            let t = 4 * n;
            let mut h = vec![0f64; n * n];
            for a in 0..n {
                for b in 0..n {
                    h[a * n + b] = (0..t).map(|s| x[s * n + a] * x[s * n + b]).sum();
                }
            }
            let f = Feedback::new(&h, n).unwrap();
            let mean = (0..n).map(|j| h[j * n + j]).sum::<f64>() / n as f64;
            let a = |p: usize, q: usize| {
                let (c, d) = (f.order[p], f.order[q]);
                h[c * n + d] + if c == d { DAMP * mean } else { 0.0 }
            };
            let u = |p: usize, q: usize| if q >= p { f.u[p * n + q] as f64 } else { 0.0 };
            for p in 0..n {
                for q in 0..n {
                    // (UᵀU·A)[p][q]
                    let v: f64 = (0..n)
                        .map(|k| (0..n).map(|m| u(m, p) * u(m, k)).sum::<f64>() * a(k, q))
                        .sum();
                    let want = if p == q { 1.0 } else { 0.0 };
                    assert!((v - want).abs() < 1e-3, "n {n} [{p}][{q}] {v}");
                }
            }
            // Falling diagonal.
            assert!(f
                .order
                .windows(2)
                .all(|o| h[o[0] * (n + 1)] >= h[o[1] * (n + 1)]));
        }
    }

    #[test]
    fn bad_hessians_are_errors() {
        assert!(Feedback::new(&[1.0, 0.0, 0.0], 2).is_err());
        assert!(Feedback::new(&[f64::NAN], 1).is_err());
        // A zero Hessian (no input reached the layer) is the identity: plain rounding.
        let f = Feedback::new(&[0.0; 4], 2).unwrap();
        let q = f.round(&[0.26, -0.74], 1, 2, &[0.5], (-8, 7), 0.0);
        assert_eq!(q, vec![1, -1]);
    }
}
