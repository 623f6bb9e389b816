//! Activation statistics of a calibration text (`compress --calib`): per decoder-layer launch, the
//! mean square of each input channel over the text's tokens. It is the diagonal of the layer's input
//! Hessian that GPTQ and AWQ weigh by: a weight error e in column j adds about h_j·e² to the
//! layer's output error, so lossy coding minimises Σ h_j e² instead of Σ e².
//!
//! The model runs on the CPU engine over the source checkpoint itself, each matrix's input
//! recorded as it is multiplied; q/k/v share one input (and gate/up), so one record serves each
//! launch. Asked for, the run also keeps each launch's whole Hessian Σ xxᵀ, from which integer
//! codes are rounded with GPTQ error feedback ([`entrollm_codec::lossy::gptq`]).

use crate::coding_plan::Launch;
use crate::error::{ModelError, Result};
use crate::forms::{FormId, Source};
use crate::load::open_model;
use crate::weights::{Linear, Mlp, ModelWeights};
use crate::Engine;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Tokens a window of the calibration run holds (the engine's context is reset between windows).
pub const WINDOW: usize = 512;

/// Per (layer, launch): each input channel's mean square, and where asked for, Σ xxᵀ.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    pub tokens: usize,
    channels: BTreeMap<(usize, Launch), Vec<f32>>,
    hessians: BTreeMap<(usize, Launch), Arc<Vec<f64>>>,
}

impl Calibration {
    /// Runs `text` (its first `max_tokens` tokens) through the model at `model` (a checkpoint
    /// directory or GGUF file; F32/BF16/F16 or quantised), `on_window(done, total)` after each
    /// window; with `hessians`, each launch's Σ xxᵀ too (n·cols² work a launch: slower).
    pub fn collect(
        model: &Path,
        text: &str,
        max_tokens: usize,
        hessians: bool,
        mut on_window: impl FnMut(usize, usize),
    ) -> Result<Calibration> {
        let (weights, tokenizer) = open_model(model, false)?;
        let mut tokens = tokenizer.encode(text, true)?;
        tokens.truncate(max_tokens);
        if tokens.len() < 2 {
            return Err(ModelError::Config(format!(
                "the calibration text gives {} tokens; give it some text (a few thousand tokens \
                 are plenty)",
                tokens.len()
            )));
        }
        let (weights, records) = recording(weights, hessians);
        let mut engine = Engine::new(weights, WINDOW)?;
        let windows = tokens.len().div_ceil(WINDOW);
        for (i, w) in tokens.chunks(WINDOW).enumerate() {
            engine.reset();
            // No logits are asked for: only the layers' inputs matter.
            engine.forward(w, w.len(), |_, _| {})?;
            on_window(i + 1, windows);
        }
        drop(engine);
        let mut c = Calibration {
            tokens: tokens.len(),
            ..Calibration::default()
        };
        for (key, r) in records {
            let r = std::mem::take(&mut *r.sums.lock().expect("recorder lock"));
            let n = r.n.max(1) as f64;
            c.channels
                .insert(key, r.squares.iter().map(|&s| (s / n) as f32).collect());
            if let Some(mut h) = r.gram {
                // The upper triangle was summed; mirror it.
                let cols = r.squares.len();
                for a in 0..cols {
                    for b in 0..a {
                        h[a * cols + b] = h[b * cols + a];
                    }
                }
                c.hessians.insert(key, Arc::new(h));
            }
        }
        Ok(c)
    }

    /// The launch (layer, launch) of a decoder layer's projection named `name` (Hugging Face or
    /// GGUF), whose matrices share an input.
    pub fn launch_of(name: &str) -> Option<(usize, Launch)> {
        Some((layer_index(name)?, Launch::of_tensor(name)?))
    }

    /// Σ xxᵀ (cols × cols, row-major) of the input of `launch`, if the run kept it.
    pub fn hessian(&self, launch: (usize, Launch)) -> Option<&Arc<Vec<f64>>> {
        self.hessians.get(&launch)
    }

    /// The input channels' mean squares of the matrix named `name` (Hugging Face or GGUF name of
    /// a decoder layer's projection), if the run saw it.
    pub fn for_tensor(&self, name: &str) -> Option<&[f32]> {
        self.channels.get(&Self::launch_of(name)?).map(|v| &v[..])
    }
}

/// The decoder layer a tensor name belongs to: `model.layers.N.…` or `blk.N.…`.
fn layer_index(name: &str) -> Option<usize> {
    let rest = name
        .split_once("layers.")
        .or_else(|| name.split_once("blk."))?
        .1;
    rest.split('.').next()?.parse().ok()
}

/// What a [`Recorder`] has summed.
#[derive(Default)]
struct Sums {
    /// Per channel Σx².
    squares: Vec<f64>,
    /// Vectors seen.
    n: u64,
    /// Σ xxᵀ's upper triangle (cols × cols, row-major), where kept.
    gram: Option<Vec<f64>>,
}

/// A matrix that records the mean square of its inputs' channels before multiplying.
struct Recorder {
    inner: Arc<dyn Linear>,
    sums: Mutex<Sums>,
}

impl Recorder {
    fn new(inner: Arc<dyn Linear>, hessian: bool) -> Recorder {
        let cols = inner.cols();
        Recorder {
            sums: Mutex::new(Sums {
                squares: vec![0.0; cols],
                n: 0,
                gram: hessian.then(|| vec![0.0; cols * cols]),
            }),
            inner,
        }
    }

    fn record(&self, x: &[f32]) {
        let cols = self.inner.cols();
        let mut s = self.sums.lock().expect("recorder lock");
        for v in x.chunks_exact(cols) {
            for (a, &b) in s.squares.iter_mut().zip(v) {
                *a += b as f64 * b as f64;
            }
            s.n += 1;
        }
        if let Some(g) = &mut s.gram {
            add_gram(g, x, cols);
        }
    }
}

/// Adds the upper triangle of Σ xxᵀ over the vectors of `x` (each `cols` long) to `g`: per
/// channel pair a dot product of the channels' values (transposed), in f32 over a chunk of
/// vectors, summed in f64.
fn add_gram(g: &mut [f64], x: &[f32], cols: usize) {
    let n = x.len() / cols;
    let mut t = vec![0f32; cols * n];
    for (i, v) in x.chunks_exact(cols).enumerate() {
        for (j, &b) in v.iter().enumerate() {
            t[j * n + i] = b;
        }
    }
    // On the engine's crew where it runs one (this is called inside its forward).
    crate::crew::chunks_mut(g, cols, |a, row| {
        let ta = &t[a * n..(a + 1) * n];
        for (b, o) in row.iter_mut().enumerate().skip(a) {
            *o += dot_f32(ta, &t[b * n..(b + 1) * n]) as f64;
        }
    });
}

#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight sums so that the loop vectorises.
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            s[k] += x[k] * y[k];
        }
    }
    let mut t: f32 = s.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        t += x * y;
    }
    t
}

impl Linear for Recorder {
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.record(x);
        self.inner.matvec(x, y)
    }
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.record(x);
        self.inner.matmul(x, n, y)
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.inner.row(r, out)
    }
    fn stored_bytes(&self) -> usize {
        self.inner.stored_bytes()
    }
    fn form(&self) -> FormId {
        self.inner.form()
    }
    fn source(&self) -> Result<Source> {
        self.inner.source()
    }
    fn source_rows(&self, rows: &[usize]) -> Result<Source> {
        self.inner.source_rows(rows)
    }
    fn values_kind(&self) -> &'static str {
        self.inner.values_kind()
    }
    fn layout_tag(&self) -> Option<&'static str> {
        self.inner.layout_tag()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

type Records = Vec<((usize, Launch), Arc<Recorder>)>;

/// `w` with the first matrix of each launch recording its inputs (and Σ xxᵀ, with `hessians`).
fn recording(mut w: ModelWeights, hessians: bool) -> (ModelWeights, Records) {
    let mut records = vec![];
    for (i, layer) in w.layers.iter_mut().enumerate() {
        let Mlp::Gated(mlp) = &mut layer.mlp else {
            continue;
        };
        for (launch, m) in [
            (Launch::Qkv, &mut layer.q),
            (Launch::O, &mut layer.o),
            (Launch::GateUp, &mut mlp.gate),
            (Launch::Down, &mut mlp.down),
        ] {
            let r = Arc::new(Recorder::new(Arc::clone(m), hessians));
            *m = r.clone();
            records.push(((i, launch), r));
        }
    }
    (w, records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_indices_from_both_namings() {
        assert_eq!(
            layer_index("model.layers.12.self_attn.q_proj.weight"),
            Some(12)
        );
        assert_eq!(layer_index("blk.3.ffn_down.weight"), Some(3));
        assert_eq!(layer_index("lm_head.weight"), None);
    }

    #[test]
    fn a_recorder_keeps_each_channels_mean_square_and_multiplies_as_its_matrix() {
        let m: Arc<dyn Linear> =
            Arc::new(crate::DenseF32::new("w", 2, 3, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap());
        let r = Recorder::new(m.clone(), true);
        let x = [1.0, -2.0, 0.5, 3.0, 0.0, -1.5];
        let (mut y, mut z) = (vec![0f32; 4], vec![0f32; 4]);
        r.matmul(&x, 2, &mut y);
        m.matmul(&x, 2, &mut z);
        assert_eq!(y, z);
        let s = r.sums.lock().unwrap();
        assert_eq!(s.n, 2);
        assert_eq!(s.squares, vec![10.0, 4.0, 2.5]);
        // Σ xxᵀ's upper triangle.
        let g = s.gram.as_ref().unwrap();
        assert_eq!(g, &vec![10.0, -2.0, -4.0, 0.0, 4.0, -1.0, 0.0, 0.0, 2.5]);
    }

    /// The Gram of many vectors of ragged widths against its definition.
    #[test]
    fn gram_sums_match_the_definition() {
        let mut rng = crate::forms::testing::Rng::new(3);
        for (n, cols) in [(1, 1), (5, 3), (37, 19), (256, 64)] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            let mut g = vec![0f64; cols * cols];
            add_gram(&mut g, &x, cols);
            add_gram(&mut g, &x[..cols], cols);
            for a in 0..cols {
                for b in 0..cols {
                    let mut want: f64 = (0..n)
                        .map(|t| x[t * cols + a] as f64 * x[t * cols + b] as f64)
                        .sum();
                    want += x[a] as f64 * x[b] as f64;
                    let got = if b >= a { g[a * cols + b] } else { 0.0 };
                    let want = if b >= a { want } else { 0.0 };
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{n} {cols}"
                    );
                }
            }
        }
    }
}
