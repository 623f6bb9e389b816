//! `entrollm inspect`: per-tensor shapes, dtypes, entropies, codings and sizes of a container (or of
//! a plain checkpoint, showing what coding could reach), with totals.

use anyhow::Result;
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_format::coded::payload_of;
use entrollm_format::{Checkpoint, ContainerReader, StoredData};
use entrollm_model::gguf::{gguf_container_header, is_gguf_container};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// An entrollm container or a Hugging Face checkpoint (directory or .safetensors file).
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
        c => c.to_string(),
    }
}

pub fn run(a: Args) -> Result<()> {
    let (rows, plan) = if std::fs::symlink_metadata(a.path.join("entrollm.json")).is_ok() {
        container(&a)?
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

fn checkpoint(a: &Args) -> Result<Vec<Value>> {
    let ckpt = Checkpoint::open(&a.path)?;
    let mut rows = Vec::new();
    for t in ckpt.tensors() {
        let numel: usize = t.shape.iter().product();
        let mut r = json!({
            "name": t.name, "dtype": t.dtype.name(), "shape": t.shape, "numel": numel,
            "source_bytes": t.bytes.len(), "stored_bytes": t.bytes.len(),
            "bits_per_weight": t.bytes.len() as f64 * 8.0 / numel.max(1) as f64, "detail": "uncoded",
        });
        if let Some(p) = payload_of(t.dtype) {
            let (codes, _) = p.symbolize(t.bytes)?;
            let h = entropy_bits(&byte_histogram(&codes));
            r["entropy_bits"] = json!(h);
            r["entropy_bound_bpw"] = json!(h + if p.has_raw() { 8.0 } else { 0.0 });
        }
        rows.push(r);
    }
    Ok(rows)
}
