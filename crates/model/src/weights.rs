//! The weights the engine runs on. Every matrix is behind [`Linear`], so dense, GGUF-dequantised
//! and entropy-coded matrices are used the same way.

use crate::config::ModelConfig;
use std::sync::Arc;

/// A weight matrix W of shape [rows (outputs), cols (inputs)].
pub trait Linear: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// y = W·x (x: cols, y: rows).
    fn matvec(&self, x: &[f32], y: &mut [f32]);
    /// Y = X·Wᵀ for `n` vectors stored row after row (x: n·cols, y: n·rows). The default runs
    /// `matvec` per vector; implementations override it to reuse decoded weights across the batch.
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (c, r) = (self.cols(), self.rows());
        for i in 0..n {
            self.matvec(&x[i * c..(i + 1) * c], &mut y[i * r..(i + 1) * r]);
        }
    }
    /// Row `r` of W as f32 (embedding lookup).
    fn row(&self, r: usize, out: &mut [f32]);
    /// Bytes this matrix occupies in memory.
    fn stored_bytes(&self) -> usize;
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q: Arc<dyn Linear>,
    pub k: Arc<dyn Linear>,
    pub v: Arc<dyn Linear>,
    pub o: Arc<dyn Linear>,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    pub gate: Arc<dyn Linear>,
    pub up: Arc<dyn Linear>,
    pub down: Arc<dyn Linear>,
}

pub struct ModelWeights {
    pub config: ModelConfig,
    /// [vocab, hidden]; shared with `lm_head` when embeddings are tied.
    pub embed: Arc<dyn Linear>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// [vocab, hidden].
    pub lm_head: Arc<dyn Linear>,
}

/// A tensor as a loader hands it to [`build_model`](crate::weights): host data in its stored
/// precision, or a ready-made matrix (e.g. an entropy-coded one).
pub enum HostTensor {
    F32 { shape: Vec<usize>, data: Vec<f32> },
    Bf16 { shape: Vec<usize>, data: Vec<u16> },
    F16 { shape: Vec<usize>, data: Vec<u16> },
    Linear(Arc<dyn Linear>),
}

/// Where the engine gets tensors from, by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`,
/// `model.embed_tokens.weight`, `lm_head.weight`, `model.norm.weight`, ...). Loaders (HF safetensors,
/// GGUF, entrollm containers) implement it; names and layouts are always HF's (GGUF llama Q/K rows
/// un-permuted by the loader).
pub trait TensorSource {
    /// The model's configuration.
    fn config(&self) -> crate::error::Result<ModelConfig>;
    /// The tensor with this HF name, or `None` if the checkpoint has no such tensor.
    fn tensor(&self, hf_name: &str) -> crate::error::Result<Option<HostTensor>>;
}
