//! Writing a container: tensors are streamed into shards inside a hidden staging directory,
//! which [`ContainerWriter::finish`] checks and renames into place.

use super::manifest::{
    ArrayRef, CodedEntry, FileEntry, FormEntry, Manifest, SourceEntry, SourceSegment, Storage,
    TensorEntry, MANIFEST_FILE,
};
use super::{
    array_key, check_ident, check_relative_path, check_tensor_name, check_verbatim_name,
    prefix_key, shard_name, ArrayDtype, ContainerReader,
};
use crate::checksum::{checksum, copy_hashed, CopyError, StreamingChecksum};
use crate::dtype::{tensor_byte_len, Dtype};
use crate::error::{FormatError, Result};
use crate::safetensors::{build_header, check_tensor_data, HeaderEntry, SafetensorsFile};
use crate::staging::StagingDir;
use serde_json::Value;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Shards roll over when their data would pass this many bytes (a single larger tensor gets a
/// shard of its own).
pub const DEFAULT_SHARD_SIZE_LIMIT: u64 = 4 << 30;
/// The container's `config.json` for transformers (`generated`), and the shard index it names
/// when there are several shards.
pub const TRANSFORMERS_CONFIG: &str = "config.json";
pub const TRANSFORMERS_INDEX: &str = "entrollm.safetensors.index.json";
/// The writer's scratch directory inside the staging directory.
pub(crate) const WORK_DIR: &str = ".entrollm-work";
/// Alignment classes, in the order their data is laid out in a shard: tensors sorted by
/// decreasing element size all start aligned to their element size (the data buffer starts at a
/// multiple of 8), so readers can view U32 arrays in place.
const ALIGN_CLASSES: [usize; 4] = [8, 4, 2, 1];

#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// See [`DEFAULT_SHARD_SIZE_LIMIT`].
    pub shard_size_limit: u64,
    /// Replace a destination that exists and is not empty.
    pub overwrite: bool,
    /// Recorded as the manifest's `tool`.
    pub tool: String,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            shard_size_limit: DEFAULT_SHARD_SIZE_LIMIT,
            overwrite: false,
            tool: concat!("entrollm ", env!("CARGO_PKG_VERSION")).to_string(),
        }
    }
}

/// How to rebuild one source file: `prefix` at offset 0, each segment's tensor (decoded) at its
/// absolute offset, zero bytes in between and up to `size`, which must hash to `xxh3`.
#[derive(Clone, Debug)]
pub struct SourceFile<'a> {
    /// Path relative to the source checkpoint's directory.
    pub name: String,
    pub size: u64,
    pub xxh3: u64,
    pub prefix: &'a [u8],
    pub segments: Vec<SourceSegment>,
}

impl<'a> SourceFile<'a> {
    /// The record of a safetensors file: the 8-byte length and header JSON as prefix, every
    /// tensor at its offset. Hashes the whole file.
    pub fn from_safetensors(name: &str, file: &'a SafetensorsFile) -> Self {
        Self::from_safetensors_hashed(name, file, checksum(file.file_bytes()))
    }

    /// [`from_safetensors`](Self::from_safetensors) with the file's checksum `xxh3` computed by
    /// the caller (e.g. while it codes the tensors).
    pub fn from_safetensors_hashed(name: &str, file: &'a SafetensorsFile, xxh3: u64) -> Self {
        let start = file.data_start() as u64;
        let mut segments: Vec<SourceSegment> = Vec::with_capacity(file.len());
        let mut offset = start;
        for t in file.tensors() {
            segments.push(SourceSegment {
                tensor: t.name.to_string(),
                offset,
            });
            offset += t.bytes.len() as u64;
        }
        SourceFile {
            name: name.to_string(),
            size: file.file_len(),
            xxh3,
            prefix: file.prefix_bytes(),
            segments,
        }
    }
}

/// Writes a container directory. Nothing appears at the destination until [`finish`](Self::finish)
/// succeeds; dropping the writer before that deletes everything it wrote.
pub struct ContainerWriter {
    staging: StagingDir,
    work: PathBuf,
    opts: WriterOptions,
    /// Array refs name shards by their index until `finish` knows the shard count.
    manifest: Manifest,
    tensor_names: HashSet<String>,
    keys: HashSet<String>,
    file_names: HashSet<String>,
    shard: Option<OpenShard>,
    /// (path in the work directory, size, checksum) of each finished shard.
    closed: Vec<(PathBuf, u64, u64)>,
    /// Set when an I/O error left a shard half-written; every later call fails.
    broken: bool,
    /// The source's `config.json` object, to which `finish` adds what makes transformers load
    /// the container ([`set_transformers_config`](Self::set_transformers_config)).
    transformers: Option<serde_json::Map<String, Value>>,
}

impl std::fmt::Debug for ContainerWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerWriter")
            .field("staging", &self.staging.path())
            .field("tensors", &self.manifest.tensors.len())
            .field("closed_shards", &self.closed.len())
            .finish()
    }
}

struct OpenShard {
    index: usize,
    /// One scratch file per alignment class, created on first use.
    classes: [Option<(PathBuf, BufWriter<File>)>; 4],
    class_len: [u64; 4],
    arrays: Vec<PendingArray>,
    data_len: u64,
}

struct PendingArray {
    key: String,
    dtype: Dtype,
    shape: Vec<usize>,
    class: usize,
    offset: u64,
    len: u64,
}

/// One array to store: key, dtype, shape, bytes.
type ArrayData<'d> = (String, Dtype, Vec<usize>, &'d [u8]);

impl ContainerWriter {
    /// Starts a container that [`finish`](Self::finish) will place at `dst`. Fails if `dst` exists
    /// and is not an empty directory, unless `opts.overwrite`.
    pub fn create(dst: &Path, opts: WriterOptions) -> Result<Self> {
        if opts.shard_size_limit == 0 {
            return Err(FormatError::Usage(
                "shard size limit must be positive".into(),
            ));
        }
        let staging = StagingDir::create(dst, opts.overwrite)?;
        let work = staging.path().join(WORK_DIR);
        std::fs::create_dir(&work).map_err(|e| FormatError::io(&work, e))?;
        let manifest = Manifest::new(&opts.tool);
        Ok(ContainerWriter {
            staging,
            work,
            opts,
            manifest,
            tensor_names: HashSet::new(),
            keys: HashSet::new(),
            file_names: HashSet::new(),
            shard: None,
            closed: Vec::new(),
            broken: false,
            transformers: None,
        })
    }

    /// Stores a tensor as it is, under its own name.
    pub fn add_plain(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<()> {
        self.check_usable()?;
        check_tensor_name(name).map_err(FormatError::Usage)?;
        check_tensor_data(name, dtype, shape, bytes.len()).map_err(FormatError::Usage)?;
        self.check_new_tensor(name, std::slice::from_ref(&name.to_string()))?;
        let shard = self.store(vec![(name.to_string(), dtype, shape.to_vec(), bytes)])?;
        self.tensor_names.insert(name.to_string());
        self.manifest.tensors.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            xxh3: checksum(bytes),
            storage: Storage::Plain(ArrayRef {
                shard,
                key: name.to_string(),
            }),
            form: None,
        });
        Ok(())
    }

    /// Stores a coded tensor: the coder's arrays under `<name>.<coder>.<array>`, its `params`
    /// object as given, and `checksum` — the [`checksum`](crate::checksum()) of the tensor's
    /// decoded bytes (`dtype` × `shape`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_coded(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        coder: &str,
        params: Value,
        arrays: Vec<(String, ArrayDtype, &[u8])>,
        checksum: u64,
    ) -> Result<()> {
        self.check_usable()?;
        let usage = |m: String| FormatError::Usage(format!("tensor '{name}': {m}"));
        check_tensor_name(name).map_err(FormatError::Usage)?;
        tensor_byte_len(dtype, shape).map_err(usage)?;
        check_ident("coder", coder).map_err(usage)?;
        if !params.is_object() {
            return Err(usage("coder params must be a JSON object".into()));
        }
        let mut data = Vec::with_capacity(arrays.len());
        for (array, adt, bytes) in &arrays {
            check_ident("array", array).map_err(usage)?;
            if bytes.len() % adt.size() != 0 {
                return Err(usage(format!(
                    "array '{array}' is {} bytes, not a whole number of {adt:?}",
                    bytes.len()
                )));
            }
            data.push((
                array_key(name, coder, array),
                adt.dtype(),
                vec![bytes.len() / adt.size()],
                *bytes,
            ));
        }
        let keys: Vec<String> = data.iter().map(|d| d.0.clone()).collect();
        self.check_new_tensor(name, &keys)?;
        let shard = self.store(data)?;
        self.tensor_names.insert(name.to_string());
        let arrays = arrays
            .iter()
            .zip(keys)
            .map(|((array, _, _), key)| {
                (
                    array.clone(),
                    ArrayRef {
                        shard: shard.clone(),
                        key,
                    },
                )
            })
            .collect();
        self.manifest.tensors.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            xxh3: checksum,
            storage: Storage::Coded(CodedEntry {
                coder: coder.to_string(),
                params,
                arrays,
            }),
            form: None,
        });
        Ok(())
    }

    /// Records the weight form the tensor `name` (already added) is to be served in.
    pub fn set_form(&mut self, name: &str, form: FormEntry) -> Result<()> {
        self.check_usable()?;
        form.check()
            .map_err(|m| FormatError::Usage(format!("tensor '{name}': {m}")))?;
        let t = self
            .manifest
            .tensors
            .iter_mut()
            .rev()
            .find(|t| t.name == name)
            .ok_or_else(|| FormatError::Usage(format!("tensor '{name}' was not added")))?;
        t.form = Some(form);
        Ok(())
    }

    /// Records how to rebuild a source file; its prefix is stored in a shard. The tensors its
    /// segments name may be added before or after; [`finish`](Self::finish) checks that they
    /// exist and fit.
    pub fn add_source_file(&mut self, source: SourceFile<'_>) -> Result<()> {
        self.check_usable()?;
        let usage = |m: String| FormatError::Usage(format!("source file '{}': {m}", source.name));
        check_relative_path(&source.name).map_err(usage)?;
        if self.file_names.contains(&source.name) {
            return Err(usage("given twice".into()));
        }
        if source.prefix.len() as u64 > source.size {
            return Err(usage(format!(
                "prefix of {} bytes is longer than the file ({} bytes)",
                source.prefix.len(),
                source.size
            )));
        }
        let key = prefix_key(&source.name);
        if self.keys.contains(&key) {
            return Err(usage(format!("shard key '{key}' is already used")));
        }
        let shard = self.store(vec![(
            key.clone(),
            Dtype::U8,
            vec![source.prefix.len()],
            source.prefix,
        )])?;
        self.file_names.insert(source.name.clone());
        let mut segments = source.segments;
        segments.sort_by_key(|s| s.offset);
        self.manifest.sources.push(SourceEntry {
            name: source.name,
            size: source.size,
            xxh3: source.xxh3,
            prefix: ArrayRef { shard, key },
            segments,
        });
        Ok(())
    }

    /// Copies a file unchanged into the container as `name` (a relative path); it is also
    /// restored verbatim by [`restore_sources`](crate::restore_sources).
    pub fn copy_file(&mut self, src: &Path, name: &str) -> Result<()> {
        self.check_usable()?;
        check_verbatim_name(name)
            .map_err(|m| FormatError::Usage(format!("{}: {m}", src.display())))?;
        if self.file_names.contains(name) {
            return Err(FormatError::Usage(format!("file '{name}' is given twice")));
        }
        let dst = self.staging.path().join(name);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| FormatError::io(parent, e))?;
        }
        let from = crate::input::open_regular(src).map_err(|e| FormatError::io(src, e))?;
        let to = File::create(&dst).map_err(|e| FormatError::io(&dst, e))?;
        let mut to = BufWriter::new(to);
        let mut sum = StreamingChecksum::new();
        copy_hashed(from, Some(&mut to), &mut sum).map_err(|e| match e {
            CopyError::Read(e) => FormatError::io(src, e),
            CopyError::Write(e) => FormatError::io(&dst, e),
        })?;
        to.flush().map_err(|e| FormatError::io(&dst, e))?;
        self.file_names.insert(name.to_string());
        self.manifest.verbatim.push(FileEntry {
            name: name.to_string(),
            size: sum.len(),
            xxh3: sum.digest(),
        });
        Ok(())
    }

    /// Makes the container a directory transformers' `from_pretrained` opens: `finish` writes
    /// `config` (a model's `config.json`, a JSON object) as the container's `config.json` with
    /// `quantization_config = {"quant_method": "entrollm"}` and `transformers_weights` naming the
    /// shard (or, for several, a generated `entrollm.safetensors.index.json` listing their keys),
    /// both recorded under `generated`. The caller keeps the source's own `config.json`, if it
    /// is to be restored, as a source file stored whole.
    pub fn set_transformers_config(&mut self, config: &[u8]) -> Result<()> {
        let usage = |m: String| FormatError::Usage(format!("config.json: {m}"));
        match serde_json::from_slice(config) {
            Ok(Value::Object(o)) => {
                if o.contains_key("quantization_config") {
                    return Err(usage("already names a quantization_config".into()));
                }
                self.transformers = Some(o);
                Ok(())
            }
            Ok(_) => Err(usage("not a JSON object".into())),
            Err(e) => Err(usage(format!("not JSON: {e}"))),
        }
    }

    /// Writes the files of [`set_transformers_config`](Self::set_transformers_config) into the
    /// staging directory once the shards have their names.
    fn write_transformers_files(&mut self, shard_names: &[String]) -> Result<()> {
        let Some(mut config) = self.transformers.take() else {
            return Ok(());
        };
        for name in [TRANSFORMERS_CONFIG, TRANSFORMERS_INDEX] {
            if self.manifest.verbatim.iter().any(|f| f.name == name) {
                return Err(FormatError::Usage(format!(
                    "verbatim file '{name}' collides with the one generated for transformers"
                )));
            }
        }
        let mut files = Vec::new();
        let weights = match shard_names {
            [one] => one.clone(),
            _ => {
                // transformers reads every key of every file it is given; the map lists them all.
                let m = &self.manifest;
                let mut map = serde_json::Map::new();
                let mut add = |r: &ArrayRef| {
                    map.insert(r.key.clone(), Value::String(r.shard.clone()));
                };
                for t in &m.tensors {
                    match &t.storage {
                        Storage::Plain(r) => add(r),
                        Storage::Coded(c) => c.arrays.values().for_each(&mut add),
                    }
                }
                m.sources.iter().for_each(|s| add(&s.prefix));
                let index = serde_json::json!({"metadata": {}, "weight_map": map});
                let text = serde_json::to_string_pretty(&index).expect("JSON serialises");
                files.push((TRANSFORMERS_INDEX.to_string(), text));
                TRANSFORMERS_INDEX.to_string()
            }
        };
        config.insert(
            "quantization_config".into(),
            serde_json::json!({"quant_method": "entrollm"}),
        );
        config.insert("transformers_weights".into(), Value::String(weights));
        let text = serde_json::to_string_pretty(&Value::Object(config)).expect("JSON serialises");
        files.push((TRANSFORMERS_CONFIG.to_string(), text + "\n"));
        for (name, text) in files {
            let path = self.staging.path().join(&name);
            std::fs::write(&path, &text).map_err(|e| FormatError::io(&path, e))?;
            self.manifest.generated.push(FileEntry {
                name,
                size: text.len() as u64,
                xxh3: checksum(text.as_bytes()),
            });
        }
        Ok(())
    }

    /// Sets a free-form entry of the manifest's `metadata` object.
    pub fn set_metadata(&mut self, key: &str, value: Value) {
        self.manifest.metadata.insert(key.to_string(), value);
    }

    /// Writes the last shard and the manifest, checks the result with [`ContainerReader::open`],
    /// and moves the container to its destination. Returns the manifest written.
    pub fn finish(mut self) -> Result<Manifest> {
        self.check_usable()?;
        self.close_shard()?;
        let count = self.closed.len();
        let names: Vec<String> = (0..count).map(|i| shard_name(i, count)).collect();
        for ((tmp, size, xxh3), name) in self.closed.iter().zip(&names) {
            if self.file_names.contains(name) {
                return Err(FormatError::Usage(format!(
                    "verbatim file '{name}' collides with a shard name"
                )));
            }
            let path = self.staging.path().join(name);
            std::fs::rename(tmp, &path).map_err(|e| FormatError::io(&path, e))?;
            self.manifest.shards.push(FileEntry {
                name: name.clone(),
                size: *size,
                xxh3: *xxh3,
            });
        }
        let rename = |r: &mut ArrayRef| {
            r.shard = names[r.shard.parse::<usize>().expect("writer-made index")].clone()
        };
        for t in &mut self.manifest.tensors {
            match &mut t.storage {
                Storage::Plain(r) => rename(r),
                Storage::Coded(c) => c.arrays.values_mut().for_each(rename),
            }
        }
        self.manifest
            .sources
            .iter_mut()
            .for_each(|s| rename(&mut s.prefix));
        self.write_transformers_files(&names)?;
        std::fs::remove_dir_all(&self.work).map_err(|e| FormatError::io(&self.work, e))?;
        let manifest_path = self.staging.path().join(MANIFEST_FILE);
        let json = self.manifest.to_json();
        let limit = super::reader::MAX_MANIFEST_LEN;
        if json.len() as u64 > limit {
            return Err(FormatError::Usage(format!(
                "{}: the container's manifest would be {} bytes, over the {limit} bytes a reader \
                 accepts ({} tensors); nothing was written",
                self.staging.destination().display(),
                json.len(),
                self.manifest.tensors.len()
            )));
        }
        std::fs::write(&manifest_path, json).map_err(|e| FormatError::io(&manifest_path, e))?;
        // The reader's validation is the definition of a well-formed container: run it on what
        // was written (cheap: it maps the shards and parses headers, it does not hash data).
        // Its errors name the destination, not the staging directory about to be removed.
        if let Err(e) = ContainerReader::open(self.staging.path()) {
            return Err(FormatError::Usage(format!(
                "{}: the container written does not read back, nothing was kept: {e}",
                self.staging.destination().display()
            )));
        }
        let manifest = std::mem::replace(&mut self.manifest, Manifest::new(""));
        self.staging.commit()?;
        Ok(manifest)
    }

    fn check_usable(&self) -> Result<()> {
        if self.broken {
            return Err(FormatError::Usage(
                "container writer is unusable after an earlier I/O error".into(),
            ));
        }
        Ok(())
    }

    /// Rejects a tensor name or shard keys that are already taken.
    fn check_new_tensor(&self, name: &str, keys: &[String]) -> Result<()> {
        if self.tensor_names.contains(name) {
            return Err(FormatError::Usage(format!(
                "tensor '{name}' is added twice"
            )));
        }
        let mut mine = HashSet::new();
        for k in keys {
            if self.keys.contains(k) || !mine.insert(k) {
                return Err(FormatError::Usage(format!(
                    "tensor '{name}': shard key '{k}' is already used"
                )));
            }
        }
        Ok(())
    }

    /// Appends arrays to the current shard (all to the same one, rolling over first if they would
    /// overflow it) and returns the shard's provisional name (its index).
    fn store(&mut self, arrays: Vec<ArrayData<'_>>) -> Result<String> {
        let total: u64 = arrays.iter().map(|a| a.3.len() as u64).sum();
        if self
            .shard
            .as_ref()
            .is_some_and(|s| s.data_len > 0 && s.data_len + total > self.opts.shard_size_limit)
        {
            self.close_shard()?;
        }
        let index = self.closed.len();
        let shard = self.shard.get_or_insert_with(|| OpenShard {
            index,
            classes: Default::default(),
            class_len: [0; 4],
            arrays: Vec::new(),
            data_len: 0,
        });
        for (key, dtype, shape, bytes) in arrays {
            let class = ALIGN_CLASSES
                .iter()
                .position(|&a| a == dtype.alignment())
                .expect("alignment is 1, 2, 4 or 8");
            if shard.classes[class].is_none() {
                let path = self.work.join(format!(
                    "shard-{:05}.align{}",
                    shard.index, ALIGN_CLASSES[class]
                ));
                let file = File::create(&path).map_err(|e| FormatError::io(&path, e));
                let file = file.inspect_err(|_| self.broken = true)?;
                shard.classes[class] = Some((path, BufWriter::with_capacity(1 << 20, file)));
            }
            let (path, w) = shard.classes[class].as_mut().expect("created above");
            if let Err(e) = w.write_all(bytes) {
                self.broken = true;
                return Err(FormatError::io(path, e));
            }
            let len = bytes.len() as u64;
            shard.arrays.push(PendingArray {
                key: key.clone(),
                dtype,
                shape,
                class,
                offset: shard.class_len[class],
                len,
            });
            shard.class_len[class] += len;
            shard.data_len += len;
            self.keys.insert(key);
        }
        Ok(index.to_string())
    }

    /// Writes the open shard (header, then its data class by class) and deletes its scratch files.
    fn close_shard(&mut self) -> Result<()> {
        let Some(shard) = self.shard.take() else {
            return Ok(());
        };
        let result = self.write_shard(shard);
        if result.is_err() {
            self.broken = true;
        }
        let (path, size, xxh3) = result?;
        self.closed.push((path, size, xxh3));
        Ok(())
    }

    fn write_shard(&self, shard: OpenShard) -> Result<(PathBuf, u64, u64)> {
        let mut base = [0u64; 4];
        for c in 1..4 {
            base[c] = base[c - 1] + shard.class_len[c - 1];
        }
        let mut order: Vec<&PendingArray> = shard.arrays.iter().collect();
        order.sort_by_key(|a| (a.class, a.offset));
        let entries: Vec<HeaderEntry<'_>> = order
            .iter()
            .map(|a| HeaderEntry {
                name: &a.key,
                dtype: a.dtype,
                shape: &a.shape,
                begin: base[a.class] + a.offset,
                end: base[a.class] + a.offset + a.len,
            })
            .collect();
        let meta = [("format".to_string(), "entrollm".to_string())]
            .into_iter()
            .collect();
        let header = build_header(&entries, Some(&meta));

        let path = self
            .work
            .join(format!("shard-{:05}.safetensors", shard.index));
        let out = File::create(&path).map_err(|e| FormatError::io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, out);
        let mut sum = StreamingChecksum::new();
        out.write_all(&header)
            .map_err(|e| FormatError::io(&path, e))?;
        sum.update(&header);
        for (class_path, w) in shard.classes.into_iter().flatten() {
            let file = w
                .into_inner()
                .map_err(|e| FormatError::io(&class_path, e.into_error()))?;
            drop(file);
            let from = File::open(&class_path).map_err(|e| FormatError::io(&class_path, e))?;
            copy_hashed(from, Some(&mut out), &mut sum).map_err(|e| match e {
                CopyError::Read(e) => FormatError::io(&class_path, e),
                CopyError::Write(e) => FormatError::io(&path, e),
            })?;
            std::fs::remove_file(&class_path).map_err(|e| FormatError::io(&class_path, e))?;
        }
        out.flush().map_err(|e| FormatError::io(&path, e))?;
        Ok((path, sum.len(), sum.digest()))
    }
}
