//! entrollm-model: checkpoint loaders, tokenizers, chat templates and the CPU reference engine.

pub mod arch;
pub mod calib;
pub mod chat;
pub mod coding_plan;
pub mod compress;
pub mod config;
mod crew;
pub mod engine;
pub mod error;
pub mod eval;
pub mod forms;
pub mod gguf;
pub mod hf_quant;
pub mod load;
pub mod rates;
pub mod sampler;
pub mod synth;
pub mod tokenizer;
pub mod weights;

pub use config::ModelConfig;
pub use engine::Engine;
pub use error::{ModelError, Result};
pub use eval::{perplexity, Perplexity};
pub use sampler::{
    generate, Decoder, GenerateOptions, Generation, Sampler, SamplingParams, StopReason,
};
pub use weights::{build_model, DenseBf16, DenseF16, DenseF32};
pub use weights::{HostTensor, LayerWeights, Linear, ModelWeights, TensorSource};
