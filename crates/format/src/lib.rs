//! entrollm-format: the on-disk side of entrollm.
//!
//! - [`safetensors`]: strict reading (mmap) and HF-style writing of `.safetensors` files, and
//!   [`Checkpoint`]: a whole HF checkpoint (index + shards, a directory of shards, or one file);
//! - [`container`]: the entrollm container — a directory of safetensors shards holding plain and
//!   coded tensors, an `entrollm.json` manifest, verbatim copies of the source's small files, and
//!   what is needed to rebuild the source files bit for bit ([`container::restore_sources`]);
//! - [`mod@checksum`]: the xxh3-64 checksums the manifest records.
//!
//! The layout is specified in `docs/format.md`. Every error is a [`FormatError`] that names the
//! file and, where there is one, the tensor.

pub mod checksum;
pub mod coded;
pub mod container;
mod dtype;
mod error;
pub mod ggml_blocks;
pub mod input;
pub mod kquants;
pub mod qtype;
pub mod safetensors;
mod staging;

pub use checksum::{checksum, checksum_hex, parse_checksum_hex};
pub use container::{
    restore_sources, ArrayDtype, CodedTensor, ContainerReader, ContainerWriter, FormEntry,
    Manifest, SourceFile, SourceSegment, StoredData, StoredTensor, WriterOptions, MAX_SOURCE_GAP,
};
pub use dtype::{tensor_byte_len, Dtype};
pub use error::{FormatError, Result};
pub use safetensors::{Checkpoint, SafetensorsFile, TensorView};
pub use staging::{check_apart, remove_live, StagingDir};
