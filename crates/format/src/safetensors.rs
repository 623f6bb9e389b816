//! safetensors files (formats.md §2.1): strict reading through mmap, HF-style writing, and whole
//! checkpoints (an index with shards, a directory of shards, or a single file).
//!
//! Reading validates everything the reference implementation validates — header length at most
//! 100 MB and inside the file, a JSON object starting with `{`, known dtypes, no duplicate names,
//! `data_offsets` tiling the data buffer exactly, sizes equal to `numel·bits/8` computed without
//! overflow — and reports problems as [`FormatError`]s naming the file and the tensor.

use crate::dtype::{tensor_byte_len, Dtype};
use crate::error::{FormatError, Result};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The largest header the reference implementation accepts.
pub const MAX_HEADER_LEN: u64 = 100_000_000;
/// The index file of a sharded HF checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
const METADATA_KEY: &str = "__metadata__";

/// A tensor inside a safetensors file (or a container shard).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

#[derive(Debug)]
struct TensorInfo {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Offsets relative to the data buffer, end exclusive.
    begin: usize,
    end: usize,
}

/// The parsed header of a safetensors file.
#[derive(Debug)]
struct Header {
    /// N, the JSON length (padding included).
    json_len: usize,
    /// Sorted by data offset (header order among zero-size tensors at the same offset).
    tensors: Vec<TensorInfo>,
    metadata: Option<BTreeMap<String, String>>,
}

/// An open, validated safetensors file, memory-mapped.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    header: Header,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("len", &self.mmap.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Opens and validates `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::input::open_regular(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the map is read-only; like every mmap-based loader we rely on nobody
        // truncating or rewriting the file while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        let header = parse_header(path, &mmap)?;
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            mmap,
            header,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.mmap.len() as u64
    }
    /// The whole file.
    pub fn file_bytes(&self) -> &[u8] {
        &self.mmap
    }
    /// The exact header JSON bytes (N bytes, padding included, without the 8-byte length).
    pub fn header_bytes(&self) -> &[u8] {
        &self.mmap[8..8 + self.header.json_len]
    }
    /// The bytes before the data buffer: the 8-byte length followed by the header JSON.
    pub fn prefix_bytes(&self) -> &[u8] {
        &self.mmap[..self.data_start()]
    }
    /// File offset of the data buffer (8 + N).
    pub fn data_start(&self) -> usize {
        8 + self.header.json_len
    }
    /// The `__metadata__` map, if the header has one.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.header.metadata.as_ref()
    }
    pub fn len(&self) -> usize {
        self.header.tensors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.header.tensors.is_empty()
    }
    /// Tensors in the order of their data in the file.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = TensorView<'_>> + '_ {
        self.header.tensors.iter().map(|t| self.view(t))
    }
    /// The tensor called `name`, if the file has it.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name
            .get(name)
            .map(|&i| self.view(&self.header.tensors[i]))
    }
    /// The tensor called `name`; an error naming the file and tensor if it is absent.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name)
            .ok_or_else(|| FormatError::tensor(&self.path, name, "no such tensor in this file"))
    }
    /// Absolute file offset of the tensor's data.
    pub fn data_offset(&self, name: &str) -> Option<u64> {
        self.by_name
            .get(name)
            .map(|&i| (self.data_start() + self.header.tensors[i].begin) as u64)
    }

    /// Position of `name` in [`tensors`](Self::tensors) order.
    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }
    /// The tensor at position `i` of [`tensors`](Self::tensors) order.
    pub(crate) fn tensor_at(&self, i: usize) -> TensorView<'_> {
        self.view(&self.header.tensors[i])
    }

    fn view<'a>(&'a self, t: &'a TensorInfo) -> TensorView<'a> {
        let start = self.data_start();
        TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &self.mmap[start + t.begin..start + t.end],
        }
    }
}

/// Parses and validates the header of a whole safetensors file held in `bytes`.
fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let file_len = bytes.len() as u64;
    if file_len < 8 {
        return Err(FormatError::file(
            path,
            format!("file is {file_len} bytes, too short for a safetensors header (truncated?)"),
        ));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_LEN {
        return Err(FormatError::file(
            path,
            format!("header length {n} exceeds the safetensors limit of {MAX_HEADER_LEN} bytes (not a safetensors file, or corrupt)"),
        ));
    }
    if 8 + n > file_len {
        return Err(FormatError::file(
            path,
            format!("header length {n} runs past the end of the {file_len}-byte file (truncated?)"),
        ));
    }
    let json_len = n as usize;
    let json = &bytes[8..8 + json_len];
    if json.first() != Some(&b'{') {
        return Err(FormatError::file(
            path,
            "header does not start with '{' (not a safetensors file, or corrupt)",
        ));
    }
    let entries =
        parse_json_entries(json).map_err(|e| FormatError::file(path, format!("header: {e}")))?;
    let data_len = bytes.len() - 8 - json_len;

    let mut tensors = Vec::with_capacity(entries.len());
    let mut metadata = None;
    let mut seen = HashMap::with_capacity(entries.len());
    for (name, value) in entries {
        if seen.insert(name.clone(), ()).is_some() {
            return Err(FormatError::tensor(
                path,
                &name,
                "appears twice in the header",
            ));
        }
        if name == METADATA_KEY {
            metadata = Some(parse_metadata(&value).map_err(|m| {
                FormatError::file(path, format!("header field {METADATA_KEY}: {m}"))
            })?);
            continue;
        }
        let info =
            parse_entry(name, &value).map_err(|(name, m)| FormatError::tensor(path, &name, m))?;
        tensors.push(info);
    }

    // Offsets must tile the data buffer exactly: sorted by offset, each tensor starts where the
    // previous one ended, the first at 0 and the last at the end of the file.
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut expected = 0usize;
    let mut previous: Option<&str> = None;
    for t in &tensors {
        if t.end > data_len {
            return Err(FormatError::tensor(
                path,
                &t.name,
                format!(
                    "data_offsets [{}, {}] run past the end of the data buffer ({data_len} bytes; file truncated?)",
                    t.begin, t.end
                ),
            ));
        }
        if t.begin > expected {
            return Err(FormatError::tensor(
                path,
                &t.name,
                format!("bytes [{expected}, {}) of the data buffer before this tensor belong to no tensor", t.begin),
            ));
        }
        if t.begin < expected {
            return Err(FormatError::tensor(
                path,
                &t.name,
                format!(
                    "data_offsets [{}, {}] overlap tensor '{}'",
                    t.begin,
                    t.end,
                    previous.unwrap_or("")
                ),
            ));
        }
        expected = t.end;
        previous = Some(&t.name);
    }
    if expected != data_len {
        return Err(FormatError::file(
            path,
            format!(
                "{} bytes after the last tensor's data belong to no tensor",
                data_len - expected
            ),
        ));
    }
    Ok(Header {
        json_len,
        tensors,
        metadata,
    })
}

/// The header's top-level entries in file order (a plain map would hide duplicate names).
fn parse_json_entries(json: &[u8]) -> std::result::Result<Vec<(String, Value)>, String> {
    struct Entries(Vec<(String, Value)>);
    impl<'de> serde::Deserialize<'de> for Entries {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Entries;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> std::result::Result<Entries, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = map.next_entry::<String, Value>()? {
                        out.push((k, v));
                    }
                    Ok(Entries(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    let text = std::str::from_utf8(json).map_err(|e| format!("not UTF-8: {e}"))?;
    let entries: Entries = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    Ok(entries.0)
}

fn parse_metadata(value: &Value) -> std::result::Result<BTreeMap<String, String>, String> {
    let obj = value.as_object().ok_or("must be an object of strings")?;
    obj.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            _ => Err(format!("value of '{k}' is not a string")),
        })
        .collect()
}

fn parse_entry(name: String, value: &Value) -> std::result::Result<TensorInfo, (String, String)> {
    let fail = |name: &str, m: String| (name.to_string(), m);
    let obj = value
        .as_object()
        .ok_or_else(|| fail(&name, "entry is not a JSON object".into()))?;
    let dtype = match obj.get("dtype") {
        Some(Value::String(s)) => {
            Dtype::from_name(s).ok_or_else(|| fail(&name, format!("unknown dtype '{s}'")))?
        }
        Some(_) => return Err(fail(&name, "dtype is not a string".into())),
        None => return Err(fail(&name, "missing field dtype".into())),
    };
    let shape = match obj.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| {
                fail(
                    &name,
                    format!(
                        "shape {} is not a list of non-negative integers",
                        Value::Array(dims.clone())
                    ),
                )
            })?,
        Some(_) => return Err(fail(&name, "shape is not a list".into())),
        None => return Err(fail(&name, "missing field shape".into())),
    };
    let (begin, end) = match obj.get("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => {
            let get = |v: &Value| v.as_u64().and_then(|x| usize::try_from(x).ok());
            match (get(&o[0]), get(&o[1])) {
                (Some(b), Some(e)) => (b, e),
                _ => {
                    return Err(fail(
                        &name,
                        "data_offsets are not two non-negative integers".into(),
                    ))
                }
            }
        }
        Some(_) => {
            return Err(fail(
                &name,
                "data_offsets is not a list of two integers".into(),
            ))
        }
        None => return Err(fail(&name, "missing field data_offsets".into())),
    };
    if end < begin {
        return Err(fail(
            &name,
            format!("data_offsets [{begin}, {end}] end before they begin"),
        ));
    }
    let want = tensor_byte_len(dtype, &shape).map_err(|m| fail(&name, m))?;
    if end - begin != want {
        return Err(fail(
            &name,
            format!(
                "data_offsets [{begin}, {end}] hold {} bytes but {dtype} × {shape:?} needs {want}",
                end - begin
            ),
        ));
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// One tensor's line in a header being written.
pub(crate) struct HeaderEntry<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub begin: u64,
    pub end: u64,
}

/// The 8-byte length and the header JSON as HF's writer emits them: compact JSON,
/// `__metadata__` first, entries in the given order, padded with spaces to a multiple of 8.
pub(crate) fn build_header(
    entries: &[HeaderEntry<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Vec<u8> {
    let mut json = String::from("{");
    let mut first = true;
    let mut sep = |json: &mut String| {
        if !first {
            json.push(',');
        }
        first = false;
    };
    let quote = |s: &str| serde_json::to_string(s).expect("strings serialize");
    if let Some(meta) = metadata {
        sep(&mut json);
        json.push_str(&quote(METADATA_KEY));
        json.push_str(":{");
        let items: Vec<String> = meta
            .iter()
            .map(|(k, v)| format!("{}:{}", quote(k), quote(v)))
            .collect();
        json.push_str(&items.join(","));
        json.push('}');
    }
    for e in entries {
        sep(&mut json);
        let dims: Vec<String> = e.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            quote(e.name),
            e.dtype.name(),
            dims.join(","),
            e.begin,
            e.end
        ));
    }
    json.push('}');
    let padded = json.len().div_ceil(8) * 8;
    let mut out = Vec::with_capacity(8 + padded);
    out.extend_from_slice(&(padded as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(8 + padded, b' ');
    out
}

/// Checks a tensor a caller wants written: a usable name and bytes matching dtype × shape.
pub(crate) fn check_tensor_data(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    len: usize,
) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("tensor name is empty".into());
    }
    if name == METADATA_KEY {
        return Err(format!(
            "tensor name '{METADATA_KEY}' is reserved by safetensors"
        ));
    }
    let want = tensor_byte_len(dtype, shape).map_err(|m| format!("tensor '{name}': {m}"))?;
    if len != want {
        return Err(format!(
            "tensor '{name}': {len} bytes given but {dtype} × {shape:?} needs {want}"
        ));
    }
    Ok(())
}

/// Writes a safetensors file with the tensors in the given order (header and data alike), the
/// way HF's writer lays a file out. Fails if a name repeats or bytes do not match dtype × shape.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorView<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<()> {
    let mut names = HashMap::with_capacity(tensors.len());
    let mut entries = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        check_tensor_data(t.name, t.dtype, t.shape, t.bytes.len())
            .map_err(|m| FormatError::file(path, m))?;
        if names.insert(t.name, ()).is_some() {
            return Err(FormatError::tensor(path, t.name, "given twice"));
        }
        let end = offset + t.bytes.len() as u64;
        entries.push(HeaderEntry {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            begin: offset,
            end,
        });
        offset = end;
    }
    let header = build_header(&entries, metadata);
    let write = || -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(File::create(path)?);
        w.write_all(&header)?;
        for t in tensors {
            w.write_all(t.bytes)?;
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| FormatError::io(path, e))
}

/// An HF checkpoint: `model.safetensors.index.json` with its shards, a directory of
/// `*.safetensors` files, or a single file.
#[derive(Debug)]
pub struct Checkpoint {
    root: PathBuf,
    /// (name relative to `root`, file), sorted by name.
    files: Vec<(String, SafetensorsFile)>,
    /// tensor name -> (file index, ...), for lookups.
    by_name: HashMap<String, usize>,
    index: Option<PathBuf>,
}

impl Checkpoint {
    /// Opens a checkpoint directory or a single `.safetensors` file. With an index, exactly the
    /// shards it names are used (others in the directory are ignored); every tensor it maps must
    /// be in the shard it names. Without one, every `*.safetensors` file of the directory is.
    /// A tensor name found in two files is an error.
    pub fn open(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?;
        if !meta.is_dir() {
            let root = path.parent().map(Path::to_path_buf).unwrap_or_default();
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| FormatError::file(path, "not a file name"))?;
            let file = SafetensorsFile::open(path)?;
            return Self::assemble(root, vec![(name, file)], None);
        }
        let index_path = path.join(INDEX_FILE);
        if index_path.exists() {
            return Self::open_indexed(path, &index_path);
        }
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|e| FormatError::io(path, e))? {
            let entry = entry.map_err(|e| FormatError::io(path, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            // (Not only regular files: a FIFO or device of this name is then refused by name.)
            if name.ends_with(".safetensors") && !entry.path().is_dir() {
                names.push(name);
            }
        }
        if names.is_empty() {
            return Err(FormatError::file(
                path,
                format!("no *.safetensors files and no {INDEX_FILE}"),
            ));
        }
        names.sort();
        let files = names
            .into_iter()
            .map(|n| SafetensorsFile::open(&path.join(&n)).map(|f| (n, f)))
            .collect::<Result<Vec<_>>>()?;
        Self::assemble(path.to_path_buf(), files, None)
    }

    fn open_indexed(root: &Path, index_path: &Path) -> Result<Self> {
        let text = crate::input::read_limited(index_path, crate::input::JSON_LIMIT)
            .map_err(|e| FormatError::io(index_path, e))?;
        let json: Value = serde_json::from_slice(&text)
            .map_err(|e| FormatError::file(index_path, format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| FormatError::file(index_path, "no \"weight_map\" object"))?;
        // shard name -> tensors the index puts there
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, shard) in map {
            let shard = shard.as_str().ok_or_else(|| {
                FormatError::tensor(index_path, tensor, "weight_map value is not a file name")
            })?;
            crate::input::check_relative_path(shard).map_err(|m| {
                FormatError::tensor(index_path, tensor, format!("shard '{shard}': {m}"))
            })?;
            shards.entry(shard).or_default().push(tensor);
        }
        if shards.is_empty() {
            return Err(FormatError::file(index_path, "weight_map is empty"));
        }
        let mut files = Vec::with_capacity(shards.len());
        for (shard, tensors) in &shards {
            let shard_path = root.join(shard);
            if !shard_path.is_file() {
                return Err(FormatError::tensor(
                    index_path,
                    tensors[0],
                    format!(
                        "shard '{shard}' is missing ({} tensors map to it)",
                        tensors.len()
                    ),
                ));
            }
            let file = SafetensorsFile::open(&shard_path)?;
            for t in tensors {
                if file.get(t).is_none() {
                    return Err(FormatError::tensor(
                        &shard_path,
                        t,
                        format!("{INDEX_FILE} maps this tensor to this shard but the shard does not hold it"),
                    ));
                }
            }
            files.push((shard.to_string(), file));
        }
        Self::assemble(root.to_path_buf(), files, Some(index_path.to_path_buf()))
    }

    fn assemble(
        root: PathBuf,
        files: Vec<(String, SafetensorsFile)>,
        index: Option<PathBuf>,
    ) -> Result<Self> {
        let mut by_name = HashMap::new();
        for (i, (_, f)) in files.iter().enumerate() {
            for t in f.tensors() {
                if let Some(j) = by_name.insert(t.name.to_string(), i) {
                    return Err(FormatError::tensor(
                        f.path(),
                        t.name,
                        format!("also present in {}", files[j].1.path().display()),
                    ));
                }
            }
        }
        Ok(Checkpoint {
            root,
            files,
            by_name,
            index,
        })
    }

    /// The directory holding the checkpoint's files.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The index file, if the checkpoint has one.
    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }
    /// The safetensors files with their names relative to [`root`](Self::root), sorted by name.
    pub fn files(&self) -> impl ExactSizeIterator<Item = (&str, &SafetensorsFile)> + '_ {
        self.files.iter().map(|(n, f)| (n.as_str(), f))
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
    /// All tensors: file by file, in data order within a file.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        self.files.iter().flat_map(|(_, f)| f.tensors())
    }
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name
            .get(name)
            .and_then(|&i| self.files[i].1.get(name))
    }
    /// The tensor called `name`; an error naming the checkpoint and tensor if it is absent.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name).ok_or_else(|| {
            FormatError::tensor(&self.root, name, "no such tensor in the checkpoint")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A file from a header JSON text (padded to 8) and a data buffer.
    fn file_bytes(json: impl AsRef<[u8]>, data: &[u8]) -> Vec<u8> {
        let mut json = json.as_ref().to_vec();
        json.resize(json.len().div_ceil(8) * 8, b' ');
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out.extend_from_slice(data);
        out
    }

    fn parse_err(bytes: &[u8]) -> String {
        let e = parse_header(Path::new("dir/x.safetensors"), bytes)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("dir/x.safetensors: "), "{e}");
        e
    }

    #[test]
    fn parses_a_valid_header() {
        let json = r#"{"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"BF16","shape":[0],"data_offsets":[8,8]}}"#;
        let bytes = file_bytes(json, &[0; 11]);
        let h = parse_header(Path::new("x"), &bytes).unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "z", "b"], "sorted by offset");
        assert_eq!(h.metadata.unwrap()["format"], "pt");
        assert_eq!(h.json_len % 8, 0);
    }

    #[test]
    fn rejects_bad_headers_naming_the_problem() {
        let t = |json: &str, data_len: usize| parse_err(&file_bytes(json, &vec![0; data_len]));
        let ok_a = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;

        assert!(parse_err(&[1, 2, 3]).contains("too short"));
        let mut huge = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}      ");
        assert!(parse_err(&huge).contains("exceeds the safetensors limit"));
        let mut past = 1000u64.to_le_bytes().to_vec();
        past.extend_from_slice(b"{}      ");
        assert!(parse_err(&past).contains("runs past the end"));
        assert!(t("[]", 0).contains("does not start with '{'"));
        assert!(parse_err(&file_bytes(b"{\"a\xff\":1}", &[])).contains("not UTF-8"));
        assert!(t("{\"a\":", 0).contains("invalid JSON"));
        assert!(t(&format!("{{{ok_a}}} x"), 8).contains("invalid JSON"));

        let e = t(&format!("{{{ok_a},{ok_a}}}"), 8);
        assert!(e.contains("tensor 'a': appears twice"), "{e}");
        let e = t(
            r#"{"w":{"dtype":"F9","shape":[1],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(e.contains("tensor 'w': unknown dtype 'F9'"), "{e}");
        let e = t(
            r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(
            e.contains("tensor 'w'") && e.contains("non-negative"),
            "{e}"
        );
        let e = t(
            r#"{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(e.contains("tensor 'w'"), "{e}");
        let e = t(r#"{"w":{"dtype":"F32","shape":[1]}}"#, 4);
        assert!(e.contains("tensor 'w': missing field data_offsets"), "{e}");
        let e = t(r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#, 4);
        assert!(e.contains("tensor 'w': data_offsets"), "{e}");
        let e = t(
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(
            e.contains("tensor 'w'") && e.contains("hold 8 bytes") && e.contains("needs 12"),
            "{e}"
        );
        let e = t(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            4,
        );
        assert!(e.contains("end before they begin"), "{e}");
        let e = t(
            r#"{"w":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}}"#,
            0,
        );
        assert!(e.contains("tensor 'w'") && e.contains("overflows"), "{e}");
        let e = t(
            r#"{"w":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}"#,
            1,
        );
        assert!(e.contains("whole bytes"), "{e}");
        // Tiling: a hole, an overlap, trailing bytes, a truncated buffer.
        let e = t(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(
            e.contains("tensor 'w'") && e.contains("belong to no tensor"),
            "{e}"
        );
        let e = t(
            &format!(r#"{{{ok_a},"b":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}}}"#),
            8,
        );
        assert!(
            e.contains("tensor 'b'") && e.contains("overlap tensor 'a'"),
            "{e}"
        );
        let e = t(&format!("{{{ok_a}}}"), 9);
        assert!(e.contains("1 bytes after the last tensor"), "{e}");
        let e = t(&format!("{{{ok_a}}}"), 5);
        assert!(e.contains("tensor 'a'") && e.contains("truncated"), "{e}");
        let e = t(r#"{"__metadata__":{"k":1}}"#, 0);
        assert!(
            e.contains("__metadata__") && e.contains("'k' is not a string"),
            "{e}"
        );
        let e = t(r#"{"w":[]}"#, 0);
        assert!(e.contains("tensor 'w': entry is not a JSON object"), "{e}");
    }

    #[test]
    fn header_matches_hf_layout() {
        let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let entries = [
            HeaderEntry {
                name: "x\"y",
                dtype: Dtype::BF16,
                shape: &[2, 3],
                begin: 0,
                end: 12,
            },
            HeaderEntry {
                name: "s",
                dtype: Dtype::F32,
                shape: &[],
                begin: 12,
                end: 16,
            },
        ];
        let h = build_header(&entries, Some(&meta));
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(h.len(), 8 + n);
        assert_eq!(n % 8, 0);
        let text = std::str::from_utf8(&h[8..]).unwrap();
        assert_eq!(
            text.trim_end(),
            r#"{"__metadata__":{"format":"pt"},"x\"y":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"s":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}"#
        );
        assert!(text.len() - text.trim_end().len() < 8);
    }

    fn arb_tensors() -> impl Strategy<Value = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>> {
        let one = (
            0..Dtype::ALL.len(),
            proptest::collection::vec(0usize..4, 0..4),
            any::<u64>(),
        )
            .prop_map(|(d, mut shape, seed)| {
                let dtype = Dtype::ALL[d];
                // Sub-byte types need an even number of nibbles / whole bytes.
                if dtype.bits() < 8 {
                    shape.push(8);
                }
                let len = tensor_byte_len(dtype, &shape).unwrap();
                let bytes = (0..len as u64)
                    .map(|i| (seed.wrapping_mul(i + 1) >> 7) as u8)
                    .collect();
                (dtype, shape, bytes)
            });
        proptest::collection::vec(one, 0..6).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (d, s, b))| (format!("t{i}.weight"), d, s, b))
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn write_then_read_round_trips(tensors in arb_tensors(), with_meta in any::<bool>()) {
            let dir = std::env::temp_dir().join(format!("entrollm-st-prop-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("p.safetensors");
            let views: Vec<TensorView> = tensors
                .iter()
                .map(|(n, d, s, b)| TensorView { name: n, dtype: *d, shape: s, bytes: b })
                .collect();
            let meta: BTreeMap<String, String> = [("k".to_string(), "v\n\"".to_string())].into();
            write_safetensors(&path, &views, with_meta.then_some(&meta)).unwrap();
            let f = SafetensorsFile::open(&path).unwrap();
            prop_assert_eq!(f.len(), tensors.len());
            prop_assert_eq!(f.metadata().is_some(), with_meta);
            prop_assert_eq!(f.data_start() % 8, 0);
            for (n, d, s, b) in &tensors {
                let v = f.tensor(n).unwrap();
                prop_assert_eq!(v.dtype, *d);
                prop_assert_eq!(v.shape, s.as_slice());
                prop_assert_eq!(v.bytes, b.as_slice());
                prop_assert_eq!(&f.file_bytes()[f.data_offset(n).unwrap() as usize..][..b.len()], b.as_slice());
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn writer_rejects_bad_input() {
        let dir = std::env::temp_dir().join(format!("entrollm-st-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.safetensors");
        let v = |name, len| TensorView {
            name,
            dtype: Dtype::F32,
            shape: &[2],
            bytes: &[0u8; 8][..len],
        };
        let e = write_safetensors(&path, &[v("a", 7)], None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor 'a': 7 bytes given but F32 × [2] needs 8"),
            "{e}"
        );
        let e = write_safetensors(&path, &[v("a", 8), v("a", 8)], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor 'a': given twice"), "{e}");
        let e = write_safetensors(&path, &[v("__metadata__", 8)], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("reserved"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
