//! The entrollm container: a directory of safetensors shards, an `entrollm.json` manifest and
//! verbatim copies of the source's small files (layout in `docs/format.md`).
//!
//! - [`ContainerWriter`] streams tensors into shards inside a hidden staging directory and
//!   renames it into place in [`ContainerWriter::finish`];
//! - [`ContainerReader`] validates the manifest against the shards and hands out
//!   [`StoredTensor`]s (plain bytes, or a coder's arrays and parameters);
//! - [`restore_sources`] rebuilds the original checkpoint files bit for bit.

mod manifest;
mod reader;
mod restore;
mod writer;

pub use manifest::{
    ArrayRef, CodedEntry, FileEntry, FormEntry, Manifest, SourceEntry, SourceSegment, Storage,
    TensorEntry, FORMAT_MAJOR, FORMAT_MINOR, FORMAT_NAME, MANIFEST_FILE,
};
pub use reader::{
    CodedTensor, ContainerReader, StoredData, StoredTensor, MAX_MANIFEST_LEN, MAX_SOURCE_GAP,
};
pub use restore::restore_sources;
pub use writer::{
    ContainerWriter, SourceFile, WriterOptions, DEFAULT_SHARD_SIZE_LIMIT, TRANSFORMERS_CONFIG,
    TRANSFORMERS_INDEX,
};

use crate::dtype::Dtype;
pub(crate) use crate::input::check_relative_path;

/// The element type of a coded tensor's arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArrayDtype {
    U8,
    U32,
}

impl ArrayDtype {
    pub fn dtype(self) -> Dtype {
        match self {
            ArrayDtype::U8 => Dtype::U8,
            ArrayDtype::U32 => Dtype::U32,
        }
    }
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::U8 => Some(ArrayDtype::U8),
            Dtype::U32 => Some(ArrayDtype::U32),
            _ => None,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ArrayDtype::U8 => 1,
            ArrayDtype::U32 => 4,
        }
    }
}

/// The shard key of a coded tensor's array: `<tensor>.<coder>.<array>`.
pub fn array_key(tensor: &str, coder: &str, array: &str) -> String {
    format!("{tensor}.{coder}.{array}")
}

/// The shard key of a source file's prefix blob.
pub fn prefix_key(source: &str) -> String {
    format!("__entrollm__.prefix.{source}")
}

/// The file name of shard `index` (0-based) of `count`.
pub fn shard_name(index: usize, count: usize) -> String {
    format!("entrollm-{:05}-of-{:05}.safetensors", index + 1, count)
}

/// Whether `name` has the form of a shard name (so no verbatim file may take it).
fn looks_like_shard(name: &str) -> bool {
    name.starts_with("entrollm-") && name.ends_with(".safetensors") && !name.contains('/')
}

/// A shard name: a plain file name (no directories) ending in `.safetensors`.
pub(crate) fn check_shard_name(name: &str) -> Result<(), String> {
    check_relative_path(name)?;
    if name.contains('/') || !name.ends_with(".safetensors") {
        return Err(format!(
            "shard name '{}' is not a plain *.safetensors file name",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// Tensor names are any non-empty strings except those starting with `__` (reserved for
/// safetensors' `__metadata__` and the container's own keys).
pub(crate) fn check_tensor_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty tensor name".into());
    }
    if name.starts_with("__") {
        return Err(format!(
            "tensor name '{name}' starts with '__', which is reserved"
        ));
    }
    Ok(())
}

/// Coder and array names: `[A-Za-z0-9_-]+`, so `<tensor>.<coder>.<array>` keys read back
/// unambiguously.
pub(crate) fn check_ident(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "{what} name '{}' is not made of [A-Za-z0-9_-]",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// Names a verbatim file may not take: the manifest, shard names, the writer's work directory.
pub(crate) fn check_verbatim_name(name: &str) -> Result<(), String> {
    check_relative_path(name)?;
    if name == MANIFEST_FILE
        || looks_like_shard(name)
        || name.split('/').next() == Some(writer::WORK_DIR)
    {
        return Err(format!(
            "file name '{name}' is reserved for the container's own files"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_rules() {
        for ok in [
            "config.json",
            "original/params.json",
            ".gitattributes",
            "a b.txt",
        ] {
            assert!(check_relative_path(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a/",
            "c:\\x",
            "a\\b",
            "x\0y",
        ] {
            assert!(check_relative_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_shard_name("entrollm-00001-of-00002.safetensors").is_ok());
        for bad in ["sub/x.safetensors", "x.bin", "..", "../x.safetensors"] {
            assert!(check_shard_name(bad).is_err(), "{bad}");
        }
        for bad in [
            "entrollm.json",
            "entrollm-00001-of-00001.safetensors",
            ".entrollm-work/x",
        ] {
            assert!(check_verbatim_name(bad).is_err(), "{bad}");
        }
        assert!(check_verbatim_name("sub/entrollm-1.safetensors").is_ok());
    }

    #[test]
    fn name_rules() {
        assert!(check_tensor_name("model.layers.0.mlp.up_proj.weight").is_ok());
        assert!(check_tensor_name("__metadata__").is_err());
        assert!(check_tensor_name("").is_err());
        assert!(check_ident("coder", "dtans").is_ok());
        assert!(check_ident("array", "sign_mantissa-2").is_ok());
        for bad in ["", "a.b", "a/b", "é"] {
            assert!(check_ident("coder", bad).is_err(), "{bad}");
        }
        assert_eq!(array_key("w", "df11", "bytes"), "w.df11.bytes");
        assert_eq!(shard_name(0, 3), "entrollm-00001-of-00003.safetensors");
    }
}
