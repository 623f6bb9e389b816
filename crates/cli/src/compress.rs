//! `entrollm compress`: code a checkpoint losslessly into an entrollm container.

use crate::progress;
use anyhow::{anyhow, bail, Context, Result};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{choose_coding_and_width, Coding, DtansTensor};
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_codec::Payload;
use entrollm_format::coded::{payload_of, Coded};
use entrollm_format::{
    checksum, Checkpoint, ContainerWriter, Dtype, SourceFile, SourceSegment, TensorView,
    WriterOptions,
};
use entrollm_model::coding_plan::CodingPlan;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face checkpoint: a directory (sharded with an index, or of .safetensors files) or
    /// one .safetensors file; BF16, FP16 and FP8 tensors are coded, others stored as they are. Or a
    /// GGUF file: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 codes and F16/BF16 matrices are coded, other tensors
    /// (F32, k-quants) stored as they are; the GGUF is restored bit for bit by `decompress`.
    src: PathBuf,
    /// Output container directory (must not exist or be empty, unless --overwrite).
    #[arg(short, long)]
    output: PathBuf,
    /// dtans (dtANS-LLM, every float dtype) or df11 (DFloat11 layout, BF16 only).
    #[arg(long, default_value = "dtans")]
    coder: String,
    /// dtANS coding: "auto" (smallest predicted size per tensor) or MODE:LOG2M:SC[:T], e.g.
    /// pair:12:512:64 (mode single|pair|quad, table 2^8..2^12, slice width, values kept).
    #[arg(long, default_value = "auto")]
    coding: String,
    /// A JSON file of codings per launch (qkv, o, gate_up, down, lm_head, embed, default), e.g.
    /// from a tuner; launches it does not name get --coding.
    #[arg(long)]
    coding_file: Option<PathBuf>,
    /// Tensors with fewer elements than this stay uncoded.
    #[arg(long, default_value_t = 4096)]
    min_elements: usize,
    #[arg(long)]
    overwrite: bool,
    /// Largest container shard, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    shard_size: u64,
}

/// The coding plan of `--coding` and `--coding-file`.
fn coding_plan(a: &Args) -> Result<CodingPlan> {
    let default = Coding::parse(&a.coding).map_err(|e| anyhow!("--coding: {e}"))?;
    Ok(match &a.coding_file {
        Some(f) => CodingPlan::from_file(f, default)?,
        None => CodingPlan::uniform(default),
    })
}

/// Files of the source directory that are not checkpoint shards: copied verbatim.
fn verbatim_files(root: &Path, shards: &[&str]) -> Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    if !root.is_dir() {
        return Ok(out);
    }
    for e in std::fs::read_dir(root).with_context(|| format!("reading {}", root.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type()?.is_file() && !shards.contains(&name.as_str()) && !name.starts_with('.') {
            out.push((e.path(), name));
        }
    }
    out.sort();
    Ok(out)
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
) -> Result<(DtansTensor, serde_json::Value)> {
    let (coding, predicted) = match coding {
        Some(c) => (
            c,
            DtansTensor::predict_bytes(payload, rows, cols, codes, c)?,
        ),
        None => choose_coding_and_width(payload, rows, cols, codes)?,
    };
    let d = DtansTensor::encode(payload, rows, cols, codes, raw, coding)?;
    let b = d.size_breakdown()?;
    Ok((
        d,
        json!({ "predicted_bytes": predicted.round(), "breakdown": b }),
    ))
}

/// Checks that `coded` decodes to `original` and completes its statistics: the entropy of the
/// coded symbols `codes`, the bound (entropy plus `side_bits` stored beside per weight) and the
/// bits per weight reached.
fn finish_coded(
    coded: &Coded,
    original: &[u8],
    numel: usize,
    codes: &[u8],
    side_bits: f64,
    mut stats: serde_json::Value,
) -> Result<serde_json::Value> {
    if coded.decode()? != original {
        bail!(
            "coded form does not decode to the original bytes (a coder bug; nothing was written)"
        );
    }
    let entropy = entropy_bits(&byte_histogram(codes));
    stats["entropy_bits"] = json!(entropy);
    stats["entropy_bound_bpw"] = json!(entropy + side_bits);
    stats["bits_per_weight"] = json!(coded.stored_bytes() as f64 * 8.0 / numel as f64);
    Ok(stats)
}

/// Codes one safetensors tensor and checks that it decodes back to the same bytes.
fn code_tensor(
    t: &TensorView,
    coder: &str,
    coding: Option<Coding>,
) -> Result<(Coded, serde_json::Value)> {
    let payload = payload_of(t.dtype).expect("only codable dtypes are coded");
    let rows = t.shape[0];
    let cols = t.bytes.len() / payload.element_bytes() / rows;
    let (codes, raw) = payload.symbolize(t.bytes)?;
    let (coded, stats) = match coder {
        "dtans" => {
            let (d, stats) = code_dtans(payload, rows, cols, &codes, &raw, coding)?;
            (Coded::Dtans(d), stats)
        }
        "df11" => {
            let w: Vec<u16> = t
                .bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            (Coded::Df11(Df11Tensor::encode(&w)?), json!({}))
        }
        c => bail!("unknown coder '{c}': use dtans or df11"),
    };
    let side_bits = if payload.has_raw() { 8.0 } else { 0.0 };
    let stats = finish_coded(&coded, t.bytes, rows * cols, &codes, side_bits, stats)?;
    Ok((coded, stats))
}

pub fn run(a: Args) -> Result<()> {
    let plan = coding_plan(&a)?;
    if a.coder != "dtans" && a.coder != "df11" {
        bail!("unknown coder '{}': use dtans or df11", a.coder);
    }
    if is_gguf(&a.src) {
        return gguf::run(&a, &plan);
    }
    let ckpt = Checkpoint::open(&a.src)?;
    let shard_names: Vec<&str> = ckpt.files().map(|(n, _)| n).collect();
    let root = if a.src.is_dir() {
        a.src.clone()
    } else {
        a.src.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let mut w = ContainerWriter::create(
        &a.output,
        WriterOptions {
            shard_size_limit: a.shard_size,
            overwrite: a.overwrite,
            ..WriterOptions::default()
        },
    )?;
    if a.src.is_dir() {
        for (path, name) in verbatim_files(&root, &shard_names)? {
            w.copy_file(&path, &name)?;
        }
    }
    for (name, file) in ckpt.files() {
        w.add_source_file(SourceFile::from_safetensors(name, file))?;
    }
    if a.coder == "df11" && !ckpt.tensors().any(|t| t.dtype == Dtype::BF16) {
        bail!(
            "{}: df11 codes BF16 tensors and this checkpoint has none; use --coder dtans",
            a.src.display()
        );
    }
    let total: u64 = ckpt.tensors().map(|t| t.bytes.len() as u64).sum();
    let bar = progress::bytes(total, "compress");
    let (mut in_coded, mut out_coded, mut n_coded) = (0u64, 0u64, 0usize);
    for t in ckpt.tensors() {
        let numel: usize = t.shape.iter().product();
        let codable = payload_of(t.dtype)
            .is_some_and(|_| a.coder == "dtans" || t.dtype == Dtype::BF16)
            && t.shape.len() >= 2
            && numel >= a.min_elements;
        if codable {
            let (coded, stats) = code_tensor(&t, &a.coder, plan.coding_for(t.name))
                .with_context(|| format!("tensor '{}'", t.name))?;
            let arrays = coded.arrays();
            let arrays = arrays
                .iter()
                .map(|(n, d, b)| (n.clone(), *d, &b[..]))
                .collect();
            w.add_coded(
                t.name,
                t.dtype,
                t.shape,
                coded.coder(),
                coded.params(stats),
                arrays,
                checksum(t.bytes),
            )?;
            in_coded += t.bytes.len() as u64;
            out_coded += coded.stored_bytes() as u64;
            n_coded += 1;
        } else {
            w.add_plain(t.name, t.dtype, t.shape, t.bytes)?;
        }
        bar.inc(t.bytes.len() as u64);
    }
    bar.finish_and_clear();
    w.finish()?;
    eprintln!(
        "coded {n_coded} tensors: {:.3} GB -> {:.3} GB ({:.1} %); container written to {}",
        in_coded as f64 / 1e9,
        out_coded as f64 / 1e9,
        100.0 * out_coded as f64 / in_coded.max(1) as f64,
        a.output.display()
    );
    Ok(())
}

/// Whether `path` is a file that starts with the GGUF magic.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// Compressing a GGUF file.
mod gguf {
    use super::*;
    use entrollm_format::coded::GgmlCoded;
    use entrollm_format::ggml_blocks::{unpack_codes, BlockType};
    use entrollm_model::gguf::{GgmlType, GgufFile, GgufTensorInfo};

    /// How one GGUF tensor goes into the container.
    enum Storage {
        /// Integer codes of a block type, dtANS-coded, scales beside.
        Codes(BlockType),
        /// An F16/BF16 matrix coded as floats.
        Floats(Dtype),
        /// Stored as it is, as this dtype and shape.
        Plain(Dtype, Vec<usize>),
    }

    fn storage(info: &GgufTensorInfo, min_elements: usize) -> Storage {
        let numel = info.n_elements() as usize;
        let matrix = info.dims.len() >= 2 && numel >= min_elements;
        match info.ggml_type {
            t if matrix && t.block_type().is_some() => Storage::Codes(t.block_type().unwrap()),
            GgmlType::F16 if matrix => Storage::Floats(Dtype::F16),
            GgmlType::BF16 if matrix => Storage::Floats(Dtype::BF16),
            GgmlType::F32 => Storage::Plain(Dtype::F32, info.hf_shape()),
            GgmlType::F16 => Storage::Plain(Dtype::F16, info.hf_shape()),
            GgmlType::BF16 => Storage::Plain(Dtype::BF16, info.hf_shape()),
            _ => Storage::Plain(Dtype::U8, vec![info.n_bytes as usize]),
        }
    }

    /// The first non-zero byte of the data section outside every tensor, if any: restoration
    /// writes zeros there.
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

    pub fn run(a: &Args, plan: &CodingPlan) -> Result<()> {
        if a.coder != "dtans" {
            bail!(
                "{}: GGUF files are coded with dtans (df11 codes BF16 safetensors checkpoints)",
                a.src.display()
            );
        }
        let file = GgufFile::open(&a.src)?;
        if let Some(at) = nonzero_padding(&file) {
            bail!(
                "{}: byte {at} lies outside every tensor and is not zero; such a file cannot be \
                 restored bit for bit",
                a.src.display()
            );
        }
        let name = a
            .src
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| anyhow!("{}: not a file name", a.src.display()))?;
        let bytes = file.bytes();
        let data_offset = file.data_offset();
        let mut w = ContainerWriter::create(
            &a.output,
            WriterOptions {
                shard_size_limit: a.shard_size,
                overwrite: a.overwrite,
                ..WriterOptions::default()
            },
        )?;
        w.add_source_file(SourceFile {
            name,
            size: bytes.len() as u64,
            xxh3: checksum(bytes),
            prefix: &bytes[..data_offset as usize],
            segments: file
                .tensors()
                .iter()
                .map(|t| SourceSegment {
                    tensor: t.name.clone(),
                    offset: data_offset + t.offset,
                })
                .collect(),
        })?;
        let total: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
        let bar = progress::bytes(total, "compress");
        let (mut in_coded, mut out_coded, mut n_coded, mut coded_numel) =
            (0u64, 0u64, 0usize, 0u64);
        for info in file.tensors() {
            let data = file.tensor_data(info);
            let with_name = || format!("tensor '{}'", info.name);
            let coding = plan.coding_for(&info.name);
            // What to store when there is nothing to code, or coding would not shrink the tensor
            // (near-uniform codes), and the coded form.
            let (plain_dtype, plain_shape, coded) = match storage(info, a.min_elements) {
                Storage::Plain(dtype, shape) => (dtype, shape, None),
                Storage::Codes(block) => (
                    Dtype::U8,
                    vec![data.len()],
                    Some(code_blocks(info, block, data, coding)),
                ),
                Storage::Floats(dtype) => (
                    dtype,
                    info.hf_shape(),
                    Some(code_floats(info, dtype, data, coding)),
                ),
            };
            match coded.transpose().with_context(with_name)? {
                Some((coded, stats, dtype, shape)) if coded.stored_bytes() < data.len() => {
                    let arrays = coded.arrays();
                    let arrays = arrays
                        .iter()
                        .map(|(n, d, b)| (n.clone(), *d, &b[..]))
                        .collect();
                    w.add_coded(
                        &info.name,
                        dtype,
                        &shape,
                        coded.coder(),
                        coded.params(stats),
                        arrays,
                        checksum(data),
                    )?;
                    in_coded += data.len() as u64;
                    out_coded += coded.stored_bytes() as u64;
                    coded_numel += info.n_elements();
                    n_coded += 1;
                }
                _ => w.add_plain(&info.name, plain_dtype, &plain_shape, data)?,
            }
            bar.inc(info.n_bytes);
        }
        bar.finish_and_clear();
        w.set_metadata("source_format", json!("gguf"));
        w.finish()?;
        eprintln!(
            "coded {n_coded} tensors: {:.1} MB at {:.3} bits/weight in the GGUF -> {:.1} MB at {:.3} \
             ({:.1} %); container written to {}",
            in_coded as f64 / 1e6,
            in_coded as f64 * 8.0 / coded_numel.max(1) as f64,
            out_coded as f64 / 1e6,
            out_coded as f64 * 8.0 / coded_numel.max(1) as f64,
            100.0 * out_coded as f64 / in_coded.max(1) as f64,
            a.output.display()
        );
        Ok(())
    }

    type CodedTensor = (Coded, serde_json::Value, Dtype, Vec<usize>);

    /// Q4_0..Q8_0 blocks: the codes as an int payload (the chosen coding pairs 4-bit codes), the
    /// f16 scales beside.
    fn code_blocks(
        info: &GgufTensorInfo,
        block: BlockType,
        data: &[u8],
        coding: Option<Coding>,
    ) -> Result<CodedTensor> {
        let (rows, cols) = (info.n_rows(), info.row_len());
        let q = unpack_codes(block, data).map_err(|e| anyhow!(e))?;
        let payload = Payload::Int(block.bits() as u8);
        let (codes, stats) = code_dtans(payload, rows, cols, &q.codes, &[], coding)?;
        let coded = Coded::Ggml(GgmlCoded {
            block,
            codes,
            d: q.d,
            m: q.m,
        });
        let side_bits = if block.has_m() { 1.0 } else { 0.5 };
        let mut stats = finish_coded(&coded, data, rows * cols, &q.codes, side_bits, stats)?;
        stats["source_bpw"] = json!(block.bits_per_weight());
        let shape = GgmlCoded::stored_shape(block, rows, cols);
        Ok((coded, stats, Dtype::U8, shape))
    }

    /// F16/BF16 matrices: coded like safetensors ones, rows × columns in GGUF order.
    fn code_floats(
        info: &GgufTensorInfo,
        dtype: Dtype,
        data: &[u8],
        coding: Option<Coding>,
    ) -> Result<CodedTensor> {
        let (rows, cols) = (info.n_rows(), info.row_len());
        let payload = payload_of(dtype).expect("F16 and BF16 are codable");
        let (codes, raw) = payload.symbolize(data)?;
        let (d, stats) = code_dtans(payload, rows, cols, &codes, &raw, coding)?;
        let coded = Coded::Dtans(d);
        let mut stats = finish_coded(&coded, data, rows * cols, &codes, 8.0, stats)?;
        stats["source_bpw"] = json!(16.0);
        Ok((coded, stats, dtype, vec![rows, cols]))
    }
}
