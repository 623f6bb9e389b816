//! A small GGUF v3 writer: lays out metadata and tensors the way gguf-py does (tensors packed in
//! order, each padded to the alignment). Used for test fixtures and fuzz seeds, and by tools that
//! export GGUF.

use super::file::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use super::types::{GgmlType, MetaArray, MetaValue};

/// Collects metadata and tensors, then serialises them with [`GgufWriter::to_bytes`].
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, GgmlType, Vec<u64>, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry (entries are written in the order they are added).
    pub fn meta(&mut self, key: impl Into<String>, value: MetaValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    pub fn meta_str(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.meta(key, MetaValue::String(value.into()))
    }

    pub fn meta_u32(&mut self, key: impl Into<String>, value: u32) -> &mut Self {
        self.meta(key, MetaValue::U32(value))
    }

    pub fn meta_f32(&mut self, key: impl Into<String>, value: f32) -> &mut Self {
        self.meta(key, MetaValue::F32(value))
    }

    /// Adds a tensor: `dims` in ggml order (ne0 first), `data` its raw bytes.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        ggml_type: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.into(), ggml_type, dims.to_vec(), data));
        self
    }

    /// Adds an F32 tensor.
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, GgmlType::F32, dims, data)
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// The file image. Tensor data lengths are written as given, so a caller can also produce
    /// deliberately inconsistent files for tests.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self.alignment() as usize;
        let pad = |n: usize| (alignment - n % alignment) % alignment;
        let mut out = Vec::new();
        out.extend_from_slice(GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_str(&mut out, key);
            out.extend_from_slice(&value.meta_type().id().to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, ty, dims, data) in &self.tensors {
            write_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += data.len() + pad(data.len());
        }
        if !self.tensors.is_empty() {
            out.resize(out.len() + pad(out.len()), 0);
            for (_, _, _, data) in &self.tensors {
                out.extend_from_slice(data);
                out.resize(out.len() + pad(data.len()), 0);
            }
        }
        out
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.push(*v as u8),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(s) => write_str(out, s),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Array(a) => {
            out.extend_from_slice(&a.elem_type().id().to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            macro_rules! each {
                ($v:expr) => {
                    for x in $v {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                };
            }
            match a {
                MetaArray::U8(v) => out.extend_from_slice(v),
                MetaArray::I8(v) => each!(v),
                MetaArray::U16(v) => each!(v),
                MetaArray::I16(v) => each!(v),
                MetaArray::U32(v) => each!(v),
                MetaArray::I32(v) => each!(v),
                MetaArray::F32(v) => each!(v),
                MetaArray::U64(v) => each!(v),
                MetaArray::I64(v) => each!(v),
                MetaArray::F64(v) => each!(v),
                MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
                MetaArray::String(v) => v.iter().for_each(|s| write_str(out, s)),
            }
        }
    }
}
