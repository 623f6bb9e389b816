//! entrollm containers made from a GGUF file (`entrollm compress model.gguf`): the GGUF's header is
//! the container's only source prefix, every GGUF tensor is a container tensor of the same name
//! (code-bearing blocks entropy-coded, see [`GgmlCoded`]; others stored as they are). Loading
//! rebuilds the GGUF image in memory and serves it through [`GgufSource`], so config, tokenizer,
//! chat template and tensor layouts are exactly the GGUF's.

use super::file::GgufFile;
use super::source::GgufSource;
use crate::error::{ModelError, Result};
use crate::forms::StoredMatrix;
use crate::weights::Linear;
use entrollm_format::coded::Coded;
use entrollm_format::{ContainerReader, StoredData};
use std::collections::HashMap;
use std::sync::Arc;

/// How much of a GGUF-sourced container to materialise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufLoad {
    /// Only the header: metadata and tensor infos (tensor data reads as zeros).
    Header,
    /// Every tensor decoded: the GGUF image byte for byte.
    Decoded,
    /// Coded block matrices stay coded and run through the fused decode-matvec
    /// ([`CodedLinear`](crate::load::CodedLinear)); their bytes in the image stay zero (and untouched pages cost no memory).
    Fused,
}

/// Whether the container was made from one GGUF file.
pub fn is_gguf_container(reader: &ContainerReader) -> bool {
    let m = reader.manifest();
    m.sources.len() == 1 && m.sources[0].name.ends_with(".gguf") && m.verbatim.is_empty()
}

/// Rebuilds the GGUF of a GGUF-sourced container as a [`GgufSource`]. Every tensor that is
/// decoded is checked against its checksum (also the fused ones, once, at load). Block matrices
/// stored uncoded are served as the GGUF's blocks (form `ggml`).
pub fn open_gguf_container(reader: &ContainerReader, load: GgufLoad) -> Result<GgufSource> {
    let (file, linears) = rebuild(reader, load)?;
    Ok(GgufSource::new(file)?.with_linears(linears))
}

/// The GGUF header of a GGUF-sourced container (metadata, tensor types and shapes; the tensor
/// data reads as zeros), for any architecture.
pub fn gguf_container_header(reader: &ContainerReader) -> Result<GgufFile> {
    Ok(rebuild(reader, GgufLoad::Header)?.0)
}

/// Matrices served as they are stored, by GGUF name.
type Linears = HashMap<String, Arc<dyn Linear>>;

/// The GGUF image of the container, and the matrices kept coded (`Fused`).
fn rebuild(reader: &ContainerReader, load: GgufLoad) -> Result<(GgufFile, Linears)> {
    let dir = reader.dir();
    if !is_gguf_container(reader) {
        return Err(ModelError::format(
            dir,
            "not a container made from a single GGUF file",
        ));
    }
    let fmt = |e: entrollm_format::FormatError| ModelError::format(dir, e.to_string());
    let src = &reader.manifest().sources[0];
    let size = usize::try_from(src.size)
        .map_err(|_| ModelError::format(dir, "the GGUF is larger than this machine's memory"))?;
    // Zeroed allocation: pages never written (the tensor data in `Header` mode, the coded matrices
    // in `Fused` mode) are never backed by memory.
    let mut image = vec![0u8; size];
    let prefix = reader.source_prefix(0);
    image[..prefix.len()].copy_from_slice(prefix);
    let mut linears = Linears::new();
    if load != GgufLoad::Header {
        for seg in &src.segments {
            let t = reader.tensor(&seg.tensor).map_err(fmt)?;
            let at = usize::try_from(seg.offset).unwrap_or(usize::MAX);
            let end = at.checked_add(t.byte_len()).filter(|&e| e <= size);
            let Some(end) = end else {
                return Err(ModelError::format(
                    dir,
                    format!(
                        "tensor '{}' at offset {} does not fit the {size}-byte GGUF",
                        seg.tensor, seg.offset
                    ),
                ));
            };
            match &t.data {
                StoredData::Plain(b) => {
                    reader.verify_checksum(&seg.tensor, b).map_err(fmt)?;
                    image[at..end].copy_from_slice(b)
                }
                StoredData::Coded(c) => {
                    let coded = Coded::from_stored(t.dtype, t.shape, c)
                        .map_err(|e| ModelError::tensor(&seg.tensor, e.to_string()))?;
                    let bytes = coded
                        .decode()
                        .map_err(|e| ModelError::tensor(&seg.tensor, e.to_string()))?;
                    reader.verify_checksum(&seg.tensor, &bytes).map_err(fmt)?;
                    let stored = StoredMatrix {
                        name: &seg.tensor,
                        dtype: t.dtype,
                        shape: t.shape,
                        in_gguf: true,
                    };
                    // The form that serves it as stored (its bytes in the image stay zero).
                    let keeper = crate::forms::loader(&coded, &stored)
                        .filter(|f| load == GgufLoad::Fused && !f.coded_only_when_asked());
                    match keeper {
                        Some(f) => {
                            linears.insert(seg.tensor.clone(), f.load(coded, &stored)?);
                        }
                        None => image[at..end].copy_from_slice(&bytes),
                    }
                }
            }
        }
        // The header has no checksum of its own: its shard's is checked before it is parsed,
        // after every tensor's own check, so that damage in a tensor is named by that tensor's
        // (not for `Header`, which serves `inspect` only).
        reader.verify_prefix(0).map_err(fmt)?;
    }
    Ok((GgufFile::from_bytes(dir.join(&src.name), image)?, linears))
}
