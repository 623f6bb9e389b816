//! Reading a container: the manifest is validated against the shards once, in `open`; after
//! that every tensor and array is a view into a memory-mapped shard.

use super::manifest::{
    ArrayRef, FileEntry, Manifest, SourceEntry, Storage, TensorEntry, MANIFEST_FILE,
};
use super::{
    check_ident, check_relative_path, check_shard_name, check_tensor_name, check_verbatim_name,
    ArrayDtype,
};
use crate::checksum::{checksum, copy_hashed, CopyError, StreamingChecksum};
use crate::dtype::{tensor_byte_len, Dtype};
use crate::error::{FormatError, Result};
use crate::safetensors::SafetensorsFile;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The largest run of zero bytes a source file may have between its pieces (GGUF alignment
/// padding is at most tens of bytes); a larger one means a corrupt manifest, which could
/// otherwise make a restore write terabytes of zeros.
pub const MAX_SOURCE_GAP: u64 = 1 << 20;
/// Manifests larger than this are refused before reading (a real one is a few MB at most).
/// The most bytes a reader accepts in `entrollm.json`.
pub const MAX_MANIFEST_LEN: u64 = 256 << 20;

/// A tensor as stored in a container.
#[derive(Clone, Debug)]
pub struct StoredTensor<'a> {
    pub name: &'a str,
    /// Dtype of the decoded tensor.
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// [`checksum`](crate::checksum()) of the decoded bytes.
    pub checksum: u64,
    pub data: StoredData<'a>,
}

impl StoredTensor<'_> {
    /// Length of the decoded bytes (`numel·bits/8`; validated when the container was opened).
    pub fn byte_len(&self) -> usize {
        tensor_byte_len(self.dtype, self.shape).unwrap_or(0)
    }
}

#[derive(Clone, Debug)]
pub enum StoredData<'a> {
    /// The tensor's bytes.
    Plain(&'a [u8]),
    Coded(CodedTensor<'a>),
}

#[derive(Clone, Debug)]
pub struct CodedTensor<'a> {
    pub coder: &'a str,
    /// The coder's parameter object, as the writer gave it.
    pub params: &'a Value,
    /// Array name → (element type, bytes).
    pub arrays: BTreeMap<&'a str, (ArrayDtype, &'a [u8])>,
}

/// Where a manifest array ref points: (shard index, position in the shard).
type Slot = (usize, usize);

enum Located {
    Plain(Slot),
    Coded(Vec<(String, ArrayDtype, Slot)>),
}

/// An open, validated container.
pub struct ContainerReader {
    dir: PathBuf,
    manifest_path: PathBuf,
    manifest: Manifest,
    shards: Vec<SafetensorsFile>,
    /// Parallel to `manifest.tensors`.
    located: Vec<Located>,
    /// Parallel to `manifest.sources`.
    prefixes: Vec<Slot>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for ContainerReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerReader")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.located.len())
            .finish()
    }
}

impl ContainerReader {
    /// Opens the container directory `dir`: parses the manifest, maps the shards and checks that
    /// they agree — every ref resolves to a key of the right dtype and shape, every shard key is
    /// referenced exactly once, names are safe relative paths, source layouts fit their sizes.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let len = match std::fs::metadata(&manifest_path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(FormatError::file(
                    dir,
                    format!("not an entrollm container: no {MANIFEST_FILE}"),
                ));
            }
            Err(e) => return Err(FormatError::io(&manifest_path, e)),
        };
        if len > MAX_MANIFEST_LEN {
            return Err(FormatError::file(
                &manifest_path,
                format!("manifest is {len} bytes, more than the {MAX_MANIFEST_LEN}-byte limit"),
            ));
        }
        let text = crate::input::read_limited(&manifest_path, MAX_MANIFEST_LEN)
            .map_err(|e| FormatError::io(&manifest_path, e))?;
        let manifest = Manifest::parse(&manifest_path, &text)?;
        Validator::new(dir, &manifest_path, &manifest)?.run(manifest)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.located.len()
    }
    pub fn is_empty(&self) -> bool {
        self.located.is_empty()
    }
    /// Tensor names in manifest order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.manifest.tensors.iter().map(|t| t.name.as_str())
    }
    /// All tensors in manifest order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = StoredTensor<'_>> + '_ {
        (0..self.located.len()).map(|i| self.stored(i))
    }
    /// The tensor called `name`; an error naming the container and tensor if it has none.
    pub fn tensor(&self, name: &str) -> Result<StoredTensor<'_>> {
        self.by_name
            .get(name)
            .map(|&i| self.stored(i))
            .ok_or_else(|| {
                FormatError::tensor(&self.manifest_path, name, "no such tensor in the container")
            })
    }

    /// The weight form the tensor `name` is to be served in, when the container records one.
    pub fn form(&self, name: &str) -> Option<&super::manifest::FormEntry> {
        let i = *self.by_name.get(name)?;
        self.manifest.tensors[i].form.as_ref()
    }

    /// Checks that `decoded` is the tensor's decoded content: its length and its checksum.
    pub fn verify_checksum(&self, name: &str, decoded: &[u8]) -> Result<()> {
        let i = *self.by_name.get(name).ok_or_else(|| {
            FormatError::tensor(&self.manifest_path, name, "no such tensor in the container")
        })?;
        let entry = &self.manifest.tensors[i];
        let want = tensor_byte_len(entry.dtype, &entry.shape).unwrap_or(0);
        if decoded.len() != want {
            return Err(FormatError::tensor(
                self.tensor_file(i),
                name,
                format!(
                    "decoded data is {} bytes but {} × {:?} is {want}",
                    decoded.len(),
                    entry.dtype,
                    entry.shape
                ),
            ));
        }
        let actual = checksum(decoded);
        if actual != entry.xxh3 {
            return Err(FormatError::Checksum {
                path: self.tensor_file(i).to_path_buf(),
                tensor: Some(name.to_string()),
                expected: entry.xxh3,
                actual,
            });
        }
        Ok(())
    }

    /// The small file `name` (say `config.json`) the container keeps for its source, checked
    /// against the size and checksum the manifest records for it before it is used; at most
    /// `limit` bytes. That is a verbatim copy, or a source file stored whole in a shard (a prefix
    /// and no segments: the source's `config.json` where the container's own is
    /// [generated](Self::read_generated) for transformers).
    pub fn read_verbatim(&self, name: &str, limit: u64) -> Result<Vec<u8>> {
        let path = self.dir.join(name);
        if let Some(i) = self.whole_source(name) {
            let entry = &self.manifest.sources[i];
            if entry.size > limit {
                return Err(FormatError::file(
                    &path,
                    format!("the stored file is {} bytes, over {limit}", entry.size),
                ));
            }
            let bytes = self.source_prefix(i);
            let actual = checksum(bytes);
            if actual != entry.xxh3 {
                // The damage is in the shard that stores the file.
                let (s, _) = self.prefixes[i];
                return Err(FormatError::Checksum {
                    path: self.shards[s].path().to_path_buf(),
                    tensor: Some(format!("{} (the stored {name})", entry.prefix.key)),
                    expected: entry.xxh3,
                    actual,
                });
            }
            return Ok(bytes.to_vec());
        }
        let entry = self
            .manifest
            .verbatim
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| FormatError::file(&path, "the manifest records no such file"))?;
        self.read_listed(entry, limit)
    }

    /// A generated file (`manifest().generated`: transformers' `config.json`), checked.
    pub fn read_generated(&self, name: &str, limit: u64) -> Result<Vec<u8>> {
        let entry = self
            .manifest
            .generated
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| {
                FormatError::file(&self.dir.join(name), "the manifest records no such file")
            })?;
        self.read_listed(entry, limit)
    }

    fn read_listed(&self, entry: &FileEntry, limit: u64) -> Result<Vec<u8>> {
        let path = self.dir.join(&entry.name);
        let bytes =
            crate::input::read_limited(&path, limit).map_err(|e| FormatError::io(&path, e))?;
        if bytes.len() as u64 != entry.size {
            return Err(FormatError::file(
                &path,
                format!(
                    "file is {} bytes, manifest records {}",
                    bytes.len(),
                    entry.size
                ),
            ));
        }
        check_file_sum(&path, entry, checksum(&bytes))?;
        Ok(bytes)
    }

    /// The source file `name` where it is stored whole (its prefix is the file).
    fn whole_source(&self, name: &str) -> Option<usize> {
        self.whole_sources()
            .find(|&i| self.manifest.sources[i].name == name)
    }

    fn whole_sources(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.manifest.sources.len()).filter(|&i| {
            let s = &self.manifest.sources[i];
            s.segments.is_empty() && self.source_prefix(i).len() as u64 == s.size
        })
    }

    /// Whether the container keeps the file `name` for its source ([`read_verbatim`](Self::read_verbatim)).
    pub fn has_verbatim(&self, name: &str) -> bool {
        self.manifest.verbatim.iter().any(|f| f.name == name) || self.whole_source(name).is_some()
    }

    /// The names of the files [`read_verbatim`](Self::read_verbatim) reads.
    pub fn verbatim_names(&self) -> Vec<&str> {
        let m = &self.manifest;
        m.verbatim
            .iter()
            .map(|f| f.name.as_str())
            .chain(self.whole_sources().map(|i| m.sources[i].name.as_str()))
            .collect()
    }

    /// Checks the shard holding source file `i`'s stored prefix (a GGUF's header) against its
    /// checksum: the prefix has none of its own.
    pub fn verify_prefix(&self, i: usize) -> Result<()> {
        let (s, _) = self.prefixes[i];
        let shard = &self.shards[s];
        check_file_sum(
            shard.path(),
            &self.manifest.shards[s],
            checksum(shard.file_bytes()),
        )
        .map_err(|e| match e {
            FormatError::Checksum {
                path,
                expected,
                actual,
                ..
            } => FormatError::Checksum {
                path,
                tensor: Some(format!(
                    "the stored header of {}",
                    self.manifest.sources[i].name
                )),
                expected,
                actual,
            },
            e => e,
        })
    }

    /// Hashes every shard and verbatim file and compares with the manifest. `progress` gets
    /// (bytes done, bytes total).
    pub fn verify_files(&self, mut progress: Option<&mut dyn FnMut(u64, u64)>) -> Result<()> {
        let m = &self.manifest;
        let total: u64 = m
            .shards
            .iter()
            .chain(&m.verbatim)
            .chain(&m.generated)
            .map(|f| f.size)
            .sum();
        let mut done = 0u64;
        for (entry, shard) in m.shards.iter().zip(&self.shards) {
            let actual = checksum(shard.file_bytes());
            check_file_sum(shard.path(), entry, actual)?;
            done += entry.size;
            if let Some(p) = progress.as_mut() {
                p(done, total);
            }
        }
        for entry in m.verbatim.iter().chain(&m.generated) {
            let path = self.dir.join(&entry.name);
            let file = crate::input::open_regular(&path).map_err(|e| FormatError::io(&path, e))?;
            let mut sum = StreamingChecksum::new();
            copy_hashed(file, None, &mut sum).map_err(|e| match e {
                CopyError::Read(e) | CopyError::Write(e) => FormatError::io(&path, e),
            })?;
            if sum.len() != entry.size {
                return Err(FormatError::file(
                    &path,
                    format!(
                        "file is {} bytes, manifest records {}",
                        sum.len(),
                        entry.size
                    ),
                ));
            }
            check_file_sum(&path, entry, sum.digest())?;
            done += entry.size;
            if let Some(p) = progress.as_mut() {
                p(done, total);
            }
        }
        Ok(())
    }

    /// The stored prefix blob of source file `i` (in `manifest().sources` order).
    pub fn source_prefix(&self, i: usize) -> &[u8] {
        let (s, t) = self.prefixes[i];
        self.shards[s].tensor_at(t).bytes
    }

    /// Index of a tensor in manifest order.
    pub(crate) fn tensor_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn stored(&self, i: usize) -> StoredTensor<'_> {
        let e = &self.manifest.tensors[i];
        let data = match (&self.located[i], &e.storage) {
            (Located::Plain((s, t)), _) => StoredData::Plain(self.shards[*s].tensor_at(*t).bytes),
            (Located::Coded(arrays), Storage::Coded(c)) => StoredData::Coded(CodedTensor {
                coder: &c.coder,
                params: &c.params,
                arrays: arrays
                    .iter()
                    .map(|(name, dt, (s, t))| {
                        (name.as_str(), (*dt, self.shards[*s].tensor_at(*t).bytes))
                    })
                    .collect(),
            }),
            (Located::Coded(_), Storage::Plain(_)) => unreachable!("located from the same entry"),
        };
        StoredTensor {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            checksum: e.xxh3,
            data,
        }
    }

    /// The file to blame for tensor `i`'s data: its shard (the first array's for coded ones).
    pub(crate) fn tensor_file(&self, i: usize) -> &Path {
        match &self.located[i] {
            Located::Plain((s, _)) => self.shards[*s].path(),
            Located::Coded(arrays) => arrays
                .first()
                .map_or(&self.manifest_path, |(_, _, (s, _))| self.shards[*s].path()),
        }
    }
}

fn check_file_sum(path: &Path, entry: &FileEntry, actual: u64) -> Result<()> {
    if actual != entry.xxh3 {
        return Err(FormatError::Checksum {
            path: path.to_path_buf(),
            tensor: None,
            expected: entry.xxh3,
            actual,
        });
    }
    Ok(())
}

/// The cross-checks of [`ContainerReader::open`].
struct Validator<'p> {
    dir: PathBuf,
    manifest_path: &'p Path,
    shards: Vec<SafetensorsFile>,
    shard_index: HashMap<String, usize>,
    /// Which shard slots some ref uses, and by which tensor or source.
    used: HashMap<Slot, String>,
}

impl<'p> Validator<'p> {
    fn new(dir: &Path, manifest_path: &'p Path, manifest: &Manifest) -> Result<Self> {
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut shard_index = HashMap::new();
        for entry in &manifest.shards {
            check_shard_name(&entry.name).map_err(|m| FormatError::file(manifest_path, m))?;
            if shard_index
                .insert(entry.name.clone(), shards.len())
                .is_some()
            {
                return Err(FormatError::file(
                    manifest_path,
                    format!("shard '{}' is listed twice", entry.name),
                ));
            }
            let path = dir.join(&entry.name);
            if !path.exists() {
                return Err(FormatError::file(
                    &path,
                    "shard listed in the manifest is missing",
                ));
            }
            let shard = SafetensorsFile::open(&path)?;
            if shard.file_len() != entry.size {
                return Err(FormatError::file(
                    &path,
                    format!(
                        "shard is {} bytes but the manifest records {} (truncated or replaced?)",
                        shard.file_len(),
                        entry.size
                    ),
                ));
            }
            shards.push(shard);
        }
        Ok(Validator {
            dir: dir.to_path_buf(),
            manifest_path,
            shards,
            shard_index,
            used: HashMap::new(),
        })
    }

    /// Resolves `r` for `owner` (a tensor or source file name), checking the key exists, is used
    /// once, and that `check` accepts its dtype and shape.
    fn resolve(
        &mut self,
        owner: &str,
        what: &str,
        r: &ArrayRef,
        check: impl Fn(Dtype, &[usize]) -> std::result::Result<(), String>,
    ) -> Result<Slot> {
        let s = *self.shard_index.get(r.shard.as_str()).ok_or_else(|| {
            FormatError::tensor(
                self.manifest_path,
                owner,
                format!(
                    "{what} refers to shard '{}', which the manifest does not list",
                    r.shard
                ),
            )
        })?;
        let shard = &self.shards[s];
        let t = shard.index_of(&r.key).ok_or_else(|| {
            FormatError::tensor(
                shard.path(),
                owner,
                format!("{what}: key '{}' is missing from the shard", r.key),
            )
        })?;
        let view = shard.tensor_at(t);
        check(view.dtype, view.shape).map_err(|m| {
            FormatError::tensor(
                shard.path(),
                owner,
                format!("{what} (key '{}'): {m}", r.key),
            )
        })?;
        if let Some(other) = self.used.insert((s, t), owner.to_string()) {
            return Err(FormatError::tensor(
                shard.path(),
                owner,
                format!("{what}: key '{}' is also used by '{other}'", r.key),
            ));
        }
        Ok((s, t))
    }

    fn tensor(&mut self, e: &TensorEntry) -> Result<(Located, usize)> {
        let err = |m: String| FormatError::tensor(self.manifest_path, &e.name, m);
        check_tensor_name(&e.name).map_err(err)?;
        let len = tensor_byte_len(e.dtype, &e.shape).map_err(err)?;
        let located = match &e.storage {
            Storage::Plain(r) => {
                Located::Plain(self.resolve(&e.name, "plain data", r, |dt, shape| {
                    if dt != e.dtype || shape != e.shape.as_slice() {
                        return Err(format!(
                            "shard holds {dt} {shape:?} but the manifest says {} {:?}",
                            e.dtype, e.shape
                        ));
                    }
                    Ok(())
                })?)
            }
            Storage::Coded(c) => {
                check_ident("coder", &c.coder).map_err(err)?;
                if !c.params.is_object() {
                    return Err(err("coder params are not a JSON object".into()));
                }
                let mut arrays = Vec::with_capacity(c.arrays.len());
                for (name, r) in &c.arrays {
                    check_ident("array", name).map_err(err)?;
                    let what = format!("array '{name}'");
                    let slot =
                        self.resolve(&e.name, &what, r, |dt, _| {
                            match ArrayDtype::from_dtype(dt) {
                                Some(_) => Ok(()),
                                None => Err(format!("dtype is {dt}; coded arrays are U8 or U32")),
                            }
                        })?;
                    let dt = self.shards[slot.0].tensor_at(slot.1).dtype;
                    arrays.push((
                        name.clone(),
                        ArrayDtype::from_dtype(dt).expect("checked in resolve"),
                        slot,
                    ));
                }
                Located::Coded(arrays)
            }
        };
        Ok((located, len))
    }

    /// Checks a source file's layout: prefix, then segments in offset order without overlap,
    /// zero gaps of at most [`MAX_SOURCE_GAP`], everything within `size`.
    fn source(&mut self, src: &SourceEntry, sizes: &HashMap<&str, usize>) -> Result<Slot> {
        let err = |m: String| {
            FormatError::file(
                self.manifest_path,
                format!("source file '{}': {m}", src.name),
            )
        };
        check_relative_path(&src.name).map_err(err)?;
        let prefix = self.resolve(&src.name, "prefix", &src.prefix, |dt, _| match dt {
            Dtype::U8 => Ok(()),
            _ => Err(format!("dtype is {dt}, not U8")),
        })?;
        let mut pos = self.shards[prefix.0].tensor_at(prefix.1).bytes.len() as u64;
        if pos > src.size {
            return Err(err(format!(
                "prefix of {pos} bytes is longer than the file ({} bytes)",
                src.size
            )));
        }
        for seg in &src.segments {
            let terr = |m: String| {
                FormatError::tensor(
                    self.manifest_path,
                    &seg.tensor,
                    format!("source file '{}': {m}", src.name),
                )
            };
            let len = *sizes
                .get(seg.tensor.as_str())
                .ok_or_else(|| terr("segment names a tensor the container does not hold".into()))?;
            if seg.offset < pos {
                return Err(terr(format!(
                    "segment at offset {} overlaps the data before it (which ends at {pos})",
                    seg.offset
                )));
            }
            if seg.offset - pos > MAX_SOURCE_GAP {
                return Err(terr(format!(
                    "gap of {} zero bytes before offset {} exceeds {MAX_SOURCE_GAP}",
                    seg.offset - pos,
                    seg.offset
                )));
            }
            pos = seg
                .offset
                .checked_add(len as u64)
                .filter(|&end| end <= src.size)
                .ok_or_else(|| {
                    terr(format!(
                        "{len} bytes at offset {} run past the file size {}",
                        seg.offset, src.size
                    ))
                })?;
        }
        if src.size - pos > MAX_SOURCE_GAP {
            return Err(err(format!(
                "{} zero bytes after the last segment exceed {MAX_SOURCE_GAP}",
                src.size - pos
            )));
        }
        Ok(prefix)
    }

    fn run(mut self, manifest: Manifest) -> Result<ContainerReader> {
        let mut located = Vec::with_capacity(manifest.tensors.len());
        let mut by_name = HashMap::with_capacity(manifest.tensors.len());
        let mut sizes = HashMap::with_capacity(manifest.tensors.len());
        for (i, e) in manifest.tensors.iter().enumerate() {
            if by_name.insert(e.name.clone(), i).is_some() {
                return Err(FormatError::tensor(
                    self.manifest_path,
                    &e.name,
                    "listed twice in the manifest",
                ));
            }
            if let Some(f) = &e.form {
                f.check()
                    .map_err(|m| FormatError::tensor(self.manifest_path, &e.name, m))?;
            }
            let (loc, len) = self.tensor(e)?;
            sizes.insert(e.name.as_str(), len);
            located.push(loc);
        }
        let mut file_names = HashSet::new();
        let mut prefixes = Vec::with_capacity(manifest.sources.len());
        for src in &manifest.sources {
            if !file_names.insert(src.name.as_str()) {
                return Err(FormatError::file(
                    self.manifest_path,
                    format!("source file '{}' is listed twice", src.name),
                ));
            }
            prefixes.push(self.source(src, &sizes)?);
        }
        // Generated files are not restored: they may share a name with a source file (the
        // source's config.json beside transformers'), never with another file in the directory.
        let mut on_disk = HashSet::new();
        for (f, generated) in manifest
            .verbatim
            .iter()
            .map(|f| (f, false))
            .chain(manifest.generated.iter().map(|f| (f, true)))
        {
            check_verbatim_name(&f.name).map_err(|m| {
                FormatError::file(self.manifest_path, format!("verbatim file: {m}"))
            })?;
            let unique = match generated {
                true => true,
                false => file_names.insert(f.name.as_str()),
            };
            if !unique || !on_disk.insert(f.name.as_str()) {
                return Err(FormatError::file(
                    self.manifest_path,
                    format!("file '{}' is listed twice", f.name),
                ));
            }
            let path = self.dir.join(&f.name);
            let meta = std::fs::metadata(&path).map_err(|e| FormatError::io(&path, e))?;
            if !meta.is_file() || meta.len() != f.size {
                return Err(FormatError::file(
                    &path,
                    format!(
                        "verbatim file is {} bytes but the manifest records {}",
                        meta.len(),
                        f.size
                    ),
                ));
            }
        }
        // Every key of every shard must belong to something: an unreferenced key means the
        // manifest lost an entry.
        for (s, shard) in self.shards.iter().enumerate() {
            if let Some(t) = (0..shard.len()).find(|&t| !self.used.contains_key(&(s, t))) {
                let key = shard.tensor_at(t).name;
                return Err(FormatError::tensor(
                    shard.path(),
                    key,
                    "shard key is not referenced by the manifest",
                ));
            }
        }
        Ok(ContainerReader {
            dir: self.dir,
            manifest_path: self.manifest_path.to_path_buf(),
            manifest,
            shards: self.shards,
            located,
            prefixes,
            by_name,
        })
    }
}
