//! `entrollm compress`: code a checkpoint losslessly into an entrollm container.

use crate::progress;
use anyhow::{anyhow, bail, Context, Result};
use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{choose_coding, default_slice_width, Coding, DtansTensor, Mode};
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_format::coded::{payload_of, Coded};
use entrollm_format::{
    checksum, Checkpoint, ContainerWriter, Dtype, SourceFile, TensorView, WriterOptions,
};
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face checkpoint: a directory (sharded with an index, or of .safetensors files) or
    /// one .safetensors file. BF16, FP16 and FP8 tensors are coded; others are stored as they are.
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
    /// Tensors with fewer elements than this stay uncoded.
    #[arg(long, default_value_t = 4096)]
    min_elements: usize,
    #[arg(long)]
    overwrite: bool,
    /// Largest container shard, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    shard_size: u64,
}

fn parse_coding(s: &str) -> Result<Option<Coding>> {
    if s == "auto" {
        return Ok(None);
    }
    let p: Vec<&str> = s.split(':').collect();
    if !(3..=4).contains(&p.len()) {
        bail!("--coding '{s}': expected auto or MODE:LOG2M:SC[:T]");
    }
    let mode = match p[0] {
        "single" => Mode::Single,
        "pair" => Mode::Pair,
        "quad" => Mode::Quad,
        m => bail!("--coding '{s}': unknown mode '{m}' (single, pair, quad)"),
    };
    let num = |x: &str, what: &str| {
        x.parse::<u32>()
            .map_err(|_| anyhow!("--coding '{s}': {what} '{x}' is not a number"))
    };
    Ok(Some(Coding {
        mode,
        log2_m: num(p[1], "LOG2M")? as u8,
        sc: num(p[2], "SC")?,
        t: p.get(3)
            .map(|t| num(t, "T").map(|t| t as u16))
            .transpose()?,
    }))
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

/// Codes one tensor and checks that it decodes back to the same bytes.
fn code_tensor(
    t: &TensorView,
    coder: &str,
    coding: Option<Coding>,
) -> Result<(Coded, serde_json::Value)> {
    let payload = payload_of(t.dtype).expect("only codable dtypes are coded");
    let rows = t.shape[0];
    let cols = t.bytes.len() / payload.element_bytes() / rows;
    let (codes, raw) = payload.symbolize(t.bytes)?;
    let entropy = entropy_bits(&byte_histogram(&codes));
    let raw_bits = if payload.has_raw() { 8.0 } else { 0.0 };
    let (coded, mut stats) = match coder {
        "dtans" => {
            let (coding, predicted) = match coding {
                Some(c) => (
                    c,
                    DtansTensor::predict_bytes(payload, rows, cols, &codes, c)?,
                ),
                None => choose_coding(payload, rows, cols, &codes, default_slice_width(cols))?,
            };
            let d = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding)?;
            let b = d.size_breakdown()?;
            (
                Coded::Dtans(d),
                json!({ "predicted_bytes": predicted.round(), "breakdown": b }),
            )
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
    if coded.decode()? != t.bytes {
        bail!(
            "coded form does not decode to the original bytes (a coder bug; nothing was written)"
        );
    }
    let numel = (rows * cols) as f64;
    stats["entropy_bits"] = json!(entropy);
    stats["entropy_bound_bpw"] = json!(entropy + raw_bits);
    stats["bits_per_weight"] = json!(coded.stored_bytes() as f64 * 8.0 / numel);
    Ok((coded, stats))
}

pub fn run(a: Args) -> Result<()> {
    let coding = parse_coding(&a.coding)?;
    if a.coder != "dtans" && a.coder != "df11" {
        bail!("unknown coder '{}': use dtans or df11", a.coder);
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
            let (coded, stats) = code_tensor(&t, &a.coder, coding)
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
