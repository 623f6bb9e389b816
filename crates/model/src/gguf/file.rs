//! The GGUF container: header, metadata and tensor infos, validated as strictly as ggml's
//! `gguf.cpp` (formats.md §1.1), over a memory map or an owned byte buffer.
//!
//! Every count and length read from the file is checked against the bytes that are left before
//! anything is allocated, so a lying field gives an error, never a huge allocation or a panic.

use super::types::{GgmlType, MetaArray, MetaType, MetaValue};
use crate::error::{ModelError, Result};
use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml rejects names of `GGML_MAX_NAME` (64) bytes or more.
pub const MAX_TENSOR_NAME_LEN: usize = 63;
pub const MAX_DIMS: usize = 4;
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Fewest bytes of one tensor info: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_SIZE: u64 = 8 + 4 + 4 + 8;
/// Fewest bytes of one key/value pair: key length, a one-byte key, value type, a one-byte value.
const MIN_KV_SIZE: u64 = 8 + 1 + 4 + 1;

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// One tensor's info block.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// Dimensions in ggml order: `dims[0]` (ne0) is the contiguous one. `n_dims` entries.
    pub dims: Vec<u64>,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Bytes of the tensor's data (without alignment padding).
    pub n_bytes: u64,
    /// Absolute byte offset of the data in the file.
    pub(crate) file_offset: usize,
}

impl GgufTensorInfo {
    /// ggml's `ne[4]`: the dims padded with 1s.
    pub fn ne(&self) -> [u64; 4] {
        let mut ne = [1u64; 4];
        ne[..self.dims.len()].copy_from_slice(&self.dims);
        ne
    }

    /// The shape in PyTorch / Hugging Face order (dims reversed): `[out, in]` for a linear weight.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Elements per row (ne0); quantization blocks never straddle rows.
    pub fn row_len(&self) -> usize {
        self.ne()[0] as usize
    }

    /// Rows: ne1·ne2·ne3.
    pub fn n_rows(&self) -> usize {
        self.ne()[1..].iter().product::<u64>() as usize
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.ggml_type.block_size() * self.ggml_type.type_size()
    }

    /// The absolute byte range of the data in the file.
    pub fn file_range(&self) -> Range<usize> {
        self.file_offset..self.file_offset + self.n_bytes as usize
    }
}

/// A parsed, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    /// Shared with the matrices served from the file's own blocks (form `ggml`).
    bytes: Arc<Bytes>,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        };
        let file = entrollm_format::input::open_regular(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(ModelError::format(
                path,
                format!("not a GGUF file: only {len} bytes"),
            ));
        }
        // SAFETY: the map is read-only; like every mmap-based loader we rely on the file not being
        // truncated or rewritten while it is open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory; `label` names it in error messages.
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(label.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let header = parse_header(&bytes, &path)?;
        let Header {
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
        } = header;
        let metadata_index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path,
            bytes: Arc::new(bytes),
            version,
            alignment,
            data_offset,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's data bytes (validated to lie inside the file when the file was parsed).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.bytes[info.file_range()]
    }

    /// The tensor's data bytes as a handle that keeps the file's map alive (no copy).
    pub fn tensor_block_bytes(&self, info: &GgufTensorInfo) -> crate::forms::ggml::BlockBytes {
        crate::forms::ggml::BlockBytes::new(self.bytes.clone(), info.file_range())
    }

    fn type_error(&self, key: &str, expected: &str, found: &MetaValue) -> ModelError {
        ModelError::format(
            &self.path,
            format!(
                "metadata key `{key}`: expected {expected}, found {}",
                found.type_description()
            ),
        )
    }

    /// An integer of any width, as u64 (negative values are an error).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let i = v
            .as_integer()
            .ok_or_else(|| self.type_error(key, "an integer", v))?;
        u64::try_from(i).map(Some).map_err(|_| {
            ModelError::format(&self.path, format!("metadata key `{key}`: {i} is negative"))
        })
    }

    /// An integer of any width that fits in u32 (GGUF writers use u32 for counts; the doc says u64).
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v).map(Some).map_err(|_| {
                ModelError::format(
                    &self.path,
                    format!("metadata key `{key}`: {v} does not fit in 32 bits"),
                )
            }),
        }
    }

    pub fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get_u32(key).map(|v| v.map(|v| v as usize))
    }

    /// A float (f32 or f64) or an integer, as f32.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| self.type_error(key, "a number", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.type_error(key, "a bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.type_error(key, "a string", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(MetaArray::String(v))) => Ok(Some(v)),
            Some(v) => Err(self.type_error(key, "an array of strings", v)),
        }
    }

    /// An array of bools; `None` where the key is absent or holds a scalar (a key that may hold
    /// a count instead, as `attention.sliding_window_pattern`).
    pub fn get_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>> {
        match self.get(key) {
            Some(MetaValue::Array(MetaArray::Bool(v))) => Ok(Some(v.clone())),
            Some(v @ MetaValue::Array(_)) => Err(self.type_error(key, "an array of bools", v)),
            _ => Ok(None),
        }
    }

    /// An array of numbers, as f32.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ MetaValue::Array(a)) => a
                .to_f32_vec()
                .map(Some)
                .ok_or_else(|| self.type_error(key, "an array of numbers", v)),
            Some(v) => Err(self.type_error(key, "an array of numbers", v)),
        }
    }

    /// An array of integers of any width, as i64.
    pub fn get_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ MetaValue::Array(a)) => a
                .to_i64_vec()
                .map(Some)
                .ok_or_else(|| self.type_error(key, "an array of integers", v)),
            Some(v) => Err(self.type_error(key, "an array of integers", v)),
        }
    }
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensorInfo>,
}

/// A bounds-checked little-endian reader; every error names what was being read and where.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl std::fmt::Display) -> ModelError {
        ModelError::format(self.path, msg.to_string())
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn std::fmt::Display) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format_args!(
                "truncated: {what} at offset {} needs {n} bytes, the file has {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn std::fmt::Display) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn std::fmt::Display) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn std::fmt::Display) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string (u64 length + UTF-8 bytes).
    fn string(&mut self, what: &dyn std::fmt::Display) -> Result<String> {
        let start = self.pos;
        let len = self.u64(&format_args!("length of {what}"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.err(format_args!("{what} at offset {start} is not valid UTF-8")))
    }

    /// A count that must fit in the bytes left, given that each item needs at least `min_size`.
    fn count(&mut self, min_size: u64, what: &dyn std::fmt::Display) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = self.remaining();
        if n.checked_mul(min_size).is_none_or(|need| need > left) {
            return Err(self.err(format_args!(
                "{what} at offset {at} is {n}, but the {left} bytes left in the file hold at most {}",
                left / min_size
            )));
        }
        Ok(n as usize)
    }

    fn scalar(&mut self, ty: MetaType, key: &str) -> Result<MetaValue> {
        let what = format_args!("value of `{key}`");
        Ok(match ty {
            MetaType::U8 => MetaValue::U8(self.array::<1>(&what)?[0]),
            MetaType::I8 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            MetaType::U16 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            MetaType::I16 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            MetaType::U32 => MetaValue::U32(u32::from_le_bytes(self.array(&what)?)),
            MetaType::I32 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            MetaType::F32 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            MetaType::U64 => MetaValue::U64(u64::from_le_bytes(self.array(&what)?)),
            MetaType::I64 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            MetaType::F64 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            MetaType::Bool => {
                let at = self.pos;
                match self.array::<1>(&what)?[0] {
                    0 => MetaValue::Bool(false),
                    1 => MetaValue::Bool(true),
                    b => {
                        return Err(self.err(format_args!(
                            "{what} at offset {at}: bool byte is {b}, not 0 or 1"
                        )))
                    }
                }
            }
            MetaType::String => MetaValue::String(self.string(&what)?),
            MetaType::Array => unreachable!("arrays are read by `value`"),
        })
    }

    fn value(&mut self, ty: MetaType, key: &str) -> Result<MetaValue> {
        if ty != MetaType::Array {
            return self.scalar(ty, key);
        }
        let at = self.pos;
        let elem_id = self.u32(&format_args!("array element type of `{key}`"))?;
        let elem = match MetaType::from_id(elem_id) {
            Some(MetaType::Array) => {
                return Err(self.err(format_args!(
                    "metadata key `{key}`: nested arrays are not allowed"
                )))
            }
            Some(t) => t,
            None => {
                return Err(self.err(format_args!(
                    "metadata key `{key}`: invalid array element type {elem_id} at offset {at}"
                )))
            }
        };
        let n = self.count(
            elem.min_size(),
            &format_args!("element count of array `{key}`"),
        )?;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                const W: usize = std::mem::size_of::<$t>();
                let raw = self.take((n * W) as u64, &format_args!("elements of array `{key}`"))?;
                MetaArray::$variant(
                    raw.chunks_exact(W)
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            }};
        }
        let array = match elem {
            MetaType::U8 => MetaArray::U8(
                self.take(n as u64, &format_args!("elements of array `{key}`"))?
                    .to_vec(),
            ),
            MetaType::I8 => fixed!(I8, i8),
            MetaType::U16 => fixed!(U16, u16),
            MetaType::I16 => fixed!(I16, i16),
            MetaType::U32 => fixed!(U32, u32),
            MetaType::I32 => fixed!(I32, i32),
            MetaType::F32 => fixed!(F32, f32),
            MetaType::U64 => fixed!(U64, u64),
            MetaType::I64 => fixed!(I64, i64),
            MetaType::F64 => fixed!(F64, f64),
            MetaType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let MetaValue::Bool(b) = self.scalar(MetaType::Bool, key)? else {
                        unreachable!()
                    };
                    v.push(b);
                }
                MetaArray::Bool(v)
            }
            MetaType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&format_args!("element {i} of array `{key}`"))?);
                }
                MetaArray::String(v)
            }
            MetaType::Array => unreachable!("rejected above"),
        };
        Ok(MetaValue::Array(array))
    }
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_add((alignment - x % alignment) % alignment)
}

fn parse_header(buf: &[u8], path: &Path) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.array::<4>(&"magic")?;
    if &magic != GGUF_MAGIC {
        return Err(c.err(format_args!(
            "not a GGUF file: magic is {magic:02x?}, expected \"GGUF\""
        )));
    }
    let version = c.u32(&"version")?;
    if version & 0xFFFF == 0 && version != 0 {
        return Err(c.err(format_args!(
            "GGUF version field is {version:#x}: the file is byte-swapped (big-endian), which is not supported"
        )));
    }
    match version {
        2 | 3 => {}
        1 => return Err(c.err("GGUF version 1 is not supported (only versions 2 and 3 are)")),
        v => {
            return Err(c.err(format_args!(
                "unsupported GGUF version {v} (only versions 2 and 3 are)"
            )))
        }
    }
    // Both counts are int64 in gguf.h; anything above i64::MAX is as invalid as a negative count.
    let n_tensors = c.count(MIN_TENSOR_INFO_SIZE, &"tensor count")?;
    let n_kv = c.count(MIN_KV_SIZE, &"metadata key/value count")?;

    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(n_kv);
    let mut seen_keys: HashMap<String, ()> = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.string(&format_args!("key of metadata entry {i}"))?;
        if key.is_empty() {
            return Err(c.err(format_args!(
                "metadata entry {i} at offset {at} has an empty key"
            )));
        }
        if seen_keys.insert(key.clone(), ()).is_some() {
            return Err(c.err(format_args!("duplicate metadata key `{key}`")));
        }
        let type_at = c.pos;
        let type_id = c.u32(&format_args!("value type of `{key}`"))?;
        let ty = MetaType::from_id(type_id).ok_or_else(|| {
            c.err(format_args!(
                "metadata key `{key}`: invalid value type {type_id} at offset {type_at}"
            ))
        })?;
        let value = c.value(ty, &key)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, MetaValue::U32(a))) => {
            return Err(c.err(format_args!(
                "`{ALIGNMENT_KEY}` is {a}, which is not a non-zero power of two"
            )))
        }
        Some((_, v)) => {
            return Err(c.err(format_args!(
                "`{ALIGNMENT_KEY}` must be uint32, found {}",
                v.type_description()
            )))
        }
    };

    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(n_tensors);
    let mut seen_names: HashMap<String, ()> = HashMap::with_capacity(n_tensors);
    // Running end of the data section as gguf.cpp computes it: each tensor padded to the alignment.
    let mut expected_offset: u64 = 0;
    for i in 0..n_tensors {
        let name = c.string(&format_args!("name of tensor {i}"))?;
        if name.len() > MAX_TENSOR_NAME_LEN {
            return Err(c.err(format_args!(
                "tensor {i} name `{name}` is {} bytes; at most {MAX_TENSOR_NAME_LEN} are allowed",
                name.len()
            )));
        }
        if seen_names.insert(name.clone(), ()).is_some() {
            return Err(c.err(format_args!("duplicate tensor name `{name}`")));
        }
        let n_dims = c.u32(&format_args!("n_dims of tensor `{name}`"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(c.err(format_args!(
                "tensor `{name}` has {n_dims} dimensions; at most {MAX_DIMS} are allowed"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let ne = c.u64(&format_args!("dimension {d} of tensor `{name}`"))?;
            if ne > i64::MAX as u64 {
                return Err(c.err(format_args!(
                    "tensor `{name}` dimension {d} is negative ({})",
                    ne as i64
                )));
            }
            dims.push(ne);
        }
        let type_id = c.u32(&format_args!("type of tensor `{name}`"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            c.err(format_args!(
                "tensor `{name}` has invalid or unknown ggml type {type_id}"
            ))
        })?;
        let offset = c.u64(&format_args!("offset of tensor `{name}`"))?;

        let block = ggml_type.block_size() as u64;
        let ne0 = dims.first().copied().unwrap_or(1);
        if !ne0.is_multiple_of(block) {
            return Err(c.err(format_args!(
                "tensor `{name}`: row length {ne0} is not a multiple of the {ggml_type} block size {block}"
            )));
        }
        let n_elements = dims.iter().try_fold(1u64, |acc, &d| {
            acc.checked_mul(d).filter(|&n| n <= i64::MAX as u64)
        });
        let n_bytes = n_elements
            .and_then(|n| ggml_type.bytes_for(n))
            .ok_or_else(|| {
                c.err(format_args!(
                    "tensor `{name}`: dimensions {dims:?} overflow the element or byte count"
                ))
            })?;
        if !offset.is_multiple_of(alignment) {
            return Err(c.err(format_args!(
                "tensor `{name}`: offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if offset != expected_offset {
            return Err(c.err(format_args!(
                "tensor `{name}`: offset {offset} is not where the previous tensor ends ({expected_offset}); \
                 tensors must be stored contiguously in info order"
            )));
        }
        expected_offset = align_up(n_bytes, alignment)
            .and_then(|padded| expected_offset.checked_add(padded))
            .ok_or_else(|| c.err(format_args!("tensor `{name}`: data offsets overflow")))?;
        tensors.push(GgufTensorInfo {
            name,
            ggml_type,
            dims,
            offset,
            n_bytes,
            file_offset: 0,
        });
    }

    let data_offset = align_up(c.pos as u64, alignment)
        .expect("a position inside the file plus padding fits in u64");
    if !tensors.is_empty() {
        let file_len = buf.len() as u64;
        let end = data_offset.checked_add(expected_offset);
        if end.is_none_or(|end| end > file_len) {
            return Err(c.err(format_args!(
                "truncated: the tensor data needs bytes {data_offset}..{} but the file has {file_len} bytes",
                end.map_or_else(|| "overflow".to_string(), |e| e.to_string())
            )));
        }
        for t in &mut tensors {
            // In range: data_offset + offset + n_bytes <= end <= file_len.
            t.file_offset = (data_offset + t.offset) as usize;
        }
    }
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}
