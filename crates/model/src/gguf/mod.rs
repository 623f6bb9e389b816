//! GGUF (v2/v3) checkpoints: a strict reader over a memory map or a byte buffer, dequantisation
//! of the common ggml types, raw access to the integer codes of the 32-element block types, and
//! [`GgufSource`], the [`TensorSource`](crate::TensorSource) that serves GGUF tensors under
//! Hugging Face names and layouts.
//!
//! ```no_run
//! use entrollm_model::gguf::{GgufFile, GgufSource};
//! use entrollm_model::TensorSource;
//! let file = GgufFile::open("model.gguf")?;
//! let embd = file.tensor_f32("token_embd.weight")?;
//! let source = GgufSource::new(file)?;
//! let config = source.config()?;
//! # Ok::<(), entrollm_model::ModelError>(())
//! ```

mod blocks;
mod container;
pub(crate) mod dequant;
mod file;
mod source;
mod types;
mod write;

pub use blocks::{pack_codes, unpack_codes, QuantCodes};
pub use container::{gguf_container_header, is_gguf_container, open_gguf_container, GgufLoad};
pub use dequant::{check_dequantizable, dequantize, DEQUANTIZABLE};
pub use file::{
    GgufFile, GgufTensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS,
    MAX_TENSOR_NAME_LEN,
};
pub use source::{family_of, fit_llama3_scaling, unpermute_rows, GgufSource, ROPE_FREQS_TENSOR};
pub use types::{GgmlType, MetaArray, MetaType, MetaValue};
pub use write::GgufWriter;

use crate::error::{ModelError, Result};

impl GgufFile {
    fn require_tensor(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| ModelError::tensor(name, format!("not in {}", self.path().display())))
    }

    /// The tensor `name` dequantised to f32 (in ggml element order, i.e. row-major over the HF
    /// shape).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.dequantize(self.require_tensor(name)?)
    }

    /// Dequantises a tensor of this file to f32.
    pub fn dequantize(&self, info: &GgufTensorInfo) -> Result<Vec<f32>> {
        // Unsupported types fail before allocating; for the others the element count is bounded
        // by the file size (the parser checked that the bytes exist).
        dequant::check_dequantizable(&info.name, info.ggml_type)?;
        let mut out = vec![0f32; info.n_elements() as usize];
        dequantize(&info.name, info.ggml_type, self.tensor_data(info), &mut out)?;
        Ok(out)
    }

    /// The integer codes and scales of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensor (see [`unpack_codes`]).
    pub fn tensor_codes(&self, name: &str) -> Result<QuantCodes> {
        let info = self.require_tensor(name)?;
        unpack_codes(&info.name, info.ggml_type, self.tensor_data(info))
    }
}
