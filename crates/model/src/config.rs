//! Model configuration: what the engine needs to know about an architecture, from an HF
//! `config.json` or GGUF metadata.

use serde::{Deserialize, Serialize};

/// Architectures the engine runs (all decoder-only, RMSNorm, RoPE, GQA, SwiGLU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
}

/// Which pairs of a head's dimensions RoPE rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// HF layout ("NEOX"): rotate (x[i], x[i + d/2]).
    Neox,
    /// GGUF llama layout ("NORM"): rotate adjacent pairs (x[2i], x[2i+1]).
    Interleaved,
}

/// RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    /// Llama 3.1: per-frequency scaling between a low and a high wavelength band.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2 always; Llama with `attention_bias`).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}
