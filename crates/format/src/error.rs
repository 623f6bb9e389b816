//! The crate's error type. Messages name the file and, where there is one, the tensor.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        /// In the message, not a `source`: error chains would print it twice.
        error: std::io::Error,
    },
    /// A malformed or inconsistent file: truncated, corrupt header, a manifest that contradicts
    /// the shards, a name that escapes the directory.
    #[error("{}: {}{msg}", path.display(), tensor_label(tensor))]
    Invalid {
        path: PathBuf,
        tensor: Option<String>,
        msg: String,
    },
    /// A well-formed file this build cannot read (e.g. an unknown major container version).
    #[error("{}: unsupported: {msg}", path.display())]
    Unsupported { path: PathBuf, msg: String },
    /// Decoded or restored data does not hash to what the manifest records.
    #[error(
        "{}: {}checksum mismatch: manifest records xxh3 {expected:016x}, data hashes to {actual:016x}",
        path.display(),
        tensor_label(tensor)
    )]
    Checksum {
        path: PathBuf,
        tensor: Option<String>,
        expected: u64,
        actual: u64,
    },
    /// The caller's decoder failed on a coded tensor (during [`restore_sources`](crate::restore_sources)).
    /// The cause is in the message (not also a `source`, so error chains do not print it twice).
    #[error("tensor '{tensor}': decoding failed: {cause}")]
    Decode {
        tensor: String,
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The destination of a writer or a restore already holds something.
    #[error("{}: destination exists and is not empty (choose another path or allow overwriting)", path.display())]
    DestinationExists { path: PathBuf },
    /// A caller asked the writer for something a container cannot hold (duplicate or reserved
    /// names, data whose length does not match its dtype and shape, ...).
    #[error("{0}")]
    Usage(String),
}

fn tensor_label(tensor: &Option<String>) -> String {
    match tensor {
        Some(t) => format!("tensor '{t}': "),
        None => String::new(),
    }
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

impl FormatError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }
    /// A problem with a file as a whole.
    pub(crate) fn file(path: &Path, msg: impl Into<String>) -> Self {
        FormatError::Invalid {
            path: path.to_path_buf(),
            tensor: None,
            msg: msg.into(),
        }
    }
    /// A problem with one tensor of a file.
    pub(crate) fn tensor(path: &Path, tensor: &str, msg: impl Into<String>) -> Self {
        FormatError::Invalid {
            path: path.to_path_buf(),
            tensor: Some(tensor.to_string()),
            msg: msg.into(),
        }
    }
}
