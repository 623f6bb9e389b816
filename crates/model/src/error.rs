//! Errors of loaders, tokenizers and the engine. Every message names the file, tensor or field.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        /// In the message, not a `source`: error chains would print it twice.
        error: std::io::Error,
    },
    /// A malformed file: truncated, inconsistent counts, absurd shapes.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// A well-formed input that this engine does not run (architecture, dtype, quant type).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A missing or inconsistent configuration value.
    #[error("config: {0}")]
    Config(String),
    /// A tensor the model needs is missing or has the wrong shape.
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        ModelError::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        ModelError::Tensor {
            name: name.into(),
            msg: msg.into(),
        }
    }
}
