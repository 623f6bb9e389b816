//! entrollm-codec: the coders, pure Rust, no GPU.
//!
//! - [`payload`]: how weights split into coded symbols and raw bytes (BF16, FP16, FP8, FP4, intN);
//! - [`histogram`]: histograms, entropy, cross-entropy size prediction;
//! - [`dtans`]: the dtANS-LLM coder (encoder and a CPU decoder that takes the GPU decoder's steps);
//! - [`df11`]: the DFloat11-layout Huffman coder (second lossless coder, interop target);
//! - [`lossy`]: lossy coding at a named rate (E8 lattice or entropy-coded TCQ, tiled rANS);
//! - [`palette`]: FP8 codes as 4-bit indices into a ≤ 16-code palette plus escapes (a serving form);
//! - [`matvec`]: the CPU reference of the fused decode-matvec `y = W·x` from every coded form;
//! - [`rng`]: the one pseudo-random generator (SplitMix64) of the workspace.

pub mod df11;
pub mod dtans;
pub mod histogram;
pub mod lossy;
pub mod matvec;
pub mod palette;
pub mod payload;
pub mod rans;
pub mod rng;

pub use payload::Payload;

/// Errors of the coders. Messages name what is wrong; callers add the tensor and file.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("bad shape: {0}")]
    Shape(String),
    #[error("corrupt coded data: {0}")]
    Corrupt(String),
}

pub type Result<T, E = CodecError> = std::result::Result<T, E>;
