//! Activation statistics of a calibration text (`compress --calib`): per decoder-layer launch, the
//! mean square of each input channel over the text's tokens. It is the diagonal of the layer's input
//! Hessian that GPTQ and AWQ weigh by: a weight error e in column j adds about h_j·e² to the
//! layer's output error, so lossy coding minimises Σ h_j e² instead of Σ e².
//!
//! The model runs on the CPU engine over the source checkpoint itself, each matrix's input
//! recorded as it is multiplied; q/k/v share one input (and gate/up), so one record serves each
//! launch.

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

/// Per (layer, launch): each input channel's mean square.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    pub tokens: usize,
    channels: BTreeMap<(usize, Launch), Vec<f32>>,
}

impl Calibration {
    /// Runs `text` (its first `max_tokens` tokens) through the model at `model` (a checkpoint
    /// directory or GGUF file; F32/BF16/F16 or quantised), `on_window(done, total)` after each
    /// window.
    pub fn collect(
        model: &Path,
        text: &str,
        max_tokens: usize,
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
        let (weights, records) = recording(weights);
        let mut engine = Engine::new(weights, WINDOW)?;
        let windows = tokens.len().div_ceil(WINDOW);
        for (i, w) in tokens.chunks(WINDOW).enumerate() {
            engine.reset();
            // No logits are asked for: only the layers' inputs matter.
            engine.forward(w, w.len(), |_, _| {})?;
            on_window(i + 1, windows);
        }
        let channels = records
            .into_iter()
            .map(|(key, r)| {
                let r = r.sums.lock().expect("recorder lock");
                let n = r.1.max(1) as f64;
                (key, r.0.iter().map(|&s| (s / n) as f32).collect())
            })
            .collect();
        Ok(Calibration {
            tokens: tokens.len(),
            channels,
        })
    }

    /// The input channels' mean squares of the matrix named `name` (Hugging Face or GGUF name of
    /// a decoder layer's projection), if the run saw it.
    pub fn for_tensor(&self, name: &str) -> Option<&[f32]> {
        let launch = Launch::of_tensor(name)?;
        let layer = layer_index(name)?;
        self.channels.get(&(layer, launch)).map(|v| &v[..])
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

/// A matrix that records the mean square of its inputs' channels before multiplying.
struct Recorder {
    inner: Arc<dyn Linear>,
    /// Per channel Σx², and the vectors seen.
    sums: Mutex<(Vec<f64>, u64)>,
}

impl Recorder {
    fn record(&self, x: &[f32]) {
        let cols = self.inner.cols();
        let mut s = self.sums.lock().expect("recorder lock");
        for v in x.chunks_exact(cols) {
            for (a, &b) in s.0.iter_mut().zip(v) {
                *a += b as f64 * b as f64;
            }
            s.1 += 1;
        }
    }
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

/// `w` with the first matrix of each launch recording its inputs.
fn recording(mut w: ModelWeights) -> (ModelWeights, Records) {
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
            let r = Arc::new(Recorder {
                sums: Mutex::new((vec![0.0; m.cols()], 0)),
                inner: Arc::clone(m),
            });
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
        let r = Recorder {
            sums: Mutex::new((vec![0.0; 3], 0)),
            inner: m.clone(),
        };
        let x = [1.0, -2.0, 0.5, 3.0, 0.0, -1.5];
        let (mut y, mut z) = (vec![0f32; 4], vec![0f32; 4]);
        r.matmul(&x, 2, &mut y);
        m.matmul(&x, 2, &mut z);
        assert_eq!(y, z);
        let s = r.sums.lock().unwrap();
        assert_eq!(s.1, 2);
        assert_eq!(s.0, vec![10.0, 4.0, 2.5]);
    }
}
