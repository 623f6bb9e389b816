//! entrollm-model: checkpoint loaders, tokenizers, chat templates and the CPU reference engine.

pub mod config;
pub mod error;
pub mod synth;
pub mod weights;

pub use config::ModelConfig;
pub use error::{ModelError, Result};
pub use weights::{HostTensor, LayerWeights, Linear, ModelWeights, TensorSource};
