//! entrollm-model: checkpoint loaders, tokenizers, chat templates and the CPU reference engine.

pub mod config;
pub mod weights;

pub use config::ModelConfig;
pub use weights::{LayerWeights, Linear, ModelWeights};
