//! `entrollm synth`: a synthetic HF-style checkpoint (see `entrollm_model::synth` for the weight
//! distribution).

use crate::progress;
use anyhow::{anyhow, Context, Result};
use entrollm_format::safetensors::{write_safetensors, INDEX_FILE};
use entrollm_format::{Dtype, StagingDir, TensorView};
use entrollm_model::synth::{
    fill_tensor_16, hf_config_json, tensors, SynthDtype, SynthShape, SynthTensor,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model shape: tiny, llama-3.1-8b or llama-3.3-70b.
    #[arg(long)]
    shape: String,
    /// Storage dtype: bf16 or fp16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Seed: the same seed always gives the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (must not exist or be empty, unless --overwrite).
    #[arg(short, long)]
    output: PathBuf,
    #[arg(long)]
    overwrite: bool,
    /// Largest shard, in bytes (Hugging Face's default is 5 GB).
    #[arg(long, default_value_t = 5_000_000_000)]
    shard_size: u64,
}

pub fn run(a: Args) -> Result<()> {
    let shape = SynthShape::parse(&a.shape).ok_or_else(|| {
        anyhow!(
            "unknown shape '{}': use one of {}",
            a.shape,
            SynthShape::names().join(", ")
        )
    })?;
    let (dtype, sdtype, torch) = match a.dtype.as_str() {
        "bf16" => (Dtype::BF16, SynthDtype::Bf16, "bfloat16"),
        "fp16" => (Dtype::F16, SynthDtype::F16, "float16"),
        d => return Err(anyhow!("unknown dtype '{d}': use bf16 or fp16")),
    };
    let config = shape.config();
    let all = tensors(&config);
    // Shards in checkpoint order, each at most `shard_size` bytes (a larger tensor gets its own).
    let mut shards: Vec<Vec<&SynthTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in &all {
        let b = 2 * t.numel() as u64;
        if size + b > a.shard_size && !shards.last().unwrap().is_empty() {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().unwrap().push(t);
        size += b;
    }
    let total: u64 = all.iter().map(|t| 2 * t.numel() as u64).sum();
    let staging = StagingDir::create(&a.output, a.overwrite)?;
    let bar = progress::bytes(total, "synth");
    let mut weight_map = BTreeMap::new();
    let n = shards.len();
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let mut buffers: Vec<Vec<u8>> = Vec::with_capacity(shard.len());
        for t in shard {
            let mut buf = vec![0u8; 2 * t.numel()];
            fill_tensor_16(t, a.seed, sdtype, &mut buf);
            bar.inc(buf.len() as u64);
            buffers.push(buf);
            weight_map.insert(t.name.clone(), name.clone());
        }
        let views: Vec<TensorView> = shard
            .iter()
            .zip(&buffers)
            .map(|(t, b)| TensorView {
                name: &t.name,
                dtype,
                shape: &t.shape,
                bytes: b,
            })
            .collect();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        write_safetensors(&staging.path().join(&name), &views, Some(&meta))?;
    }
    bar.finish_and_clear();
    let write = |name: &str, text: String| {
        let p = staging.path().join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("config.json", hf_config_json(&config, torch))?;
    write(
        "generation_config.json",
        serde_json::to_string_pretty(&serde_json::json!({
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_ids.first(),
            "do_sample": false,
        }))?,
    )?;
    if n > 1 {
        write(
            INDEX_FILE,
            serde_json::to_string_pretty(&serde_json::json!({
                "metadata": { "total_size": total },
                "weight_map": weight_map,
            }))?,
        )?;
    }
    staging.commit()?;
    eprintln!(
        "wrote {} ({} tensors, {:.2} GB, {} shard{}) to {}",
        a.shape,
        all.len(),
        total as f64 / 1e9,
        n,
        if n == 1 { "" } else { "s" },
        a.output.display()
    );
    Ok(())
}
