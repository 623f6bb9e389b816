//! The coding pipeline behind `entrollm compress`: read a checkpoint (Hugging Face safetensors or
//! GGUF), choose each matrix's coding, code it, check that it decodes to the source bytes, and
//! write the container.
//!
//! Tensors are coded and checked on the rayon pool while the calling thread writes the container
//! in source order, so the container is the same whatever the thread count. At most a window of
//! tensors (twice the pool's threads, and [`CompressOptions::in_flight_bytes`] of source) is
//! coded ahead of the one being written, which bounds the memory held by coded tensors waiting
//! for the writer.

use crate::coding_plan::CodingPlan;
use crate::error::ModelError;
use crate::forms::{Form, Stored};
use crate::gguf::{GgmlType, GgufFile, GgufTensorInfo};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{choose_coding_and_width, Coding, DtansTensor};
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_codec::lossy::gptq::Feedback;
use entrollm_codec::lossy::scalar::Scalar;
use entrollm_codec::lossy::{LossyTensor, Quantizer};
use entrollm_codec::{CodecError, Payload};
use entrollm_format::checksum::StreamingChecksum;
use entrollm_format::coded::{
    payload_of, BlocksCoded, Coded, FieldsCoded, FloatsCoded, GgmlCoded, GgmlScales, LossyCoded,
    ScalarCoded, RANS_MARGIN_BITS,
};
use entrollm_format::ggml_blocks::{unpack_codes, QK};
use entrollm_format::qtype::Store;
use entrollm_format::{
    checksum, Checkpoint, ContainerWriter, Dtype, FormEntry, FormatError, SafetensorsFile,
    SourceFile, SourceSegment, TensorView, WriterOptions,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// Which coder codes the matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coder {
    /// dtANS-LLM: every float dtype, and GGUF block codes.
    Dtans,
    /// The DFloat11 layout: BF16 only.
    Df11,
}

impl Coder {
    /// The pipeline that codes with the container's coder a form stores with
    /// ([`Stored::Coded`](crate::forms::Stored::Coded)).
    fn of_stored(coder: &str) -> Result<Coder> {
        Coder::parse(coder).map_err(CompressError::Usage)
    }

    pub fn parse(s: &str) -> Result<Coder, String> {
        match s {
            "auto" | "dtans" => Ok(Coder::Dtans),
            "df11" => Ok(Coder::Df11),
            c => Err(format!("unknown coder '{c}': use auto, dtans or df11")),
        }
    }
}

/// How to compress a checkpoint.
#[derive(Clone, Debug)]
pub struct CompressOptions {
    pub coder: Coder,
    /// Every float matrix dtANS-coded (what fused products decode), none as `rans-floats`
    /// ([`floats_instead`]): `--coder dtans`.
    pub dtans_only: bool,
    /// The dtANS coding of each tensor (`None`: the one predicted smallest).
    pub plan: CodingPlan,
    /// Tensors with fewer elements stay uncoded.
    pub min_elements: usize,
    /// Largest container shard, in bytes.
    pub shard_size: u64,
    /// Replace a destination that exists and is not empty.
    pub overwrite: bool,
    /// Source bytes of the tensors coded ahead of the writer at once (one tensor always is).
    pub in_flight_bytes: u64,
    /// The weight form each matrix is served in, by Hugging Face tensor name as a plan names
    /// them (`compress --plan`; a GGUF's tensors are found by their GGUF names): it is stored as
    /// its form says ([`Form::stored`](crate::forms::Form::stored)) — overriding
    /// `coder`, `plan` and `min_elements` — or, where the container has no storage for the
    /// form, as without it; the form is recorded in the manifest either way.
    pub forms: BTreeMap<String, FormEntry>,
    /// Entries added to the manifest's `metadata` (a plan's summary).
    pub metadata: serde_json::Map<String, Value>,
    /// Code the float matrices lossily at a rate (`compress --bits`); see [`lossy_eligible`].
    pub lossy: Option<LossyOptions>,
}

/// How `compress --bits` quantises: lattice/trellis tiles (served by the `lossy` form's tile
/// decoder) or a scalar quantiser whose codes the dtANS forms serve as they are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossyQuantizer {
    Tiles(Quantizer),
    Scalar(Scalar),
}

impl LossyQuantizer {
    /// `--quantizer` (`tcqN`, `e8`, `int`, `fp8`), with `int`'s group and dead zone.
    pub fn parse(s: &str, group: usize, dead_zone: f32) -> std::result::Result<Self, String> {
        let q = match s {
            "int" => LossyQuantizer::Scalar(Scalar::Int { group, dead_zone }),
            "fp8" => LossyQuantizer::Scalar(Scalar::Fp8),
            s => LossyQuantizer::Tiles(s.parse().map_err(|e: String| {
                format!("{e}; or int (integer grid, group scales) or fp8 (FP8 E4M3, row scales)")
            })?),
        };
        if let LossyQuantizer::Scalar(q) = q {
            q.check().map_err(|e| e.to_string())?;
        }
        Ok(q)
    }

    /// Whether rows of `cols` columns can be coded.
    pub fn takes_cols(self, cols: usize) -> bool {
        match self {
            LossyQuantizer::Tiles(q) => cols.is_multiple_of(q.row_multiple()),
            LossyQuantizer::Scalar(q) => cols.is_multiple_of(q.group(cols)),
        }
    }
}

impl std::fmt::Display for LossyQuantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LossyQuantizer::Tiles(q) => q.fmt(f),
            LossyQuantizer::Scalar(q) => q.fmt(f),
        }
    }
}

/// Lossy coding of a checkpoint's matrices.
#[derive(Clone, Debug, PartialEq)]
pub struct LossyOptions {
    /// Stored bits a weight of the lossy matrices, every byte counted: each matrix's, or the
    /// average of those [`plan_lossy`] allocates.
    pub bits: f64,
    pub quantizer: LossyQuantizer,
    /// Weights a tile holds at least (`entrollm_codec::lossy::Options::tile_weights`).
    pub tile_weights: usize,
    /// Per-row RDO candidates (`entrollm_codec::lossy::Options::rdo`; 0: off).
    pub rdo: usize,
    /// What [`plan_lossy`] chose per matrix (by source tensor name); a matrix it does not name is
    /// coded at `bits` with no column weights.
    pub planned: Arc<BTreeMap<String, MatrixPlan>>,
}

impl LossyOptions {
    pub fn new(bits: f64, quantizer: LossyQuantizer) -> LossyOptions {
        LossyOptions {
            bits,
            quantizer,
            tile_weights: entrollm_codec::lossy::TILE_WEIGHTS,
            rdo: 0,
            planned: Arc::default(),
        }
    }

    /// The tile coder's options for matrix `name` (`q`: the tile quantiser).
    fn codec_options(&self, name: &str, q: Quantizer) -> entrollm_codec::lossy::Options {
        let p = self.planned.get(name);
        entrollm_codec::lossy::Options {
            tile_weights: self.tile_weights,
            rdo: self.rdo,
            col_weights: p.and_then(|p| p.col_weights.clone()),
            ..entrollm_codec::lossy::Options::new(p.map_or(self.bits, |p| p.bits), q)
        }
    }
}

/// One lossy matrix's rate and column weights, planned before coding.
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixPlan {
    pub bits: f64,
    /// Its input channels' activation energies (a calibration run), if any.
    pub col_weights: Option<Vec<f32>>,
    /// Integer codes' GPTQ feedback from its launch's input Hessian (a calibration run that kept
    /// Hessians), shared by the launch's matrices.
    pub feedback: Option<Arc<Feedback>>,
    /// Where the rate came from: `"bits-file"`, `"allocated"` or `"uniform"`.
    pub why: &'static str,
}

/// How [`plan_lossy`] chooses rates.
#[derive(Clone, Debug, Default)]
pub struct LossyPlanning {
    /// Allocate the average across matrices by rate and distortion ([`crate::rates`]); off:
    /// every matrix not in the bits file at the average.
    pub allocate: bool,
    pub bits_file: Option<crate::rates::BitsFile>,
    pub calibration: Option<crate::calib::Calibration>,
}

/// Weights of sampled rows a matrix's rate–distortion curve is estimated on.
const CURVE_SAMPLE: usize = 1 << 17;

/// Plans each lossy matrix of `src` ([`lossy_eligible`] under `opts`): its rate (bits file, else
/// the allocation, else `opts.lossy.bits`) and its column weights (the calibration's). Returns
/// the options with the plan in them. `progress` counts the matrices' source bytes.
pub fn plan_lossy(
    src: &Path,
    opts: &CompressOptions,
    planning: &LossyPlanning,
    progress: &mut dyn Progress,
) -> Result<CompressOptions> {
    let Some(l) = &opts.lossy else {
        return Ok(opts.clone());
    };
    // The allocation's matrices: their curves, and (name, column weights) in the same order.
    let mut names = vec![];
    let mut planned = BTreeMap::new();
    let mut curves = vec![];
    let mut priced = vec![];
    let mut feedbacks = BTreeMap::new();
    let mut total_bytes = 0u64;
    for_each_lossy_matrix(src, opts, &mut |m| {
        total_bytes += m.bytes.len() as u64;
        Ok(())
    })?;
    progress.start(total_bytes);
    for_each_lossy_matrix(src, opts, &mut |m| {
        let LossyMatrix {
            name,
            rows,
            cols,
            dtype,
            bytes,
        } = m;
        names.push(name.to_string());
        let feedback = match (&planning.calibration, l.quantizer) {
            (Some(c), LossyQuantizer::Scalar(Scalar::Int { .. })) => {
                match crate::calib::Calibration::launch_of(name)
                    .and_then(|k| Some((k, c.hessian(k)?)))
                {
                    Some((k, h)) if h.len() == cols * cols => match feedbacks.get(&k) {
                        Some(f) => Some(Arc::clone(f)),
                        None => {
                            let f = Arc::new(
                                Feedback::new(h, cols)
                                    .map_err(|e| CompressError::in_tensor(name)(e.into()))?,
                            );
                            feedbacks.insert(k, Arc::clone(&f));
                            Some(f)
                        }
                    },
                    _ => None,
                }
            }
            _ => None,
        };
        let col_weights = match &planning.calibration {
            Some(c) => Some(
                c.for_tensor(name)
                    .filter(|h| h.len() == cols)
                    .ok_or_else(|| {
                        CompressError::Usage(format!(
                            "{name}: the calibration run recorded no input of {cols} channels \
                             for this matrix"
                        ))
                    })?
                    .to_vec(),
            ),
            None => None,
        };
        let fixed = planning.bits_file.as_ref().and_then(|f| f.rate(name));
        if let Some(bits) = fixed {
            planned.insert(
                name.to_string(),
                MatrixPlan {
                    bits,
                    col_weights,
                    feedback,
                    why: "bits-file",
                },
            );
        } else if planning.allocate {
            let w = LossyCoded::weights(bytes, dtype).expect("a float matrix");
            let range = (
                (l.bits - crate::rates::SPREAD.0).max(0.05),
                (l.bits + crate::rates::SPREAD.1).min(16.0),
            );
            let points = match l.quantizer {
                LossyQuantizer::Tiles(q) => {
                    let o = entrollm_codec::lossy::Options {
                        sample_weights: CURVE_SAMPLE,
                        col_weights: col_weights.clone(),
                        ..l.codec_options(name, q)
                    };
                    LossyTensor::rd_curve(&w, rows, cols, &o, range)
                }
                LossyQuantizer::Scalar(q) => entrollm_codec::lossy::scalar::rd_curve(
                    &w,
                    rows,
                    cols,
                    q,
                    col_weights.as_deref(),
                    range,
                ),
            }
            .map_err(|e| CompressError::in_tensor(name)(e.into()))?;
            curves.push(crate::rates::Curve {
                weights: rows * cols,
                points,
            });
            priced.push((name.to_string(), col_weights, feedback));
        } else {
            planned.insert(
                name.to_string(),
                MatrixPlan {
                    bits: l.bits,
                    col_weights,
                    feedback,
                    why: "uniform",
                },
            );
        }
        progress.advance(bytes.len() as u64);
        Ok(())
    })?;
    progress.finish();
    if let Some(f) = &planning.bits_file {
        let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
        let unknown = f.unknown(&names);
        if !unknown.is_empty() {
            return Err(CompressError::Usage(format!(
                "the bits file names {} that this checkpoint does not code lossily (`entrollm \
                 inspect` lists the tensors; the embedding and output projection stay lossless)",
                unknown.join(", ")
            )));
        }
    }
    let rates = crate::rates::allocate(&curves, l.bits);
    for ((name, col_weights, feedback), bits) in priced.into_iter().zip(rates) {
        planned.insert(
            name,
            MatrixPlan {
                bits,
                col_weights,
                feedback,
                why: "allocated",
            },
        );
    }
    let mut out = opts.clone();
    if let Some(l) = &mut out.lossy {
        l.planned = Arc::new(planned);
    }
    Ok(out)
}

/// A matrix `compress --bits` codes lossily, as its source holds it.
struct LossyMatrix<'a> {
    name: &'a str,
    rows: usize,
    cols: usize,
    dtype: Dtype,
    bytes: &'a [u8],
}

/// Calls `f` for each matrix of `src` that `opts` codes lossily, in file order.
fn for_each_lossy_matrix(
    src: &Path,
    opts: &CompressOptions,
    f: &mut dyn FnMut(LossyMatrix<'_>) -> Result<()>,
) -> Result<()> {
    if opts.lossy.is_none() {
        return Ok(());
    }
    if is_gguf(src) {
        let file = GgufFile::open(src)?;
        let names = file.tensors().iter().map(|t| t.name.as_str());
        let forms = gguf_forms(opts, src, &file, names)?;
        for info in file.tensors() {
            let Some(dtype) = info.ggml_type.float_dtype() else {
                continue;
            };
            let shape = [info.n_rows(), info.row_len()];
            if info.dims.len() == 2 && codes_lossily(opts, &forms, &info.name, &shape, dtype) {
                f(LossyMatrix {
                    name: &info.name,
                    rows: shape[0],
                    cols: shape[1],
                    dtype,
                    bytes: file.tensor_data(info),
                })?;
            }
        }
    } else {
        let ckpt = Checkpoint::open(src)?;
        let forms = source_forms(opts, src, ckpt.tensors().map(|t| t.name), |n| {
            Some(n.into())
        })?;
        for t in ckpt.tensors() {
            if codes_lossily(opts, &forms, t.name, t.shape, t.dtype) {
                f(LossyMatrix {
                    name: t.name,
                    rows: t.shape[0],
                    cols: t.shape[1],
                    dtype: t.dtype,
                    bytes: t.bytes,
                })?;
            }
        }
    }
    Ok(())
}

/// Whether `opts` codes tensor `name` (a source name; `forms` by source names) lossily:
/// [`lossy_eligible`], and planned `lossy` where a plan names forms (`compress --budget
/// --allow-lossy`, whose other launches stay lossless).
fn codes_lossily(
    opts: &CompressOptions,
    forms: &Forms,
    name: &str,
    shape: &[usize],
    dtype: Dtype,
) -> bool {
    let Some(l) = &opts.lossy else { return false };
    lossy_eligible(name, shape, dtype, opts.min_elements, l.quantizer)
        && (forms.is_empty()
            || forms
                .get(name)
                .is_some_and(|f| f.form == crate::forms::lossy::LOSSY.name()))
}

/// Whether `compress --bits` codes a tensor lossily: a float matrix (F32, BF16, F16) of at least
/// `min_elements` weights whose rows the quantiser takes, other than the token embedding and the
/// output projection (HF `*embed_tokens.weight`, `lm_head.weight`; GGUF `token_embd.weight`,
/// `output.weight`), which stay lossless as EntroPack leaves them: they are sensitive and, per
/// token, little of the traffic.
pub fn lossy_eligible(
    name: &str,
    shape: &[usize],
    dtype: Dtype,
    min_elements: usize,
    quantizer: LossyQuantizer,
) -> bool {
    let kept = ["embed_tokens.weight", "lm_head.weight", "token_embd.weight"];
    shape.len() == 2
        && LossyCoded::decodes_to(dtype)
        && shape[0] * shape[1] >= min_elements.max(1)
        && quantizer.takes_cols(shape[1])
        && !kept.iter().any(|k| name.ends_with(k))
        && name != "output.weight"
}

/// Codes a `rows × cols` float matrix of `dtype` lossily. Returns the coded form, its statistics
/// (rate, relative L2 error against the source) and the reconstruction's bytes: what the container
/// records the checksum of, and what every reader is served.
pub fn code_lossy(
    name: &str,
    dtype: Dtype,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    opts: &LossyOptions,
) -> Result<(Coded, Value, Vec<u8>)> {
    let w = LossyCoded::weights(bytes, dtype).ok_or_else(|| {
        CompressError::Usage(format!(
            "lossy coding takes F32, BF16 or F16, not {dtype:?}"
        ))
    })?;
    let q = match opts.quantizer {
        LossyQuantizer::Tiles(q) => q,
        LossyQuantizer::Scalar(q) => return code_scalar(name, dtype, rows, cols, &w, q, opts),
    };
    let o = opts.codec_options(name, q);
    let (tensor, report) = LossyTensor::encode(&w, rows, cols, &o)?;
    let coded = LossyCoded { dtype, tensor };
    let out = coded.decode()?;
    let back = LossyCoded::weights(&out, dtype).expect("decodes to its own dtype");
    let mut stats = json!({
        "bits_per_weight": coded.tensor.bits_per_weight(),
        "target_bits": o.bits,
        "rel_l2": rel_l2(&w, &back),
        "step": report.step,
        "passes": report.passes,
    });
    planned_stats(&mut stats, name, opts);
    if opts.rdo > 1 {
        stats["rdo"] = json!(opts.rdo);
    }
    Ok((Coded::new(coded), stats, out))
}

/// ‖a − b‖ / ‖a‖ (0 for a zero `a`).
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (&a, &b) in a.iter().zip(b) {
        e += (a as f64 - b as f64).powi(2);
        s += (a as f64).powi(2);
    }
    if s > 0.0 {
        (e / s).sqrt()
    } else {
        0.0
    }
}

/// Where a planned matrix's rate came from, in its stats.
fn planned_stats(stats: &mut Value, name: &str, opts: &LossyOptions) {
    if let Some(p) = opts.planned.get(name) {
        stats["rate_from"] = json!(p.why);
        stats["calibrated"] = json!(p.col_weights.is_some());
        stats["feedback"] = json!(p.feedback.is_some());
    }
}

/// [`code_lossy`] with a scalar quantiser: its codes dtANS-coded, its scales beside them.
fn code_scalar(
    name: &str,
    dtype: Dtype,
    rows: usize,
    cols: usize,
    w: &[f32],
    q: Scalar,
    opts: &LossyOptions,
) -> Result<(Coded, Value, Vec<u8>)> {
    let p = opts.planned.get(name);
    let bits = p.map_or(opts.bits, |p| p.bits);
    let h = p.and_then(|p| p.col_weights.as_deref());
    let f = p.and_then(|p| p.feedback.as_deref());
    let (tensor, report) =
        entrollm_codec::lossy::scalar::encode_with_feedback(w, rows, cols, q, bits, h, f)?;
    let coded = ScalarCoded { dtype, tensor };
    let out = coded.decode()?;
    let back = LossyCoded::weights(&out, dtype).expect("decodes to its own dtype");
    let mut stats = json!({
        "quantizer": q.to_string(),
        "bits_per_weight": coded.tensor.bits_per_weight(),
        "target_bits": bits,
        "rel_l2": rel_l2(w, &back),
        "code_entropy": report.code_entropy,
        "scale_bits": report.scale_bits,
        "log2_step": report.log2_knob,
        "passes": report.passes,
    });
    planned_stats(&mut stats, name, opts);
    Ok((Coded::new(coded), stats, out))
}

/// The checksum of a source file as a lossy container restores it: the file's bytes, each lossily
/// coded tensor's replaced by its reconstruction (`segments`: offset, tensor name and source bytes,
/// in file order; zeros between and after them up to `size`).
fn restored_checksum<'a>(
    prefix: &[u8],
    size: u64,
    segments: impl Iterator<Item = (u64, &'a str, &'a [u8])>,
    lossy: &BTreeMap<String, Coded>,
) -> Result<u64> {
    let mut h = StreamingChecksum::new();
    h.update(prefix);
    let zeros = |h: &mut StreamingChecksum, to: u64| {
        while h.len() < to {
            let n = (to - h.len()).min(1 << 16) as usize;
            h.update(&vec![0u8; n]);
        }
    };
    for (offset, name, bytes) in segments {
        zeros(&mut h, offset);
        match lossy.get(name) {
            Some(l) => h.update(&l.decode()?),
            None => h.update(bytes),
        }
    }
    zeros(&mut h, size);
    Ok(h.digest())
}

/// Records in the manifest that a container is lossy, or tells the user that `--bits` found no
/// matrix to code.
fn set_lossy(w: &mut ContainerWriter, opts: &CompressOptions, summary: &mut Summary, n: usize) {
    let Some(l) = &opts.lossy else { return };
    summary.lossy_tensors = n;
    match n {
        0 => summary.notes.push(
            "--bits: no matrix could be coded lossily (none is F32, BF16 or F16 with rows the \
             quantiser takes); everything is stored exactly"
                .into(),
        ),
        _ => w.set_metadata("lossy", lossy_metadata(l, n)),
    }
}

/// The manifest's note that a container is lossy.
fn lossy_metadata(opts: &LossyOptions, tensors: usize) -> Value {
    let allocated = opts.planned.values().any(|p| p.why != "uniform");
    let calibrated = opts.planned.values().any(|p| p.col_weights.is_some());
    json!({
        "bits": opts.bits,
        "quantizer": opts.quantizer.to_string(),
        "tensors": tensors,
        "rates": if allocated { "per matrix (see each tensor's params)" } else { "uniform" },
        "calibrated": calibrated,
        "rdo": opts.rdo,
        "note": "lossy matrices decode to their reconstruction; the token embedding, the output \
                 projection and non-matrix tensors are stored exactly",
    })
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions {
            coder: Coder::Dtans,
            dtans_only: false,
            plan: CodingPlan::uniform(None),
            min_elements: 4096,
            shard_size: entrollm_format::container::DEFAULT_SHARD_SIZE_LIMIT,
            overwrite: false,
            in_flight_bytes: 4 << 30,
            forms: BTreeMap::new(),
            metadata: serde_json::Map::new(),
            lossy: None,
        }
    }
}

/// Told how far the pipeline is, on the calling thread.
pub trait Progress {
    /// Before the first tensor: the source bytes of all tensors.
    fn start(&mut self, _total_bytes: u64) {}
    /// A tensor of `bytes` source bytes was written.
    fn advance(&mut self, _bytes: u64) {}
    /// Every tensor was written; the container is being finished.
    fn finish(&mut self) {}
}

/// Reports nothing.
pub struct NoProgress;
impl Progress for NoProgress {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Safetensors,
    Gguf,
}

/// What a compression did.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub source: SourceKind,
    /// Tensors stored coded.
    pub coded_tensors: usize,
    /// Their bytes in the source, and coded.
    pub coded_source_bytes: u64,
    pub coded_bytes: u64,
    /// Their weights.
    pub coded_weights: u64,
    /// Tensors whose serving form the manifest records.
    pub formed_tensors: usize,
    /// Coded tensors coded lossily (`--bits`).
    pub lossy_tensors: usize,
    /// What the user should know about the result (files kept through links out of the source).
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("coded form does not decode to the original bytes (a coder bug; nothing was written)")]
    Mismatch,
    /// Coding one tensor failed.
    #[error("tensor '{name}': {error}")]
    Tensor {
        name: String,
        error: Box<CompressError>,
    },
    /// The source or the options cannot be compressed as asked.
    #[error("{0}")]
    Usage(String),
}

impl CompressError {
    fn in_tensor(name: &str) -> impl FnOnce(CompressError) -> CompressError + '_ {
        move |e| CompressError::Tensor {
            name: name.to_string(),
            error: Box::new(e),
        }
    }
}

pub type Result<T, E = CompressError> = std::result::Result<T, E>;

/// How a matrix's bytes hold its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceForm {
    /// Floats of this payload (BF16, FP16, FP8), row-major.
    Floats(Payload),
    /// GGUF blocks carrying integer codes and per-block scales.
    Blocks(GgmlType),
    /// GGUF k-quant, IQ4 or FP4 blocks, split into codes and side fields.
    Split(GgmlType),
}

/// A `rows × cols` matrix as the source stores it.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    pub form: SourceForm,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// Bits a weight over its bound that a float matrix's dtANS coding may take before the matrix is
/// stored as rANS beside its raw bytes instead ([`FloatsCoded`], served decoded).
pub const FLOATS_SLACK_BITS: f64 = 0.1;

/// Where a float matrix of `payload` whose dtANS coding would take `dtans` bytes is stored as
/// [`FloatsCoded`] instead: past [`FLOATS_SLACK_BITS`] over its bound, where that is smaller.
/// Its predicted bytes, or `None` where dtANS stays.
pub fn floats_instead(payload: Payload, codes: &[u8], dtans: f64) -> Result<Option<f64>> {
    if !FloatsCoded::stores(payload) {
        return Ok(None);
    }
    let n = codes.len() as f64;
    let bound = (entropy_bits(&byte_histogram(codes)) + 8.0) * n / 8.0;
    if dtans <= bound + FLOATS_SLACK_BITS * n / 8.0 {
        return Ok(None);
    }
    let p = FloatsCoded::predict(payload, codes)?;
    Ok((p < dtans).then_some(p))
}

/// Codes one matrix with `coder` (dtANS with `coding`, or the coding predicted smallest when
/// `None`) and checks that the coded form decodes to the matrix's bytes. Returns the coded form
/// and its statistics, as the manifest records them.
/// Float matrices past [`FLOATS_SLACK_BITS`] over their bound may be stored `rans-floats` where
/// `narrow_floats` (and `coding` is `None`).
pub fn code_tensor(
    m: &Matrix<'_>,
    coder: Coder,
    coding: Option<Coding>,
    narrow_floats: bool,
) -> Result<(Coded, Value)> {
    let (rows, cols) = (m.rows, m.cols);
    let (coded, codes, side_bits, stats) = match (m.form, coder) {
        (SourceForm::Floats(payload), Coder::Dtans) => {
            let (codes, raw) = payload.symbolize(m.bytes)?;
            let side_bits = if payload.has_raw() { 8.0 } else { 0.0 };
            let (chosen, predicted) = dtans_coding(payload, rows, cols, &codes, coding)?;
            // Narrow matrices: dtANS (what fused products decode) is kept within
            // FLOATS_SLACK_BITS of the bound; past it, rANS beside the raw bytes where smaller.
            let floats = match coding.is_none() && narrow_floats {
                true => floats_instead(payload, &codes, predicted)?,
                false => None,
            };
            let (coded, stats) = match floats {
                Some(p) => {
                    let f = FloatsCoded::encode(payload, m.bytes)?;
                    let stats = json!({ "predicted_bytes": p.round(), "coding": f.coding() });
                    (Coded::new(f), stats)
                }
                None => {
                    let d = DtansTensor::encode(payload, rows, cols, &codes, &raw, chosen)?;
                    (
                        Coded::new(d),
                        json!({ "predicted_bytes": predicted.round() }),
                    )
                }
            };
            (coded, codes, side_bits, stats)
        }
        (SourceForm::Floats(Payload::Bf16), Coder::Df11) => {
            let (codes, _) = Payload::Bf16.symbolize(m.bytes)?;
            let w: Vec<u16> = m
                .bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            (Coded::new(Df11Tensor::encode(&w)?), codes, 8.0, json!({}))
        }
        (SourceForm::Blocks(block), Coder::Dtans) => {
            let q = unpack_codes(block, m.bytes).map_err(CompressError::Usage)?;
            // The scales at their own (16-bit symbol) entropy: the least either coding of the
            // blocks could store beside the codes.
            let h16 = entrollm_codec::histogram::u16_entropy_bits;
            let side_bits = (h16(&q.d) + q.m.as_deref().map_or(0.0, h16)) / QK as f64;
            let payload = Payload::Int(block.code_bits() as u8);
            let (d, stats) = code_dtans(payload, rows, cols, &q.codes, &[], coding)?;
            let mut coded = Coded::new(GgmlCoded {
                block,
                codes: d,
                d: q.d,
                m: q.m,
            });
            let mut stats = stats;
            // Codes that do not code smaller may still have scales that do.
            if coding.is_none() && coded.stored_bytes() >= m.bytes.len() {
                let s = Coded::new(GgmlScales::encode(block, rows, cols, m.bytes)?);
                if s.stored_bytes() < m.bytes.len() {
                    coded = s;
                }
            }
            // Narrow matrices: rANS codes and scales beside dtANS's per-tile costs. Taken where it
            // saves more than the margin by which dtANS (fused-served) is preferred.
            if coding.is_none() {
                let (b, _) = BlocksCoded::encode(block, rows, cols, m.bytes, None)?;
                let margin = (RANS_MARGIN_BITS * (rows * cols) as f64 / 8.0) as usize;
                if b.stored_bytes() + margin < coded.stored_bytes().min(m.bytes.len()) {
                    stats = blocks_stats(&b, rows * cols);
                    coded = Coded::new(b);
                }
            }
            (coded, q.codes, side_bits, stats)
        }
        (SourceForm::Split(ty), Coder::Dtans) => {
            let (b, split) = BlocksCoded::encode(ty, rows, cols, m.bytes, coding)?;
            let h = entrollm_format::coded::BlocksEntropy::of(&split);
            let stats = blocks_stats(&b, rows * cols);
            (Coded::new(b), split.codes, h.side_bits_per_weight, stats)
        }
        (form, Coder::Df11) => {
            return Err(CompressError::Usage(format!(
                "df11 codes BF16 matrices, not {form:?}; use --coder dtans"
            )))
        }
    };
    let (decoded, breakdown) = coded.decode_with_breakdown()?;
    if decoded != m.bytes {
        return Err(CompressError::Mismatch);
    }
    let mut stats = stats;
    if let Some(b) = breakdown {
        stats["breakdown"] = json!(b);
    }
    let entropy = entropy_bits(&byte_histogram(&codes));
    stats["entropy_bits"] = json!(entropy);
    stats["entropy_bound_bpw"] = json!(entropy + side_bits);
    stats["bits_per_weight"] = json!(coded.stored_bytes() as f64 * 8.0 / (rows * cols) as f64);
    Ok((coded, stats))
}

/// Whether `name` is a quantised checkpoint's side tensor rather than a weight matrix: GPTQ and
/// AWQ `scales`/`qzeros`/`qweight`/`g_idx`, compressed-tensors `weight_scale`/`weight_packed`/…:
/// anything of a module's but its `weight`.
pub fn is_side_tensor(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    last != "weight" && name.contains('.')
}

/// The field width that stores a tensor no matrix form holds smallest ([`FieldsCoded`]), its
/// predicted bytes and the fields' entropy (bits a field); `None` for dtypes it does not read
/// or where no width would store it in less than 97 % of its bytes. Integers are tried at 1, 2,
/// 4 and 8 bits (packed codes code near their entropy at their own width), 16-bit floats as
/// halves.
pub fn fields_choice(dtype: Dtype, bytes: &[u8]) -> Result<Option<(u32, f64, f64)>> {
    let widths: &[u32] = match dtype {
        Dtype::I8 | Dtype::U8 | Dtype::I16 | Dtype::U16 | Dtype::I32 | Dtype::U32 => &[1, 2, 4, 8],
        Dtype::I64 | Dtype::U64 | Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 => &[1, 2, 4, 8],
        Dtype::F16 | Dtype::BF16 => &[16],
        _ => return Ok(None),
    };
    let mut best: Option<(u32, f64, f64)> = None;
    for &w in widths {
        let (p, h) = FieldsCoded::predict(bytes, w)?;
        if best.is_none_or(|(_, b, _)| p < b) {
            best = Some((w, p, h));
        }
    }
    Ok(best.filter(|&(_, p, _)| p < 0.97 * bytes.len() as f64))
}

/// A tensor no matrix form holds, as its fields at the width [`fields_choice`] picks, checked to
/// decode to its bytes; `None` where that would not store it smaller.
fn code_fields(dtype: Dtype, bytes: &[u8]) -> Result<Option<(Coded, Value)>> {
    let Some((bits, predicted, h)) = fields_choice(dtype, bytes)? else {
        return Ok(None);
    };
    let f = FieldsCoded::encode(bytes, bits)?;
    if f.stored_bytes() >= bytes.len() {
        return Ok(None);
    }
    if f.decode()? != bytes {
        return Err(CompressError::Mismatch);
    }
    let n = (bytes.len() * 8 / bits as usize).max(1) as f64;
    let per_element = dtype.bits() as f64 / f64::from(bits);
    let stats = json!({
        "predicted_bytes": predicted.round(),
        "coding": f.coding(),
        "bits_per_field": f.stored_bytes() as f64 * 8.0 / n,
        "entropy_bits": h,
        "entropy_bound_bpw": h * per_element,
        "bits_per_weight": f.stored_bytes() as f64 * 8.0 * per_element / n,
    });
    Ok(Some((Coded::new(f), stats)))
}

/// What the manifest records of a split tensor's streams (`inspect` shows them).
fn blocks_stats(b: &BlocksCoded, weights: usize) -> Value {
    let streams: Vec<Value> = b
        .streams()
        .into_iter()
        .map(|(name, bytes, coding)| {
            let bpw = bytes as f64 * 8.0 / weights as f64;
            json!({ "name": name, "bits_per_weight": bpw, "coding": coding })
        })
        .collect();
    json!({ "streams": streams })
}

/// dtANS-codes the symbols of a `rows × cols` payload with the given coding or the one predicted
/// smallest.
fn code_dtans(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
    raw: &[u8],
    coding: Option<Coding>,
) -> Result<(DtansTensor, Value)> {
    let (coding, predicted) = dtans_coding(payload, rows, cols, codes, coding)?;
    // (The size breakdown comes from the verifying decode.)
    let d = DtansTensor::encode(payload, rows, cols, codes, raw, coding)?;
    Ok((d, json!({ "predicted_bytes": predicted.round() })))
}

/// The given dtANS coding, or the one predicted smallest, with its predicted bytes.
fn dtans_coding(
    payload: Payload,
    rows: usize,
    cols: usize,
    codes: &[u8],
    coding: Option<Coding>,
) -> Result<(Coding, f64)> {
    Ok(match coding {
        Some(c) => (
            c,
            DtansTensor::predict_bytes(payload, rows, cols, codes, c)?,
        ),
        None => choose_coding_and_width(payload, rows, cols, codes)?,
    })
}

/// The values kind ([`Values::kind`](crate::forms::Values::kind)) a loader sees in a matrix
/// stored as `dtype`: what a form's storage is decided on.
fn values_kind(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bf16",
        Dtype::F16 => "f16",
        Dtype::F8E4M3 => "fp8",
        Dtype::F32 => "f32",
        _ => "other",
    }
}

/// Planned forms by the source's tensor names.
type Forms = BTreeMap<String, FormEntry>;

/// The storage the plan's form gives tensor `name` whose values are `values` (`None`: no form
/// planned, or one the container cannot hold: stored as without a plan).
fn planned_storage(forms: &Forms, name: &str, values: &str) -> Result<Option<Stored>> {
    let Some(f) = forms.get(name) else {
        return Ok(None);
    };
    let in_tensor = |e: ModelError| CompressError::Tensor {
        name: name.to_string(),
        error: Box::new(CompressError::Model(e)),
    };
    crate::forms::by_name(&f.form)
        .and_then(|form| form.stored(&f.variant, values))
        .map_err(in_tensor)
}

/// `opts.forms` by the source's tensor names (`to_source` of the HF name). Every tensor the plan
/// names must be in the source — but a tied LM head, which the plan names beside the embedding
/// it is — so that a plan for another model fails here rather than store nothing.
/// [`source_forms`] of a GGUF file: the plan's HF names as the file's tensors. A GGUF stacks
/// each layer's experts in one tensor, which the container stores in one form.
fn gguf_forms<'a>(
    opts: &CompressOptions,
    src: &Path,
    file: &GgufFile,
    names: impl Iterator<Item = &'a str>,
) -> Result<Forms> {
    let family = crate::gguf::family_of(file).ok();
    if let Some(hf) = opts
        .forms
        .keys()
        .find(|hf| family.is_some_and(|f| f.gguf_expert(hf).is_some()))
    {
        return Err(CompressError::Usage(format!(
            "{}: the plan gives expert matrix {hf} a form of its own, but the GGUF stacks each \
             layer's experts in one tensor, which a container stores whole; compress without \
             --plan/--budget and give --budget to run, chat, serve or bench instead",
            src.display()
        )));
    }
    source_forms(opts, src, names, |hf| family?.gguf_name(hf))
}

fn source_forms<'a>(
    opts: &CompressOptions,
    src: &Path,
    names: impl Iterator<Item = &'a str>,
    to_source: impl Fn(&str) -> Option<String>,
) -> Result<Forms> {
    let names: std::collections::HashSet<&str> = names.collect();
    let mut out = Forms::new();
    let mut missing = Vec::new();
    for (hf, f) in &opts.forms {
        match to_source(hf).filter(|n| names.contains(n.as_str())) {
            Some(n) => {
                out.insert(n, f.clone());
            }
            None => missing.push(hf.as_str()),
        }
    }
    let tied = |n: &&str| {
        *n == "lm_head.weight" && opts.forms.get("model.embed_tokens.weight") == opts.forms.get(*n)
    };
    let missing: Vec<&str> = missing.into_iter().filter(|n| !tied(n)).take(5).collect();
    // A GPTQ/AWQ/compressed-tensors matrix is stored as its packed tensors, which carry no form.
    let packed = |n: &&str| {
        n.strip_suffix(".weight").is_some_and(|p| {
            ["qweight", "weight_packed"]
                .iter()
                .any(|t| names.contains(format!("{p}.{t}").as_str()))
        })
    };
    if let Some(n) = missing.iter().find(|n| packed(n)) {
        return Err(CompressError::Usage(format!(
            "{}: matrix {n} is stored as packed integer codes (GPTQ, AWQ or compressed-tensors), \
             which a container keeps as they are, not in planned forms; compress without \
             --plan/--budget and give --budget or --plan to run, chat, serve or bench instead",
            src.display()
        )));
    }
    // gpt-oss's HF experts: each layer's in two fused tensors, not one per expert.
    let fused = |n: &&str| {
        crate::arch::FAMILIES.iter().any(|f| {
            f.moe.as_ref().is_some_and(|m| m.hf_fused.is_some()) && f.gguf_expert(n).is_some()
        })
    };
    if let Some(n) = missing.iter().find(|n| fused(n)) {
        return Err(CompressError::Usage(format!(
            "{}: the plan gives expert matrix {n} a form of its own, but the checkpoint fuses \
             each layer's experts in two tensors, which a container stores whole; compress \
             without --plan/--budget and give --budget to run, chat, serve or bench instead",
            src.display()
        )));
    }
    match missing.is_empty() {
        true => Ok(out),
        false => Err(CompressError::Usage(format!(
            "{}: the plan names tensors this checkpoint does not have ({}); make the plan for \
             this model",
            src.display(),
            missing.join(", ")
        ))),
    }
}

/// Records the planned form of tensor `name`, if any.
fn record_form(w: &mut ContainerWriter, forms: &Forms, name: &str) -> Result<bool> {
    match forms.get(name) {
        Some(f) => {
            w.set_form(name, f.clone())?;
            Ok(true)
        }
        None => Ok(false),
    }
}

fn set_metadata(w: &mut ContainerWriter, opts: &CompressOptions) {
    for (k, v) in &opts.metadata {
        w.set_metadata(k, v.clone());
    }
}

/// Compresses the checkpoint `src` (a safetensors checkpoint directory or file, or a GGUF file)
/// into a container at `dst`.
pub fn compress(
    src: &Path,
    dst: &Path,
    opts: &CompressOptions,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    entrollm_format::check_apart(src, dst)?;
    if opts.lossy.is_some() && opts.coder != Coder::Dtans {
        return Err(CompressError::Usage(
            "--bits codes the matrices lossily and the rest with dtans; it takes no --coder".into(),
        ));
    }
    let lossy_form = crate::forms::lossy::LOSSY.name();
    if opts.lossy.is_some()
        && !opts.forms.is_empty()
        && !opts.forms.values().any(|f| f.form == lossy_form)
    {
        return Err(CompressError::Usage(
            "lossy coding with a plan that codes no matrix lossily: plan with --budget SIZE \
             --allow-lossy, or give --bits without a plan"
                .into(),
        ));
    }
    if is_gguf(src) {
        compress_gguf(src, dst, opts, progress)
    } else {
        compress_safetensors(src, dst, opts, progress)
    }
}

fn writer(dst: &Path, opts: &CompressOptions) -> Result<ContainerWriter> {
    Ok(ContainerWriter::create(
        dst,
        WriterOptions {
            shard_size_limit: opts.shard_size,
            overwrite: opts.overwrite,
            ..WriterOptions::default()
        },
    )?)
}

/// A coded tensor ready for the writer: the coded form, its statistics and the checksum of the
/// source bytes.
type Ready = (Coded, Value, u64);

fn add_coded(
    w: &mut ContainerWriter,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    (coded, stats, sum): &Ready,
) -> Result<()> {
    let arrays = coded.arrays();
    let arrays = arrays
        .iter()
        .map(|(n, d, b)| (n.clone(), *d, &b[..]))
        .collect();
    w.add_coded(
        name,
        dtype,
        shape,
        coded.coder(),
        coded.params(stats.clone()),
        arrays,
        *sum,
    )?;
    Ok(())
}

fn compress_safetensors(
    src: &Path,
    dst: &Path,
    opts: &CompressOptions,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    let ckpt = Checkpoint::open(src)?;
    // A manifest entry takes at least 200 bytes and the name twice (a plain tensor of one
    // dimension as the writer lays it out: 218): a checkpoint whose manifest could not be read
    // back is refused before any work.
    let least: u64 = ckpt.tensors().map(|t| 200 + 2 * t.name.len() as u64).sum();
    let limit = entrollm_format::container::MAX_MANIFEST_LEN;
    if least > limit {
        return Err(CompressError::Usage(format!(
            "{}: {} tensors need a manifest of at least {least} bytes, over the {limit} bytes a \
             container's reader accepts; split the checkpoint",
            src.display(),
            ckpt.tensors().count()
        )));
    }
    let shard_names: Vec<&str> = ckpt.files().map(|(n, _)| n).collect();
    let mut w = writer(dst, opts)?;
    let mut notes = Vec::new();
    let mut config = None;
    if src.is_dir() {
        for (path, name) in verbatim_files(src, &shard_names, &mut notes)? {
            if let Some(bytes) = keep_file(&mut w, &path, &name)? {
                config = Some(bytes);
            }
        }
    }
    if opts.coder == Coder::Df11 && !ckpt.tensors().any(|t| t.dtype == Dtype::BF16) {
        return Err(CompressError::Usage(format!(
            "{}: df11 codes BF16 tensors and this checkpoint has none; use --coder dtans",
            src.display()
        )));
    }
    let tensors: Vec<TensorView<'_>> = ckpt.tensors().collect();
    progress.start(tensors.iter().map(|t| t.bytes.len() as u64).sum());
    let mut summary = Summary {
        source: SourceKind::Safetensors,
        coded_tensors: 0,
        coded_source_bytes: 0,
        coded_bytes: 0,
        coded_weights: 0,
        formed_tensors: 0,
        lossy_tensors: 0,
        notes,
    };
    let forms = source_forms(opts, src, tensors.iter().map(|t| t.name), |n| {
        Some(n.into())
    })?;
    let code = |t: &TensorView<'_>| -> Result<Option<Ready>> {
        if let Some(l) = &opts.lossy {
            if codes_lossily(opts, &forms, t.name, t.shape, t.dtype) {
                let (coded, stats, out) =
                    code_lossy(t.name, t.dtype, t.shape[0], t.shape[1], t.bytes, l)
                        .map_err(CompressError::in_tensor(t.name))?;
                return Ok(Some((coded, stats, checksum(&out))));
            }
        }
        let numel: usize = t.shape.iter().product();
        let (coder, coding, codable) = match planned_storage(&forms, t.name, values_kind(t.dtype))?
        {
            Some(Stored::Raw) => return Ok(None),
            Some(Stored::Coded { coder, coding }) => (Coder::of_stored(coder)?, coding, true),
            None => (
                opts.coder,
                opts.plan.coding_for(t.name),
                numel >= opts.min_elements
                    && (opts.coder == Coder::Dtans || t.dtype == Dtype::BF16),
            ),
        };
        // Matrices are `….weight`; scales and packed codes beside them code as fields.
        let matrix = t.shape.len() >= 2 && !is_side_tensor(t.name);
        let Some(payload) = payload_of(t.dtype).filter(|_| codable && matrix) else {
            if !codable || numel < opts.min_elements {
                return Ok(None);
            }
            let coded = code_fields(t.dtype, t.bytes).map_err(CompressError::in_tensor(t.name))?;
            return Ok(coded.map(|(c, stats)| (c, stats, checksum(t.bytes))));
        };
        let rows = t.shape[0];
        let m = Matrix {
            form: SourceForm::Floats(payload),
            rows,
            cols: numel / rows,
            bytes: t.bytes,
        };
        let (coded, stats) = code_tensor(&m, coder, coding, !opts.dtans_only)
            .map_err(CompressError::in_tensor(t.name))?;
        Ok(Some((coded, stats, checksum(t.bytes))))
    };
    let limits = Window::of_pool(opts.in_flight_bytes);
    let weight = |t: &TensorView<'_>| t.bytes.len() as u64;
    let files: Vec<(&str, &SafetensorsFile)> = ckpt.files().collect();
    let mut lossy: BTreeMap<String, Coded> = BTreeMap::new();
    let sums = std::thread::scope(|threads| -> Result<Vec<u64>> {
        // Hashing the whole source once more is a single-threaded pass: it runs beside the
        // coding rather than before it, and the source files are recorded after the tensors.
        let hashing = threads.spawn(|| {
            files
                .iter()
                .map(|(_, f)| checksum(f.file_bytes()))
                .collect::<Vec<u64>>()
        });
        in_order(&tensors, weight, limits, code, |t, ready| {
            match ready {
                Some(ready) => {
                    summary.coded_tensors += 1;
                    summary.coded_source_bytes += t.bytes.len() as u64;
                    summary.coded_bytes += ready.0.stored_bytes() as u64;
                    summary.coded_weights += t.shape.iter().product::<usize>() as u64;
                    add_coded(&mut w, t.name, t.dtype, t.shape, &ready)?;
                    // Kept for the restored file's checksum.
                    if ready.0.reconstructs() {
                        lossy.insert(t.name.to_string(), ready.0);
                    }
                }
                None => w.add_plain(t.name, t.dtype, t.shape, t.bytes)?,
            }
            summary.formed_tensors += record_form(&mut w, &forms, t.name)? as usize;
            progress.advance(t.bytes.len() as u64);
            Ok(())
        })?;
        Ok(hashing
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })?;
    for ((name, file), sum) in files.iter().zip(sums) {
        // A file holding lossy matrices is restored with their reconstructions.
        let sum = match file.tensors().any(|t| lossy.contains_key(t.name)) {
            true => {
                let mut at = file.data_start() as u64;
                let segments = file.tensors().map(|t| {
                    let o = at;
                    at += t.bytes.len() as u64;
                    (o, t.name, t.bytes)
                });
                restored_checksum(file.prefix_bytes(), file.file_len(), segments, &lossy)?
            }
            false => sum,
        };
        w.add_source_file(SourceFile::from_safetensors_hashed(name, file, sum))?;
    }
    if let Some(bytes) = config {
        // After the weight files: a source file of no segments, the whole file its prefix.
        w.add_source_file(SourceFile {
            name: entrollm_format::container::TRANSFORMERS_CONFIG.to_string(),
            size: bytes.len() as u64,
            xxh3: checksum(&bytes),
            prefix: &bytes,
            segments: Vec::new(),
        })?;
    }
    progress.finish();
    set_metadata(&mut w, opts);
    set_lossy(&mut w, opts, &mut summary, lossy.len());
    w.finish()?;
    Ok(summary)
}

/// Keeps a small file of the source directory: copied verbatim, except a model's `config.json`
/// (a JSON object naming no `quantization_config`), whose bytes are returned: the caller stores
/// them whole in a shard (they are restored from there) while the container's own `config.json`
/// is the one the writer generates for transformers (docs/format.md, *Files for transformers*).
fn keep_file(w: &mut ContainerWriter, path: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    if name == entrollm_format::container::TRANSFORMERS_CONFIG {
        let bytes = std::fs::read(path).map_err(|error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let model = matches!(serde_json::from_slice::<Value>(&bytes),
            Ok(Value::Object(o)) if !o.contains_key("quantization_config"));
        if model {
            w.set_transformers_config(&bytes)?;
            return Ok(Some(bytes));
        }
    }
    w.copy_file(path, name)?;
    Ok(None)
}

/// Every file of the source directory that is not a checkpoint shard, copied verbatim: files in
/// subdirectories and hidden ones too, symlinks by their content (a note when a link leaves the
/// directory). A file that cannot be kept exactly (a name that is not UTF-8, something that is not
/// a regular file, a broken link) is an error naming it, never left out.
fn verbatim_files(
    root: &Path,
    shards: &[&str],
    notes: &mut Vec<String>,
) -> Result<Vec<(PathBuf, String)>> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error| ModelError::Io { path, error }
    };
    let croot = root.canonicalize().map_err(io(root))?;
    let mut out = Vec::new();
    // (directory, its name relative to the root); canonical directories seen, against link cycles.
    let mut todo = vec![(root.to_path_buf(), String::new())];
    let mut seen = std::collections::HashSet::from([croot.clone()]);
    while let Some((dir, rel)) = todo.pop() {
        for e in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let path = e.map_err(io(&dir))?.path();
            let cannot = |why: String| {
                CompressError::Usage(format!(
                    "{}: cannot keep this file in the container: {why}",
                    path.display()
                ))
            };
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                return Err(cannot("its name is not UTF-8 (rename it)".into()));
            };
            let name = match rel.is_empty() {
                true => name.to_string(),
                false => format!("{rel}/{name}"),
            };
            if rel.is_empty() && shards.contains(&name.as_str()) {
                continue;
            }
            let link = std::fs::symlink_metadata(&path)
                .map_err(io(&path))?
                .file_type()
                .is_symlink();
            let meta = std::fs::metadata(&path)
                .map_err(|e| cannot(format!("it is a link that cannot be followed ({e})")))?;
            if link {
                let target = path.canonicalize().map_err(io(&path))?;
                if !target.starts_with(&croot) {
                    notes.push(format!(
                        "{} links outside the checkpoint directory (to {}): its content is kept",
                        path.display(),
                        target.display()
                    ));
                }
            }
            if meta.is_dir() {
                let canon = path.canonicalize().map_err(io(&path))?;
                if seen.insert(canon) {
                    todo.push((path.clone(), name));
                }
            } else if meta.is_file() {
                out.push((path, name));
            } else {
                return Err(cannot("it is not a regular file".into()));
            }
        }
    }
    out.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(out)
}

/// Whether `path` is a file that starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && entrollm_format::input::open_regular(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// How one GGUF tensor goes into the container.
enum Storage {
    /// Integer codes of a block type, dtANS-coded, scales beside.
    Codes(GgmlType),
    /// Codes and side fields of a k-quant, IQ4 or FP4 type, each coded where that pays.
    Split(GgmlType),
    /// An F16/BF16 matrix coded as floats.
    Floats(Dtype),
    /// Stored as it is, as this dtype and shape.
    Plain(Dtype, Vec<usize>),
}

fn storage(info: &GgufTensorInfo, min_elements: usize) -> Storage {
    let numel = info.n_elements() as usize;
    let matrix = info.dims.len() >= 2 && numel >= min_elements;
    let ty = info.ggml_type;
    match ty.row().store {
        Store::Codes if matrix => Storage::Codes(ty),
        Store::Split if matrix && info.row_len().is_multiple_of(ty.block_size()) => {
            Storage::Split(ty)
        }
        Store::Float(d @ (Dtype::F16 | Dtype::BF16)) if matrix => Storage::Floats(d),
        Store::Float(d) => Storage::Plain(d, info.hf_shape()),
        _ => Storage::Plain(Dtype::U8, vec![info.n_bytes as usize]),
    }
}

/// The values kind a loader sees in a GGUF tensor stored as `storage` (as `--budget` loads it:
/// legacy blocks as their integer codes, other quantised types dequantised to f32).
fn gguf_values_kind(info: &GgufTensorInfo, storage: &Storage) -> &'static str {
    match storage {
        Storage::Codes(_) => "int",
        Storage::Split(_) => "ggml",
        Storage::Floats(dtype) => values_kind(*dtype),
        Storage::Plain(..) => match info.ggml_type {
            GgmlType::F16 => "f16",
            GgmlType::BF16 => "bf16",
            _ => "f32",
        },
    }
}

/// The longest run of zero bytes between the data section's tensors or after the last one, and
/// where it starts (a container restores at most [`entrollm_format::MAX_SOURCE_GAP`] of them).
fn longest_zero_gap(file: &GgufFile) -> (usize, usize) {
    let mut ranges: Vec<std::ops::Range<usize>> =
        file.tensors().iter().map(|t| t.file_range()).collect();
    ranges.sort_by_key(|r| r.start);
    let len = file.bytes().len();
    let mut at = file.data_offset() as usize;
    let mut longest = (0, at);
    for r in ranges.iter().chain(std::iter::once(&(len..len))) {
        if r.start > at && r.start - at > longest.0 {
            longest = (r.start - at, at);
        }
        at = at.max(r.end);
    }
    longest
}

/// The first non-zero byte of the data section outside every tensor, if any: restoration writes
/// zeros there.
fn nonzero_padding(file: &GgufFile) -> Option<usize> {
    let bytes = file.bytes();
    let mut ranges: Vec<std::ops::Range<usize>> =
        file.tensors().iter().map(|t| t.file_range()).collect();
    ranges.sort_by_key(|r| r.start);
    let mut at = file.data_offset() as usize;
    for r in ranges
        .iter()
        .chain(std::iter::once(&(bytes.len()..bytes.len())))
    {
        if let Some(i) = bytes[at..r.start.max(at)].iter().position(|&b| b != 0) {
            return Some(at + i);
        }
        at = at.max(r.end);
    }
    None
}

/// A GGUF tensor for the writer: coded (when coding shrinks it) as this dtype and shape, or stored
/// plain as the other dtype and shape.
enum GgufReady {
    Coded(Box<Ready>, Dtype, Vec<usize>),
    Plain(Dtype, Vec<usize>),
}

fn compress_gguf(
    src: &Path,
    dst: &Path,
    opts: &CompressOptions,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    if opts.coder != Coder::Dtans {
        return Err(CompressError::Usage(format!(
            "{}: GGUF files are coded with dtans (df11 codes BF16 safetensors checkpoints)",
            src.display()
        )));
    }
    let file = GgufFile::open(src)?;
    if let Some(at) = nonzero_padding(&file) {
        return Err(CompressError::Usage(format!(
            "{}: byte {at} lies outside every tensor and is not zero; such a file cannot be \
             restored bit for bit",
            src.display()
        )));
    }
    let (gap, at) = longest_zero_gap(&file);
    if gap as u64 > entrollm_format::MAX_SOURCE_GAP {
        let tail = at + gap == file.bytes().len();
        return Err(CompressError::Usage(format!(
            "{}: {gap} zero bytes from byte {at} lie outside every tensor; a container restores \
             runs of at most {} (a guard against corrupt manifests){}",
            src.display(),
            entrollm_format::MAX_SOURCE_GAP,
            match tail {
                true => format!(": cut the zero tail off first (`truncate -s {at} FILE`)"),
                false => String::new(),
            }
        )));
    }
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| CompressError::Usage(format!("{}: not a file name", src.display())))?;
    let bytes = file.bytes();
    let data_offset = file.data_offset();
    let mut w = writer(dst, opts)?;
    let source = |xxh3: u64| SourceFile {
        name: name.clone(),
        size: bytes.len() as u64,
        xxh3,
        prefix: &bytes[..data_offset as usize],
        segments: file
            .tensors()
            .iter()
            .map(|t| SourceSegment {
                tensor: t.name.clone(),
                offset: data_offset + t.offset,
            })
            .collect(),
    };
    // A lossy container's file is recorded once its reconstruction's checksum is known.
    if opts.lossy.is_none() {
        w.add_source_file(source(checksum(bytes)))?;
    }
    let mut lossy: BTreeMap<String, Coded> = BTreeMap::new();
    progress.start(file.tensors().iter().map(|t| t.n_bytes).sum());
    let mut summary = Summary {
        source: SourceKind::Gguf,
        coded_tensors: 0,
        coded_source_bytes: 0,
        coded_bytes: 0,
        coded_weights: 0,
        formed_tensors: 0,
        lossy_tensors: 0,
        notes: Vec::new(),
    };
    let names = file.tensors().iter().map(|t| t.name.as_str());
    let forms = gguf_forms(opts, src, &file, names)?;
    let code = |info: &GgufTensorInfo| -> Result<GgufReady> {
        let data = file.tensor_data(info);
        let (rows, cols) = (info.n_rows(), info.row_len());
        let float = info.ggml_type.float_dtype();
        if let (Some(l), Some(dtype), 2) = (&opts.lossy, float, info.dims.len()) {
            let shape = vec![rows, cols];
            if codes_lossily(opts, &forms, &info.name, &shape, dtype) {
                let (coded, stats, out) = code_lossy(&info.name, dtype, rows, cols, data, l)
                    .map_err(CompressError::in_tensor(&info.name))?;
                return Ok(GgufReady::Coded(
                    Box::new((coded, stats, checksum(&out))),
                    dtype,
                    shape,
                ));
            }
        }
        // A planned matrix is stored as its form says, whatever its size.
        let min_elements = match forms.contains_key(&info.name) {
            true => 0,
            false => opts.min_elements,
        };
        let storage = storage(info, min_elements);
        let planned = planned_storage(&forms, &info.name, gguf_values_kind(info, &storage))?;
        // What to store when there is nothing to code, or coding would not shrink the tensor
        // (near-uniform codes), and the form to code.
        let (plain_dtype, plain_shape, form, coded_dtype, coded_shape, source_bpw) = match storage {
            Storage::Plain(dtype, shape) => match planned {
                None | Some(Stored::Raw) => return Ok(GgufReady::Plain(dtype, shape)),
                Some(Stored::Coded { coder, .. }) => {
                    return Err(CompressError::Tensor {
                        name: info.name.clone(),
                        error: Box::new(CompressError::Usage(format!(
                            "the plan's form ({}) codes it with {coder:?}, which cannot code \
                                 a GGUF {} tensor",
                            forms[&info.name].form,
                            info.ggml_type.name()
                        ))),
                    })
                }
            },
            Storage::Codes(block) => (
                Dtype::U8,
                vec![data.len()],
                SourceForm::Blocks(block),
                Dtype::U8,
                GgmlCoded::stored_shape(block, rows, cols),
                block.bits_per_weight(),
            ),
            Storage::Split(ty) => (
                Dtype::U8,
                vec![data.len()],
                SourceForm::Split(ty),
                Dtype::U8,
                BlocksCoded::stored_shape(ty, rows, cols),
                ty.bits_per_weight(),
            ),
            Storage::Floats(dtype) => (
                dtype,
                info.hf_shape(),
                SourceForm::Floats(payload_of(dtype).expect("F16 and BF16 are codable")),
                dtype,
                vec![rows, cols],
                16.0,
            ),
        };
        let m = Matrix {
            form,
            rows,
            cols,
            bytes: data,
        };
        let (coder, coding, planned) = match planned {
            Some(Stored::Raw) => return Ok(GgufReady::Plain(plain_dtype, plain_shape)),
            Some(Stored::Coded { coder, coding }) => (Coder::of_stored(coder)?, coding, true),
            None => (Coder::Dtans, opts.plan.coding_for(&info.name), false),
        };
        let (coded, mut stats) = code_tensor(&m, coder, coding, !planned && !opts.dtans_only)
            .map_err(CompressError::in_tensor(&info.name))?;
        // A planned coding is stored even where it does not shrink the tensor: the plan chose it.
        if !planned && coded.stored_bytes() >= data.len() {
            return Ok(GgufReady::Plain(plain_dtype, plain_shape));
        }
        stats["source_bpw"] = json!(source_bpw);
        Ok(GgufReady::Coded(
            Box::new((coded, stats, checksum(data))),
            coded_dtype,
            coded_shape,
        ))
    };
    let limits = Window::of_pool(opts.in_flight_bytes);
    let weight = |info: &GgufTensorInfo| info.n_bytes;
    in_order(file.tensors(), weight, limits, code, |info, ready| {
        let data = file.tensor_data(info);
        match ready {
            GgufReady::Coded(ready, dtype, shape) => {
                summary.coded_tensors += 1;
                summary.coded_source_bytes += data.len() as u64;
                summary.coded_bytes += ready.0.stored_bytes() as u64;
                summary.coded_weights += info.n_elements();
                add_coded(&mut w, &info.name, dtype, &shape, &ready)?;
                // Kept for the restored file's checksum.
                if ready.0.reconstructs() {
                    lossy.insert(info.name.clone(), ready.0);
                }
            }
            GgufReady::Plain(dtype, shape) => w.add_plain(&info.name, dtype, &shape, data)?,
        }
        summary.formed_tensors += record_form(&mut w, &forms, &info.name)? as usize;
        progress.advance(info.n_bytes);
        Ok(())
    })?;
    if opts.lossy.is_some() {
        let mut order: Vec<&GgufTensorInfo> = file.tensors().iter().collect();
        order.sort_by_key(|t| t.offset);
        let segments = order
            .iter()
            .map(|t| (data_offset + t.offset, t.name.as_str(), file.tensor_data(t)));
        let sum = restored_checksum(
            &bytes[..data_offset as usize],
            bytes.len() as u64,
            segments,
            &lossy,
        )?;
        w.add_source_file(source(sum))?;
    }
    progress.finish();
    set_metadata(&mut w, opts);
    set_lossy(&mut w, opts, &mut summary, lossy.len());
    w.set_metadata("source_format", json!("gguf"));
    // A Llama-family GGUF's container opens in transformers too (its modules are the engine's
    // weights; the quantizer loads them through the engine).
    let config = crate::gguf::GgufSource::open(src).and_then(|s| crate::TensorSource::config(&s));
    if let Some(json) = config
        .ok()
        .as_ref()
        .and_then(crate::synth::transformers_config_json)
    {
        w.set_transformers_config(json.as_bytes())?;
    }
    w.finish()?;
    Ok(summary)
}

/// How far [`in_order`] may work ahead of its consumer.
#[derive(Clone, Copy, Debug)]
struct Window {
    /// Items started and not yet consumed.
    items: usize,
    /// Their summed weight (one item is always allowed, whatever its weight).
    weight: u64,
}

impl Window {
    /// Two items per thread of the current pool: each thread has one to work on and one queued
    /// while the consumer writes.
    fn of_pool(weight: u64) -> Window {
        Window {
            items: 2 * rayon::current_num_threads(),
            weight,
        }
    }
}

/// What a job sends back: its index and its result, or the payload of its panic.
type Done<R> = (usize, std::thread::Result<Result<R>>);

/// Runs `work` on every item on the current rayon pool and hands each result to `consume` on the
/// calling thread, in item order, keeping at most `window` items started and not consumed. Stops
/// at the first error (of `work`, in item order, or of `consume`) and returns it once the items
/// started have finished; a panic in `work` is resumed on the calling thread.
fn in_order<T: Sync, R: Send>(
    items: &[T],
    weight: impl Fn(&T) -> u64,
    window: Window,
    work: impl Fn(&T) -> Result<R> + Sync,
    mut consume: impl FnMut(&T, R) -> Result<()>,
) -> Result<()> {
    let stop = AtomicBool::new(false);
    let (work, stop) = (&work, &stop);
    rayon::in_place_scope(|scope| {
        let (tx, rx) = mpsc::channel::<Done<R>>();
        let mut ready: BTreeMap<usize, std::thread::Result<Result<R>>> = BTreeMap::new();
        let (mut started, mut in_flight) = (0usize, 0u64);
        let mut run = || -> Result<()> {
            for next in 0..items.len() {
                while started < items.len()
                    && (started == next
                        || (started - next < window.items
                            && in_flight + weight(&items[started]) <= window.weight))
                {
                    let (i, tx) = (started, tx.clone());
                    let item = &items[i];
                    scope.spawn(move |_| {
                        let r = if stop.load(Ordering::Relaxed) {
                            Ok(Err(CompressError::Usage("stopped".into())))
                        } else {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(item)))
                        };
                        // A send fails only once the consumer has stopped at an error and
                        // returned: nothing waits for this result then.
                        let _ = tx.send((i, r));
                    });
                    in_flight += weight(item);
                    started += 1;
                }
                let r = loop {
                    if let Some(r) = ready.remove(&next) {
                        break r;
                    }
                    let (i, r) = receive(&rx);
                    ready.insert(i, r);
                };
                in_flight -= weight(&items[next]);
                match r {
                    Ok(r) => consume(&items[next], r?)?,
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            Ok(())
        };
        let result = run();
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        result
    })
}

/// The next finished job. On a thread of the pool (a caller inside `ThreadPool::install`), waiting
/// runs the pool's queued work instead of blocking, so a pool of one thread cannot deadlock.
fn receive<R>(rx: &mpsc::Receiver<Done<R>>) -> Done<R> {
    if rayon::current_thread_index().is_none() {
        return rx.recv().expect("every started job sends its result");
    }
    loop {
        match rx.try_recv() {
            Ok(d) => return d,
            Err(mpsc::TryRecvError::Disconnected) => unreachable!("the sender is held"),
            Err(mpsc::TryRecvError::Empty) => {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    if let Ok(d) = rx.recv_timeout(std::time::Duration::from_millis(1)) {
                        return d;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A plan giving one of gpt-oss's experts a form of its own, where the HF checkpoint fuses
    /// them, is refused saying so.
    #[test]
    fn a_plan_for_experts_an_hf_checkpoint_fuses_is_refused() {
        let expert = "model.layers.0.mlp.experts.1.gate_proj.weight";
        let opts = CompressOptions {
            forms: [(
                expert.to_string(),
                FormEntry {
                    form: "dense".into(),
                    variant: String::new(),
                },
            )]
            .into(),
            ..CompressOptions::default()
        };
        let names = ["model.layers.0.mlp.experts.gate_up_proj"];
        let err = source_forms(&opts, Path::new("ckpt"), names.into_iter(), |n| {
            Some(n.to_string())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(expert) && err.contains("fuses"), "{err}");
    }

    /// Float matrices keep dtANS (what fused products decode) within FLOATS_SLACK_BITS of their
    /// bound; a narrow one, where dtANS's per-lane and per-slice costs are past it, is stored as
    /// rANS beside its raw bytes, within the slack, and decodes to its bytes.
    #[test]
    fn narrow_float_matrices_code_within_the_slack_of_their_bound() {
        use crate::synth::{fill_tensor_16, SynthDtype, SynthKind, SynthTensor};
        for (rows, cols, narrow) in [(384, 384, true), (576, 576, true), (64, 8192, false)] {
            let t = SynthTensor {
                name: "m".into(),
                shape: vec![rows, cols],
                kind: SynthKind::Matrix { sigma: 0.02 },
            };
            let mut bytes = vec![0u8; rows * cols * 2];
            fill_tensor_16(&t, 3, SynthDtype::Bf16, &mut bytes);
            let m = Matrix {
                form: SourceForm::Floats(Payload::Bf16),
                rows,
                cols,
                bytes: &bytes,
            };
            let (coded, stats) = code_tensor(&m, Coder::Dtans, None, true).unwrap();
            let want = if narrow { "rans-floats" } else { "dtans" };
            assert_eq!(coded.coder(), want, "{rows}x{cols}");
            let (bpw, bound) = (
                stats["bits_per_weight"].as_f64().unwrap(),
                stats["entropy_bound_bpw"].as_f64().unwrap(),
            );
            assert!(
                bpw <= bound + FLOATS_SLACK_BITS,
                "{rows}x{cols}: {bpw} against {bound}"
            );
            assert_eq!(coded.decode().unwrap(), bytes);
        }
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// Results arrive in item order, with never more than the window started and not consumed,
    /// from outside a pool and from inside pools of one and several threads.
    #[test]
    fn in_order_consumes_in_order_within_the_window() {
        let items: Vec<u64> = (0..200).map(|i| (i * 7919) % 13 + 1).collect();
        for window in [
            Window {
                items: 1,
                weight: u64::MAX,
            },
            Window {
                items: 4,
                weight: u64::MAX,
            },
            Window {
                items: 64,
                weight: 20,
            },
        ] {
            let check = || {
                let (started, consumed) = (AtomicUsize::new(0), AtomicUsize::new(0));
                let weight = std::sync::atomic::AtomicU64::new(0);
                let mut seen = Vec::new();
                in_order(
                    &items,
                    |&w| w,
                    window,
                    |&w| {
                        let s = started.fetch_add(1, Ordering::SeqCst) + 1;
                        let ahead = s - consumed.load(Ordering::SeqCst);
                        assert!(ahead <= window.items, "{ahead} items in flight");
                        let held = weight.fetch_add(w, Ordering::SeqCst) + w;
                        assert!(
                            held <= window.weight || held == w,
                            "weight {held} in flight"
                        );
                        // Uneven work, so that later items often finish first.
                        std::thread::sleep(std::time::Duration::from_micros(w * 50));
                        Ok(w * 2)
                    },
                    |&w, r| {
                        assert_eq!(r, w * 2);
                        seen.push(w);
                        weight.fetch_sub(w, Ordering::SeqCst);
                        consumed.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    },
                )
                .unwrap();
                assert_eq!(seen, items);
            };
            check();
            pool(1).install(check);
            pool(3).install(check);
        }
    }

    /// The first error in item order is returned, later items are not consumed, and a panicking
    /// job's panic reaches the caller.
    #[test]
    fn in_order_stops_at_the_first_error_and_resumes_panics() {
        let items: Vec<usize> = (0..100).collect();
        let window = Window {
            items: 8,
            weight: u64::MAX,
        };
        let mut consumed = Vec::new();
        let err = in_order(
            &items,
            |_| 1,
            window,
            |&i| match i {
                17 | 40 => Err(CompressError::Usage(format!("item {i}"))),
                _ => Ok(i),
            },
            |_, i| {
                consumed.push(i);
                Ok(())
            },
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "item 17");
        assert_eq!(consumed, (0..17).collect::<Vec<_>>());
        let err = in_order(
            &items,
            |_| 1,
            window,
            |&i| Ok(i),
            |_, i| match i {
                5 => Err(CompressError::Usage("consumer".into())),
                _ => Ok(()),
            },
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "consumer");
        let panic = std::panic::catch_unwind(|| {
            in_order(
                &items,
                |_| 1,
                window,
                |&i| {
                    assert!(i != 3, "job 3 fails");
                    Ok(i)
                },
                |_, _| Ok(()),
            )
        })
        .unwrap_err();
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned());
        assert_eq!(message.as_deref(), Some("job 3 fails"));
    }

    /// Planned forms are stored as each form says (dtANS with the planned coding, DFloat11,
    /// dense as stored), or — a form the container has no storage for (dense f32 from BF16) — as
    /// without a plan; every form is recorded, the loader serves them all, and the source comes
    /// back bit for bit.
    #[test]
    fn planned_forms_are_stored_recorded_and_served() {
        use crate::load::{open_weights_with, LoadOptions};
        use crate::synth::{fill_tensor_16, hf_config_json, tensors, SynthDtype, SynthShape};
        use entrollm_format::safetensors::write_safetensors;
        use entrollm_format::{restore_sources, ContainerReader, StoredData};
        let dir = std::env::temp_dir().join(format!("entrollm-planned-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let config = SynthShape::Tiny.config();
        let synth = tensors(&config);
        let data: Vec<Vec<u8>> = synth
            .iter()
            .map(|t| {
                let mut b = vec![0u8; 2 * t.numel()];
                fill_tensor_16(t, 9, SynthDtype::Bf16, &mut b);
                b
            })
            .collect();
        let views: Vec<TensorView<'_>> = synth
            .iter()
            .zip(&data)
            .map(|(t, b)| TensorView {
                name: &t.name,
                dtype: Dtype::BF16,
                shape: &t.shape,
                bytes: b,
            })
            .collect();
        write_safetensors(&src.join("model.safetensors"), &views, None).unwrap();
        std::fs::write(src.join("config.json"), hf_config_json(&config, "bfloat16")).unwrap();
        let form = |f: &str, v: &str| FormEntry {
            form: f.into(),
            variant: v.into(),
        };
        let l0 = |s: &str| format!("model.layers.0.{s}.weight");
        let mut forms = BTreeMap::new();
        for t in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] {
            forms.insert(l0(t), form("dtans", "pair:8:64:12"));
        }
        forms.insert(l0("self_attn.o_proj"), form("df11", ""));
        forms.insert(l0("mlp.gate_proj"), form("dense", "f32"));
        forms.insert(l0("mlp.up_proj"), form("dense", "f32"));
        forms.insert(l0("mlp.down_proj"), form("dense", "bf16"));
        let opts = CompressOptions {
            forms: forms.clone(),
            ..CompressOptions::default()
        };
        let dst = dir.join("c");
        let summary = compress(&src, &dst, &opts, &mut NoProgress).unwrap();
        assert_eq!(summary.formed_tensors, forms.len());
        let r = ContainerReader::open(&dst).unwrap();
        let stored = |name: &str| {
            let t = r.tensor(name).unwrap();
            match &t.data {
                StoredData::Plain(_) => "plain".to_string(),
                StoredData::Coded(c) => {
                    let coded = Coded::from_stored(t.dtype, t.shape, c).unwrap();
                    match coded.downcast_ref::<DtansTensor>() {
                        Some(d) => format!("dtans {}", d.coding),
                        None => coded.coder().to_string(),
                    }
                }
            }
        };
        for (name, f) in &forms {
            assert_eq!(r.form(name), Some(f), "{name}");
        }
        assert_eq!(stored(&l0("self_attn.k_proj")), "dtans pair:8:64:12");
        assert_eq!(stored(&l0("self_attn.o_proj")), "df11");
        assert_eq!(stored(&l0("mlp.down_proj")), "plain");
        // No storage for dense f32: coded as without a plan (the default coder: at 192 columns
        // rANS beside the raw bytes, dtANS being past its slack there).
        assert_eq!(stored(&l0("mlp.gate_proj")), "rans-floats");
        assert_eq!(r.form("model.layers.1.mlp.down_proj.weight"), None);

        let served = open_weights_with(&dst, LoadOptions::default()).unwrap();
        let l = &served.layers[0];
        for (m, want) in [
            (&l.q, "dtans:pair:8:64:12"),
            (&l.v, "dtans:pair:8:64:12"),
            (&l.o, "df11"),
            (&l.gated().unwrap().gate, "dense:f32"),
            (&l.gated().unwrap().up, "dense:f32"),
            (&l.gated().unwrap().down, "dense:bf16"),
        ] {
            assert_eq!(m.form().to_string(), want);
        }
        // As stored when asked (what a new plan starts from).
        let as_stored = open_weights_with(
            &dst,
            LoadOptions {
                recorded_forms: false,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        // (`rans-floats` is served decoded.)
        assert_eq!(
            as_stored.layers[0].gated().unwrap().gate.form().form,
            "dense"
        );

        // The served weights are the source's: the same products.
        let plain = open_weights_with(&src, LoadOptions::default()).unwrap();
        let x: Vec<f32> = (0..config.hidden_size)
            .map(|i| (i % 7) as f32 - 3.0)
            .collect();
        let gate = |w: &crate::LayerWeights| Arc::clone(&w.gated().unwrap().gate);
        for (a, b) in [
            (gate(&plain.layers[0]), gate(l)),
            (Arc::clone(&plain.layers[0].o), Arc::clone(&l.o)),
        ] {
            let (mut ya, mut yb) = (vec![0f32; a.rows()], vec![0f32; b.rows()]);
            a.matvec(&x, &mut ya);
            b.matvec(&x, &mut yb);
            for (p, q) in ya.iter().zip(&yb) {
                assert!((p - q).abs() <= 1e-4 * p.abs().max(1.0), "{p} vs {q}");
            }
        }
        let back = dir.join("back");
        restore_sources(
            &r,
            &back,
            false,
            |t| -> std::result::Result<std::borrow::Cow<[u8]>, CompressError> {
                match &t.data {
                    StoredData::Plain(b) => Ok(std::borrow::Cow::Borrowed(*b)),
                    StoredData::Coded(c) => Ok(std::borrow::Cow::Owned(
                        Coded::from_stored(t.dtype, t.shape, c)?.decode()?,
                    )),
                }
            },
            None,
        )
        .unwrap();
        assert!(
            std::fs::read(back.join("model.safetensors")).unwrap()
                == std::fs::read(src.join("model.safetensors")).unwrap()
        );

        // A plan naming a tensor the checkpoint lacks is refused.
        let mut bad = opts.clone();
        bad.forms
            .insert("model.layers.9.mlp.up_proj.weight".into(), form("int", ""));
        let e = compress(&src, &dir.join("bad"), &bad, &mut NoProgress).unwrap_err();
        assert!(
            e.to_string().contains("model.layers.9.mlp.up_proj.weight"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A synthetic checkpoint compresses to byte-identical containers on one and two threads, and
    /// every coded tensor decodes to its source.
    #[test]
    fn containers_do_not_depend_on_the_thread_count() {
        use crate::synth::{fill_tensor_16, tensors, SynthDtype, SynthShape};
        use entrollm_format::safetensors::write_safetensors;
        let dir = std::env::temp_dir().join(format!("entrollm-compress-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let synth = tensors(&SynthShape::Tiny.config());
        let data: Vec<Vec<u8>> = synth
            .iter()
            .map(|t| {
                let mut b = vec![0u8; 2 * t.numel()];
                fill_tensor_16(t, 5, SynthDtype::Bf16, &mut b);
                b
            })
            .collect();
        let views: Vec<TensorView<'_>> = synth
            .iter()
            .zip(&data)
            .map(|(t, b)| TensorView {
                name: &t.name,
                dtype: Dtype::BF16,
                shape: &t.shape,
                bytes: b,
            })
            .collect();
        let half = views.len() / 2;
        write_safetensors(&src.join("a.safetensors"), &views[..half], None).unwrap();
        write_safetensors(&src.join("b.safetensors"), &views[half..], None).unwrap();
        std::fs::write(src.join("config.json"), "{}").unwrap();
        let opts = CompressOptions {
            // A small byte window, so the window limits by bytes as well as by count.
            in_flight_bytes: 1 << 18,
            ..CompressOptions::default()
        };
        let mut sums = Vec::new();
        for threads in [1, 2] {
            let dst = dir.join(format!("c{threads}"));
            let summary = pool(threads)
                .install(|| compress(&src, &dst, &opts, &mut NoProgress))
                .unwrap();
            assert!(summary.coded_tensors >= 16, "{summary:?}");
            assert!(
                summary.coded_bytes < summary.coded_source_bytes,
                "{summary:?}"
            );
            let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dst)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    let name = e.file_name().to_string_lossy().into_owned();
                    (name, std::fs::read(e.path()).unwrap())
                })
                .collect();
            files.sort();
            sums.push(files);
        }
        assert_eq!(sums[0].len(), sums[1].len());
        for (a, b) in sums[0].iter().zip(&sums[1]) {
            assert_eq!(a.0, b.0);
            assert!(a.1 == b.1, "{} differs between 1 and 2 threads", a.0);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
