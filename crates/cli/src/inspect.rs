//! `entrollm inspect`: per-tensor shapes, dtypes, entropies, codings and sizes of a container (or of
//! a plain checkpoint, showing what coding could reach), with totals.

use anyhow::Result;
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_format::coded::{payload_of, GgmlScales};
use entrollm_format::{Checkpoint, ContainerReader, Dtype, StoredData};
use entrollm_model::gguf::{gguf_container_header, is_gguf_container};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// An entrollm container, or a source `compress` takes (a GGUF file, a Hugging Face checkpoint
    /// directory or .safetensors file): then each codable tensor's code entropy and the size the
    /// coder predicts for it, before anything is written.
    path: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn coding_label(coder: &str, p: &Value) -> String {
    match coder {
        "dtans" => format!(
            "dtans {} M=2^{} sc={}{}",
            p["mode"].as_str().unwrap_or("?"),
            p["log2_m"],
            p["sc"],
            p["t"]
                .as_u64()
                .map(|t| format!(" t={t}"))
                .unwrap_or_default()
        ),
        "lossy" => format!(
            "lossy {} at {:.3} bits (target {}), relative L2 error {:.2} %",
            p["quantizer"].as_str().unwrap_or("?"),
            p["bits_per_weight"].as_f64().unwrap_or(f64::NAN),
            p["stats"]["target_bits"],
            100.0 * p["stats"]["rel_l2"].as_f64().unwrap_or(f64::NAN)
        ),
        "dtans-scalar" => format!(
            "lossy {} at {:.3} bits (target {}; codes {:.3} bits of entropy, dtANS {}), \
             relative L2 error {:.2} %",
            p["quantizer"].as_str().unwrap_or("?"),
            p["bits_per_weight"].as_f64().unwrap_or(f64::NAN),
            p["stats"]["target_bits"],
            p["stats"]["code_entropy"].as_f64().unwrap_or(f64::NAN),
            p["codes"]["payload"],
            100.0 * p["stats"]["rel_l2"].as_f64().unwrap_or(f64::NAN)
        ),
        "dtans-blocks" => format!("dtans-blocks {}", p["type"].as_str().unwrap_or("?")),
        "rans-floats" => format!(
            "rans-floats: codes {}, raw bytes as stored",
            p["stats"]["coding"].as_str().unwrap_or("?")
        ),
        "rans-fields" => format!(
            "rans-fields of {} bits, {:.3} bits a field",
            p["bits"],
            p["stats"]["bits_per_field"].as_f64().unwrap_or(f64::NAN)
        ),
        c => c.to_string(),
    }
}

pub fn run(a: Args) -> Result<()> {
    let (rows, plan) = if std::fs::symlink_metadata(a.path.join("entrollm.json")).is_ok() {
        crate::generate::lossy_note(&a.path);
        container(&a)?
    } else if entrollm_model::compress::is_gguf(&a.path) {
        (gguf_source(&a)?, None)
    } else {
        (checkpoint(&a)?, None)
    };
    let numel: f64 = rows
        .iter()
        .map(|r| r["numel"].as_f64().unwrap_or(0.0))
        .sum();
    let source: f64 = rows
        .iter()
        .map(|r| r["source_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    let stored: f64 = rows
        .iter()
        .map(|r| r["stored_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    let coded: Vec<&Value> = rows.iter().filter(|r| r["coder"].is_string()).collect();
    let coded_numel: f64 = coded
        .iter()
        .map(|r| r["numel"].as_f64().unwrap_or(0.0))
        .sum();
    let coded_bytes: f64 = coded
        .iter()
        .map(|r| r["stored_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    let coded_source: f64 = coded
        .iter()
        .map(|r| r["source_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    let coded_bound: f64 = coded
        .iter()
        .map(|r| {
            r["entropy_bound_bpw"].as_f64().unwrap_or(0.0) * r["numel"].as_f64().unwrap_or(0.0)
        })
        .sum();
    let totals = json!({
        "tensors": rows.len(),
        "parameters": numel,
        "source_bytes": source,
        "stored_bytes": stored,
        "ratio": stored / source.max(1.0),
        "coded_tensors": coded.len(),
        "coded_bits_per_weight": if coded_numel > 0.0 { coded_bytes * 8.0 / coded_numel } else { f64::NAN },
        "coded_entropy_bound_bpw": if coded_numel > 0.0 { coded_bound / coded_numel } else { f64::NAN },
        "coded_source_bits_per_weight": if coded_numel > 0.0 { coded_source * 8.0 / coded_numel } else { f64::NAN },
        "bits_per_weight": stored * 8.0 / numel.max(1.0),
        "source_bits_per_weight": source * 8.0 / numel.max(1.0),
    });
    if a.json {
        let mut out = json!({ "tensors": rows, "totals": totals });
        if let Some(p) = plan {
            out["plan"] = p;
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{:<52} {:>6} {:>16} {:>8} {:>8} {:>8}  coding / overheads",
        "tensor", "dtype", "shape", "H(code)", "bound", "bpw"
    );
    for r in &rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "{:<52} {:>6} {:>16} {:>8} {:>8} {:>8}  {}",
            r["name"].as_str().unwrap_or(""),
            r["dtype"].as_str().unwrap_or(""),
            r["shape"].to_string(),
            f("entropy_bits"),
            f("entropy_bound_bpw"),
            f("bits_per_weight"),
            r["detail"].as_str().unwrap_or("")
        );
    }
    if let Some(p) = &plan {
        println!(
            "\nserved in the forms of a plan (compress --plan): predicted {:.1} tok/s on {} {} \
             ({} cost model), launches {:.3} GB",
            p["predicted_tok_s"].as_f64().unwrap_or(f64::NAN),
            p["device"]["kind"].as_str().unwrap_or("?"),
            p["device"]["name"].as_str().unwrap_or("?"),
            p["cost_model"].as_str().unwrap_or("?"),
            p["total_bytes"].as_f64().unwrap_or(0.0) / 1e9
        );
    }
    println!(
        "\n{} tensors, {:.3} G parameters: {:.3} GB source ({:.3} bits/weight), {:.3} GB stored \
         ({:.3} bits/weight, {:.1} %)",
        rows.len(),
        numel / 1e9,
        source / 1e9,
        source * 8.0 / numel.max(1.0),
        stored / 1e9,
        stored * 8.0 / numel.max(1.0),
        100.0 * stored / source.max(1.0)
    );
    let predicted: Vec<&Value> = rows
        .iter()
        .filter(|r| r["predicted_bytes"].is_number())
        .collect();
    if !predicted.is_empty() {
        let sum = |k: &str| -> f64 { predicted.iter().filter_map(|r| r[k].as_f64()).sum() };
        let all = stored - sum("source_bytes") + sum("predicted_bytes");
        println!(
            "compress would code {} tensors: {:.1} MB -> {:.1} MB predicted; all tensors {:.1} MB \
             ({:.3} bits/weight, {:.1} % of the source's)",
            predicted.len(),
            sum("source_bytes") / 1e6,
            sum("predicted_bytes") / 1e6,
            all / 1e6,
            all * 8.0 / numel.max(1.0),
            100.0 * all / source.max(1.0)
        );
    }
    if coded_numel > 0.0 {
        println!(
            "coded tensors: {} at {:.4} bits/weight, {:.4} in the source (entropy bound {:.4}, \
             overhead {:+.4})",
            coded.len(),
            coded_bytes * 8.0 / coded_numel,
            coded_source * 8.0 / coded_numel,
            coded_bound / coded_numel,
            (coded_bytes * 8.0 - coded_bound) / coded_numel
        );
    }
    Ok(())
}

/// The container's tensors, and the plan its forms come from (`compress --plan`), if any.
fn container(a: &Args) -> Result<(Vec<Value>, Option<Value>)> {
    let reader = ContainerReader::open(&a.path)?;
    // A GGUF-sourced container stores block tensors as bytes: its GGUF header gives each tensor's
    // type and weight shape.
    let gguf = is_gguf_container(&reader)
        .then(|| gguf_container_header(&reader))
        .transpose()?;
    let mut rows = Vec::new();
    for t in reader.tensors() {
        let info = gguf.as_ref().and_then(|g| g.tensor_info(t.name));
        let (dtype, shape) = match info {
            Some(i) => (i.ggml_type.name(), i.hf_shape()),
            None => (t.dtype.name(), t.shape.to_vec()),
        };
        let numel: usize = shape.iter().product();
        let source = t.byte_len() as f64;
        let mut r = json!({
            "name": t.name, "dtype": dtype, "shape": shape, "numel": numel, "source_bytes": source,
        });
        match &t.data {
            StoredData::Plain(b) => {
                r["stored_bytes"] = json!(b.len());
                r["bits_per_weight"] = json!(b.len() as f64 * 8.0 / numel.max(1) as f64);
                r["detail"] = json!("plain");
            }
            StoredData::Coded(c) => {
                let stored: usize = c.arrays.values().map(|(_, b)| b.len()).sum();
                let stats = &c.params["stats"];
                r["coder"] = json!(c.coder);
                r["stored_bytes"] = json!(stored);
                r["bits_per_weight"] = json!(stored as f64 * 8.0 / numel as f64);
                r["entropy_bits"] = stats["entropy_bits"].clone();
                r["entropy_bound_bpw"] = stats["entropy_bound_bpw"].clone();
                r["coding"] = c.params.clone();
                let mut detail = coding_label(c.coder, c.params);
                if let Some(b) = stats.get("breakdown") {
                    let per = |k: &str| b[k].as_f64().unwrap_or(0.0) * 8.0 / numel as f64;
                    detail.push_str(&format!(
                        "; ans {:.3} companion {:.3} raw {:.3} escapes {:.4} ({}) headers+pad {:.4} index+table {:.4}",
                        per("ans_bytes"),
                        per("companion_bytes"),
                        per("raw_bytes"),
                        per("escape_bytes"),
                        b["escapes"],
                        per("chunk_header_bytes") + per("padding_bytes"),
                        per("tile_index_bytes") + per("table_bytes"),
                    ));
                }
                // Split blocks: each stream's share and coding.
                if let Some(streams) = stats.get("streams").and_then(Value::as_array) {
                    for s in streams {
                        detail.push_str(&format!(
                            "; {} {:.3} {}",
                            s["name"].as_str().unwrap_or("?"),
                            s["bits_per_weight"].as_f64().unwrap_or(0.0),
                            s["coding"].as_str().unwrap_or("?")
                        ));
                    }
                }
                r["detail"] = json!(detail);
            }
        }
        if let Some(f) = reader.form(t.name) {
            r["form"] = json!({ "form": f.form, "variant": f.variant });
            let served = match f.variant.is_empty() {
                true => f.form.clone(),
                false => format!("{} {}", f.form, f.variant),
            };
            let detail = r["detail"].as_str().unwrap_or("").to_string();
            r["detail"] = json!(format!("served as {served}; {detail}"));
        }
        rows.push(r);
    }
    Ok((rows, reader.manifest().metadata.get("plan").cloned()))
}

/// A source tensor's row: as stored now (`stored_bytes` = its bytes), with its code entropy and what
/// `compress` would make of it where it codes: the coding the coder predicts smallest and its size
/// (`predicted_bits_per_weight`; the tensor stays plain where that is no smaller). `codes` are the
/// coded symbols of a `rows × cols` matrix of `payload`, `side_bpw` the bits a weight stored beside
/// them (raw low bytes, block scales).
#[allow(clippy::too_many_arguments)]
fn source_row(
    name: &str,
    dtype: &str,
    shape: &[usize],
    bytes: usize,
    coded: Option<(entrollm_codec::Payload, usize, usize, &[u8], f64)>,
    min_elements: usize,
) -> Result<Value> {
    let numel: usize = shape.iter().product();
    let bpw = bytes as f64 * 8.0 / numel.max(1) as f64;
    let mut r = json!({
        "name": name, "dtype": dtype, "shape": shape, "numel": numel,
        "source_bytes": bytes, "stored_bytes": bytes, "bits_per_weight": bpw, "detail": "stays plain",
    });
    let Some((payload, rows, cols, codes, side_bpw)) = coded.filter(|_| numel >= min_elements)
    else {
        return Ok(r);
    };
    let h = entropy_bits(&byte_histogram(codes));
    r["entropy_bits"] = json!(h);
    r["entropy_bound_bpw"] = json!(h + side_bpw);
    let (coding, predicted) =
        entrollm_codec::dtans::choose_coding_and_width(payload, rows, cols, codes)?;
    // A float payload's raw bytes are in dtANS's prediction; block scales are not.
    let side = if payload.has_raw() {
        0.0
    } else {
        side_bpw * numel as f64 / 8.0
    };
    let (coder, predicted) =
        match entrollm_model::compress::floats_instead(payload, codes, predicted)? {
            Some(p) => (entrollm_format::coded::RANS_FLOATS.to_string(), p),
            None => (format!("dtans {coding}"), predicted + side),
        };
    let coded_bpw = predicted * 8.0 / numel as f64;
    r["predicted_bits_per_weight"] = json!(coded_bpw);
    r["detail"] = json!(if coded_bpw < bpw {
        r["predicted_bytes"] = json!(predicted);
        format!("would code: {coder}, {coded_bpw:.3} bits/weight")
    } else {
        format!("stays plain ({coder} would take {coded_bpw:.3} bits/weight)")
    });
    Ok(r)
}

/// Tensors with fewer elements stay plain (`compress --min-elements`' default).
const MIN_ELEMENTS: usize = 4096;

fn checkpoint(a: &Args) -> Result<Vec<Value>> {
    use rayon::prelude::*;
    let ckpt = Checkpoint::open(&a.path)?;
    let tensors: Vec<_> = ckpt.tensors().collect();
    tensors
        .par_iter()
        .map(|t| {
            let row = |coded| {
                let shape = &t.shape;
                source_row(
                    t.name,
                    t.dtype.name(),
                    shape,
                    t.bytes.len(),
                    coded,
                    MIN_ELEMENTS,
                )
            };
            let matrix = t.shape.len() == 2 && !entrollm_model::compress::is_side_tensor(t.name);
            match payload_of(t.dtype).filter(|_| matrix) {
                Some(p) => {
                    let (codes, _) = p.symbolize(t.bytes)?;
                    let side = if p.has_raw() { 8.0 } else { 0.0 };
                    row(Some((p, t.shape[0], t.shape[1], &codes[..], side)))
                }
                None => fields_row(row(None)?, t.dtype, t.bytes),
            }
        })
        .collect()
}

/// A tensor no matrix form holds (packed integer codes, group scales): what `compress` would
/// store of it as fields ([`entrollm_model::compress::fields_choice`]).
fn fields_row(mut r: Value, dtype: Dtype, bytes: &[u8]) -> Result<Value> {
    let numel = r["numel"].as_f64().unwrap_or(0.0);
    if numel < MIN_ELEMENTS as f64 {
        return Ok(r);
    }
    let Some((bits, predicted, h)) = entrollm_model::compress::fields_choice(dtype, bytes)? else {
        return Ok(r);
    };
    let per_element = dtype.bits() as f64 / f64::from(bits);
    let bpw = predicted * 8.0 / numel;
    r["entropy_bits"] = json!(h);
    r["entropy_bound_bpw"] = json!(h * per_element);
    r["predicted_bits_per_weight"] = json!(bpw);
    r["predicted_bytes"] = json!(predicted);
    r["detail"] = json!(format!(
        "would code: rans-fields of {bits} bits, {:.3} bits a field",
        bpw / per_element
    ));
    Ok(r)
}

/// A GGUF file's tensors: block codes (Q4_0 … Q8_0) and F16/BF16 matrices as `compress` codes them.
fn gguf_source(a: &Args) -> Result<Vec<Value>> {
    use entrollm_format::qtype::Store;
    use entrollm_model::gguf::GgufFile;
    use rayon::prelude::*;
    let file = GgufFile::open(&a.path)?;
    file.tensors()
        .par_iter()
        .map(|t| {
            let data = file.tensor_data(t);
            let shape = t.hf_shape();
            let (rows, cols) = (t.n_rows(), t.row_len());
            let row = |coded| {
                source_row(
                    &t.name,
                    t.ggml_type.name(),
                    &shape,
                    data.len(),
                    coded,
                    MIN_ELEMENTS,
                )
            };
            let matrix = shape.len() >= 2;
            let ty = t.ggml_type;
            match ty.row().store {
                Store::Codes if matrix => {
                    let block = ty;
                    let q =
                        entrollm_format::ggml_blocks::unpack_codes(block, data).map_err(|e| {
                            anyhow::anyhow!("{}: tensor {}: {e}", a.path.display(), t.name)
                        })?;
                    let payload = entrollm_codec::Payload::Int(block.code_bits() as u8);
                    // Predictions store the scales raw; the bound takes them at their entropy.
                    let h16 = entrollm_codec::histogram::u16_entropy_bits;
                    let raw = if entrollm_format::ggml_blocks::has_m(block) {
                        1.0
                    } else {
                        0.5
                    };
                    let side = (h16(&q.d) + q.m.as_deref().map_or(0.0, h16)) / 32.0;
                    let mut r = row(Some((payload, rows, cols, &q.codes[..], raw)))?;
                    let h = r["entropy_bits"].as_f64().unwrap_or(0.0);
                    if r["entropy_bits"].is_number() {
                        r["entropy_bound_bpw"] = json!(h + side);
                    }
                    // Codes that would not code smaller: compress codes the scales alone where
                    // that pays (`ggml-scales`).
                    if r["predicted_bytes"].is_null() && r["entropy_bits"].is_number() {
                        let p = GgmlScales::predict_bytes(block, data)?;
                        if p < data.len() as f64 {
                            let bpw = p * 8.0 / (rows * cols) as f64;
                            r["predicted_bytes"] = json!(p);
                            r["predicted_bits_per_weight"] = json!(bpw);
                            r["detail"] = json!(format!(
                                "would code its scales alone: ggml-scales, {bpw:.3} bits/weight"
                            ));
                        }
                    }
                    // Where codes and scales split and rANS-coded save more than the margin
                    // dtANS is preferred by, compress takes them (`dtans-blocks`).
                    if r["entropy_bits"].is_number() {
                        let (p, _) =
                            entrollm_format::coded::BlocksCoded::predict(ty, rows, cols, data)?;
                        let now = r["predicted_bytes"].as_f64().unwrap_or(data.len() as f64);
                        let margin =
                            entrollm_format::coded::RANS_MARGIN_BITS * (rows * cols) as f64 / 8.0;
                        if p + margin < now {
                            let bpw = p * 8.0 / (rows * cols) as f64;
                            r["predicted_bytes"] = json!(p);
                            r["predicted_bits_per_weight"] = json!(bpw);
                            r["detail"] =
                                json!(format!("would code: dtans-blocks, {bpw:.3} bits/weight"));
                        }
                    }
                    Ok(r)
                }
                Store::Split if matrix && cols.is_multiple_of(ty.block_size()) => {
                    let k = ty;
                    let mut r = row(None)?;
                    if rows * cols < MIN_ELEMENTS {
                        return Ok(r);
                    }
                    let (p, h) = entrollm_format::coded::BlocksCoded::predict(k, rows, cols, data)
                        .map_err(|e| {
                            anyhow::anyhow!("{}: tensor {}: {e}", a.path.display(), t.name)
                        })?;
                    let bpw = p * 8.0 / (rows * cols) as f64;
                    r["entropy_bits"] = json!(h.code_bits);
                    r["entropy_bound_bpw"] = json!(h.bound_bpw());
                    r["predicted_bits_per_weight"] = json!(bpw);
                    r["detail"] = json!(if p < data.len() as f64 {
                        r["predicted_bytes"] = json!(p);
                        format!("would code: dtans-blocks, {bpw:.3} bits/weight")
                    } else {
                        format!("stays plain (dtans-blocks would take {bpw:.3} bits/weight)")
                    });
                    Ok(r)
                }
                Store::Float(d @ (Dtype::F16 | Dtype::BF16)) if matrix => {
                    let p = match d {
                        Dtype::F16 => entrollm_codec::Payload::Fp16,
                        _ => entrollm_codec::Payload::Bf16,
                    };
                    let (codes, _) = p.symbolize(data)?;
                    row(Some((p, rows, cols, &codes[..], 8.0)))
                }
                _ => row(None),
            }
        })
        .collect()
}
