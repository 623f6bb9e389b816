//! The E8 lattice quantiser of EntroPack (seed §3.2–3.3): blocks of eight row-normalised weights to
//! the nearest point of E8 = D8 ∪ (D8 + ½) (Conway–Sloane), each point as nine integer fields —
//! the coset c, z0..z6 and the parity-reduced m = (z7 − (z0+…+z6 mod 2)) / 2 — coded with 17 tables:
//! one for c, and one per field and coset.

use super::{Method, TileCode};

pub const DIM: usize = 8;
/// Table 0 codes the coset; field f of coset c uses table 1 + 2f + c.
pub const TABLES: usize = 17;

/// Nearest point of D8 (integer vectors with even sum) to `x`.
fn nearest_d8(x: &[f32; DIM]) -> [f32; DIM] {
    let mut y = [0f32; DIM];
    let mut sum = 0i32;
    let (mut worst, mut far) = (0usize, -1f32);
    for i in 0..DIM {
        y[i] = x[i].round();
        sum += y[i] as i32;
        let d = (x[i] - y[i]).abs();
        if d > far {
            far = d;
            worst = i;
        }
    }
    if sum & 1 != 0 {
        // Move the coordinate rounded worst to its other neighbour (sgn(0) = +1).
        y[worst] += if x[worst] - y[worst] >= 0.0 {
            1.0
        } else {
            -1.0
        };
    }
    y
}

/// Nearest point of E8 to `x`, as doubled coordinates (all even or all odd).
pub fn nearest(x: &[f32; DIM]) -> [i32; DIM] {
    let y0 = nearest_d8(x);
    let mut h = [0f32; DIM];
    for i in 0..DIM {
        h[i] = x[i] - 0.5;
    }
    let mut y1 = nearest_d8(&h);
    for v in &mut y1 {
        *v += 0.5;
    }
    let d = |y: &[f32; DIM]| -> f32 { x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum() };
    let y = if d(&y0) <= d(&y1) { y0 } else { y1 };
    y.map(|v| (2.0 * v) as i32)
}

/// The nine fields of a point given by doubled coordinates: `[c, z0..z6, m]`.
pub fn fields(p2: &[i32; DIM]) -> [i32; 9] {
    let c = p2[0] & 1;
    let mut f = [0i32; 9];
    f[0] = c;
    let mut par = 0;
    for i in 0..7 {
        let z = (p2[i] - c) >> 1;
        f[1 + i] = z;
        par += z;
    }
    let z7 = (p2[7] - c) >> 1;
    f[8] = (z7 - (par & 1)) >> 1;
    f
}

/// The point (real coordinates) of nine fields; every field tuple is a point of E8.
pub fn point(f: &[i32; 9]) -> [f32; DIM] {
    let c = f[0];
    let mut par = 0;
    let mut p = [0f32; DIM];
    for i in 0..7 {
        par += f[1 + i];
        p[i] = f[1 + i] as f32 + 0.5 * c as f32;
    }
    p[7] = (2 * f[8] + (par & 1)) as f32 + 0.5 * c as f32;
    p
}

pub struct E8;

impl Method for E8 {
    fn tables(&self) -> usize {
        TABLES
    }
    fn item(&self) -> usize {
        DIM
    }

    fn quantize_tile(
        &self,
        xn: &[f32],
        cols: usize,
        step: f32,
        col_weights: Option<&[f32]>,
        _model: Option<&super::RateModel>,
        code: &mut TileCode,
    ) {
        let inv = 1.0 / step;
        let rows = xn.len() / cols;
        let vecs = xn.len() / DIM;
        let mut all = Vec::with_capacity(vecs);
        for r in 0..rows {
            let (mut num, mut den) = (0f64, 0f64);
            for (b, v) in xn[r * cols..(r + 1) * cols].chunks_exact(DIM).enumerate() {
                let mut x = [0f32; DIM];
                for i in 0..DIM {
                    x[i] = v[i] * inv;
                }
                // The nearest point in the plain metric (the lattice's rule); the weights enter the
                // row's scale fit.
                let f = fields(&nearest(&x));
                let p = point(&f);
                for i in 0..DIM {
                    let h = col_weights.map_or(1.0, |h| h[b * DIM + i]) as f64;
                    num += h * v[i] as f64 * p[i] as f64;
                    den += h * p[i] as f64 * p[i] as f64;
                }
                all.push(f);
            }
            code.row_num.push(num);
            code.row_den.push(den);
        }
        // Decoder order: per step of 32 vectors, the cosets, then field by field.
        for group in all.chunks(super::rans::LANES) {
            for j in 0..9 {
                for (l, f) in group.iter().enumerate() {
                    let table = if j == 0 { 0 } else { 2 * j - 1 + f[0] as usize };
                    code.push(table as u8, f[j], l as u8);
                }
            }
        }
    }

    fn decode_tile(
        &self,
        dec: &super::Decoder,
        x: &mut [u32; super::rans::LANES],
        r: &mut super::rans::Reader,
        out: &mut [f32],
    ) -> crate::Result<()> {
        decode_groups(dec, x, r, out)
    }

    #[cfg(target_arch = "x86_64")]
    fn decode_tile_simd(
        &self,
        dec: &super::Decoder,
        x: &mut [u32; super::rans::LANES],
        r: &mut super::rans::Reader,
        out: &mut [f32],
    ) -> Option<crate::Result<()>> {
        let f = dec.simd.as_ref()?;
        Some(
            f.e8(x, r, out)
                .and_then(|done| decode_groups(dec, x, r, &mut out[done..])),
        )
    }
}

/// The scalar decode of `out`'s blocks from states `x` (a tile's start, or where the vector decode
/// stopped).
fn decode_groups(
    dec: &super::Decoder,
    x: &mut [u32; super::rans::LANES],
    r: &mut super::rans::Reader,
    out: &mut [f32],
) -> crate::Result<()> {
    use super::rans::{decode_sym, renorm, LANES};
    let b = dec.prob_bits;
    for group in out.chunks_mut(LANES * DIM) {
        let live = group.len() / DIM;
        let mut f = [[0i32; 9]; LANES];
        for (l, s) in x.iter_mut().take(live).enumerate() {
            f[l][0] = decode_sym(s, &dec.tables[0], b);
        }
        renorm(x, live, r)?;
        for j in 1..9 {
            for (l, s) in x.iter_mut().take(live).enumerate() {
                let c = f[l][0];
                if !(0..=1).contains(&c) {
                    return Err(crate::CodecError::Corrupt(format!("coset {c}")));
                }
                f[l][j] = decode_sym(s, &dec.tables[2 * j - 1 + c as usize], b);
            }
            renorm(x, live, r)?;
        }
        for (l, o) in group.chunks_exact_mut(DIM).enumerate() {
            o.copy_from_slice(&point(&f[l]));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E8 point within reach of x: the integer and half-integer boxes around it, even sums.
    fn brute(x: &[f32; DIM]) -> f32 {
        let mut best = f32::INFINITY;
        for half in [0.0f32, 0.5] {
            for mask in 0..(1u32 << DIM) {
                let mut y = [0f32; DIM];
                for i in 0..DIM {
                    let lo = (x[i] - half).floor() + half;
                    y[i] = if mask >> i & 1 == 1 { lo + 1.0 } else { lo };
                }
                let s: f32 = y.iter().sum();
                if (s.rem_euclid(2.0)).abs() > 1e-6 {
                    continue;
                }
                let d: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
                best = best.min(d);
            }
        }
        best
    }

    #[test]
    fn nearest_point_is_an_e8_point_at_least_as_close_as_any_in_reach() {
        let mut r = crate::rng::SplitMix64::new(1);
        for _ in 0..3000 {
            let mut x = [0f32; DIM];
            for v in &mut x {
                *v = (r.unit() as f32 - 0.5) * 7.0;
            }
            let p2 = nearest(&x);
            assert!(p2.iter().all(|v| v & 1 == p2[0] & 1), "one coset");
            assert_eq!(p2.iter().sum::<i32>().rem_euclid(4), 0, "even sum");
            let y = p2.map(|v| v as f32 / 2.0);
            let d: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
            assert!(d <= brute(&x) + 1e-4, "{x:?}: {d} vs {}", brute(&x));
            // Fields invert exactly.
            assert_eq!(point(&fields(&p2)), y);
        }
    }
}
