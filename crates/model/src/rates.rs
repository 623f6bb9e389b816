//! Rates for a checkpoint's lossy matrices (`compress --bits R`): the whole-model average `R`
//! allocated across matrices by rate and distortion, and `--bits-file` rates by launch or tensor.
//!
//! The allocation minimises Σᵢ dᵢ(Rᵢ) subject to Σᵢ nᵢ·Rᵢ = R·Σᵢ nᵢ, where dᵢ is matrix i's
//! relative squared error (with `--calib`, weighted by its input channels' activation energy: its
//! relative output error) and nᵢ its weights. Each matrix's error counts alike because each adds
//! its own noise to the residual stream whatever its size; a bit a weight costs nᵢ bits. The curves
//! come from sampled rows (`LossyTensor::rd_curve`), the minimum from a Lagrange multiplier.
//!
//! A bits file is a JSON object of launch name (`qkv`, `o`, `gate_up`, `down`: every layer's) or
//! tensor name → bits a weight; a tensor's own name wins over its launch's. Named matrices take
//! those rates; the allocation shares the rest of the average among the others.

use crate::coding_plan::Launch;
use crate::error::{ModelError, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// How far a matrix's rate may move from the average, in bits a weight (below, above): no matrix
/// is starved or given a rate no curve point supports.
pub const SPREAD: (f64, f64) = (1.5, 2.0);

/// Rates the allocation chooses between: a hundredth of a bit apart.
const GRID: f64 = 0.01;

/// Per-launch or per-tensor rates (`compress --bits-file`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BitsFile {
    launches: BTreeMap<Launch, f64>,
    tensors: BTreeMap<String, f64>,
}

impl BitsFile {
    pub fn read(path: &Path) -> Result<BitsFile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::format(path, format!("reading a bits file: {e}")))?;
        Self::parse(&text).map_err(|e| ModelError::format(path, e))
    }

    pub fn parse(text: &str) -> std::result::Result<BitsFile, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or("a bits file is a JSON object of launch or tensor name → bits a weight")?;
        let mut f = BitsFile::default();
        for (k, v) in obj {
            let bits = v
                .as_f64()
                .filter(|b| (0.05..=16.0).contains(b))
                .ok_or_else(|| format!("\"{k}\": {v} is not a rate of 0.05 to 16 bits a weight"))?;
            match Launch::from_name(k) {
                Some(l @ (Launch::Qkv | Launch::O | Launch::GateUp | Launch::Down)) => {
                    f.launches.insert(l, bits);
                }
                Some(l) => {
                    return Err(format!(
                        "\"{k}\": the {} stays lossless; name qkv, o, gate_up, down or a tensor",
                        l.name()
                    ))
                }
                None => {
                    f.tensors.insert(k.clone(), bits);
                }
            }
        }
        Ok(f)
    }

    /// The rate this file gives the tensor `name`, if any.
    pub fn rate(&self, name: &str) -> Option<f64> {
        self.tensors
            .get(name)
            .copied()
            .or_else(|| self.launches.get(&Launch::of_tensor(name)?).copied())
    }

    /// Tensor names the file gives that are not among `names` (a typo, or a lossless tensor).
    pub fn unknown<'a>(&'a self, names: &[&str]) -> Vec<&'a str> {
        self.tensors
            .keys()
            .filter(|k| !names.contains(&k.as_str()))
            .map(|k| k.as_str())
            .collect()
    }
}

/// A matrix's rate–distortion curve: its weights and (bits a weight, relative squared error)
/// points in rising rate.
pub struct Curve {
    pub weights: usize,
    pub points: Vec<(f64, f64)>,
}

impl Curve {
    /// ln d at `r`, linear in r between points and beyond the ends.
    fn ln_error(&self, r: f64) -> f64 {
        let p = &self.points;
        let line = |a: (f64, f64), b: (f64, f64)| {
            let (la, lb) = (a.1.max(1e-300).ln(), b.1.max(1e-300).ln());
            la + (lb - la) * (r - a.0) / (b.0 - a.0)
        };
        match p.len() {
            0 => 0.0,
            1 => p[0].1.max(1e-300).ln(),
            _ => {
                let i = p.partition_point(|q| q.0 < r).clamp(1, p.len() - 1);
                line(p[i - 1], p[i])
            }
        }
    }
}

/// Rates for `curves` whose weighted average is `average` (to a grid step), each within
/// [`SPREAD`] of it: the minimum of Σ dᵢ(Rᵢ) (module docs).
pub fn allocate(curves: &[Curve], average: f64) -> Vec<f64> {
    let total: f64 = curves.iter().map(|c| c.weights as f64).sum();
    if curves.is_empty() || total == 0.0 {
        return vec![average; curves.len()];
    }
    let lo = (average - SPREAD.0).max(0.05);
    let hi = (average + SPREAD.1).min(16.0);
    let steps = ((hi - lo) / GRID).round() as usize;
    let grid: Vec<f64> = (0..=steps).map(|i| lo + i as f64 * GRID).collect();
    // Per curve, d on the grid.
    let d: Vec<Vec<f64>> = curves
        .iter()
        .map(|c| grid.iter().map(|&r| c.ln_error(r).exp()).collect())
        .collect();
    let mean_n = total / curves.len() as f64;
    let rates_at = |mu: f64| -> Vec<f64> {
        curves
            .iter()
            .zip(&d)
            .map(|(c, d)| {
                let price = mu * c.weights as f64 / mean_n;
                let best = (0..grid.len())
                    .min_by(|&a, &b| (d[a] + price * grid[a]).total_cmp(&(d[b] + price * grid[b])))
                    .unwrap_or(0);
                grid[best]
            })
            .collect()
    };
    let mean = |r: &[f64]| -> f64 {
        r.iter()
            .zip(curves)
            .map(|(r, c)| r * c.weights as f64)
            .sum::<f64>()
            / total
    };
    // The average rate falls as the price of a bit rises: bisect ln μ.
    let (mut a, mut b) = (-60f64, 20f64);
    for _ in 0..80 {
        let m = 0.5 * (a + b);
        if mean(&rates_at(m.exp())) > average {
            a = m;
        } else {
            b = m;
        }
    }
    let (ra, rb) = (rates_at(a.exp()), rates_at(b.exp()));
    match (mean(&ra) - average).abs() < (mean(&rb) - average).abs() {
        true => ra,
        false => rb,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// d = 2^(−2R)·c: a Gaussian-like curve at scale c.
    fn curve(weights: usize, c: f64, slope: f64) -> Curve {
        Curve {
            weights,
            points: (0..30)
                .map(|i| {
                    let r = 0.5 * i as f64;
                    (r, c * (-slope * r).exp2())
                })
                .collect(),
        }
    }

    fn mean(r: &[f64], c: &[Curve]) -> f64 {
        let n: f64 = c.iter().map(|c| c.weights as f64).sum();
        r.iter()
            .zip(c)
            .map(|(r, c)| r * c.weights as f64)
            .sum::<f64>()
            / n
    }

    #[test]
    fn like_matrices_get_the_average() {
        let c = vec![curve(1000, 1.0, 2.0), curve(1000, 1.0, 2.0)];
        for avg in [2.0, 3.3, 4.0] {
            let r = allocate(&c, avg);
            for r in &r {
                assert!((r - avg).abs() <= GRID + 1e-9, "{r} against {avg}");
            }
        }
    }

    #[test]
    fn larger_and_easier_matrices_give_bits_to_the_others_and_the_average_holds() {
        // A matrix 4× larger pays 4× for each bit a weight: about log2(4)/2 = 1 bit less
        // (equal slopes of d), and the small one about as much more in its share.
        let c = vec![curve(4000, 1.0, 2.0), curve(1000, 1.0, 2.0)];
        let r = allocate(&c, 4.0);
        assert!((mean(&r, &c) - 4.0).abs() < 0.01, "{r:?}");
        assert!((r[1] - r[0] - 1.0).abs() < 0.05, "{r:?}");
        // A matrix whose error is ten times lower at every rate needs fewer bits.
        let c = vec![curve(1000, 1.0, 2.0), curve(1000, 0.1, 2.0)];
        let r = allocate(&c, 3.0);
        assert!(r[0] > r[1] && (mean(&r, &c) - 3.0).abs() < 0.01, "{r:?}");
        // The spread holds: a hopeless matrix is not given everything.
        let c = vec![curve(1000, 1e6, 2.0), curve(1000, 1.0, 2.0)];
        let r = allocate(&c, 3.0);
        assert!(
            r[0] <= 3.0 + SPREAD.1 + 1e-9 && r[1] >= 3.0 - SPREAD.0 - 1e-9,
            "{r:?}"
        );
    }

    #[test]
    fn bits_files_name_launches_and_tensors() {
        let f = BitsFile::parse(
            r#"{"qkv": 5, "down": 3.5, "model.layers.0.self_attn.q_proj.weight": 6}"#,
        )
        .unwrap();
        assert_eq!(f.rate("model.layers.0.self_attn.q_proj.weight"), Some(6.0));
        assert_eq!(f.rate("model.layers.1.self_attn.k_proj.weight"), Some(5.0));
        assert_eq!(f.rate("blk.2.ffn_down.weight"), Some(3.5));
        assert_eq!(f.rate("model.layers.1.mlp.up_proj.weight"), None);
        assert_eq!(
            f.unknown(&["model.layers.1.mlp.up_proj.weight"]),
            vec!["model.layers.0.self_attn.q_proj.weight"]
        );
        for bad in [
            r#"[1]"#,
            r#"{"qkv": 0}"#,
            r#"{"qkv": "4"}"#,
            r#"{"lm_head": 8}"#,
            "{",
        ] {
            assert!(BitsFile::parse(bad).is_err(), "{bad}");
        }
    }
}
