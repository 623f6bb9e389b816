//! `entrollm synth`: a synthetic HF-style checkpoint (see `entrollm_model::synth` for the weight
//! distribution).

use crate::progress;
use anyhow::{anyhow, bail, Context, Result};
use entrollm_format::safetensors::{write_safetensors, INDEX_FILE};
use entrollm_format::{Dtype, StagingDir, TensorView};
use entrollm_model::synth::{
    fill_tensor_16, fill_tensor_fp8, fit_fp8_multiplier, hf_config_json, is_fp8_linear, tensors,
    SynthDtype, SynthShape, SynthTensor,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model shape: tiny, llama-3.2-1b, llama-3.1-8b or llama-3.3-70b.
    #[arg(long)]
    shape: String,
    /// Storage dtype: bf16, fp16, or fp8-e4m3 (decoder linears as FP8 E4M3 with per-row F32
    /// `weight_scale`, compressed-tensors style; embeddings, LM head and norms in BF16).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// fp8-e4m3 only: the entropy of each matrix's codes, in bits (e.g. 2.1 for an EntQuant-like
    /// low-entropy checkpoint). Default: plain amax scaling (about 6 bits).
    #[arg(long)]
    entropy: Option<f64>,
    /// Seed: the same seed always gives the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (must not exist or be empty, unless --overwrite).
    #[arg(short, long)]
    output: PathBuf,
    /// Replace what the output directory holds.
    #[arg(long)]
    overwrite: bool,
    /// Largest shard, in bytes (Hugging Face's default is 5 GB).
    #[arg(long, default_value_t = 5_000_000_000)]
    shard_size: u64,
}

/// How the checkpoint stores its matrices.
#[derive(Clone, Copy)]
enum Storage {
    Half(Dtype, SynthDtype),
    /// FP8 linears at this target code entropy (None: amax scaling); other tensors BF16.
    Fp8(Option<f64>),
}

/// The stored tensors of one synthetic tensor: itself, and for FP8 its row scales.
fn stored_bytes(t: &SynthTensor, storage: Storage) -> u64 {
    match storage {
        Storage::Fp8(_) if is_fp8_linear(t) => (t.numel() + 4 * t.shape[0]) as u64,
        _ => 2 * t.numel() as u64,
    }
}

/// Generates `t`: (name, dtype, shape, bytes) of each stored tensor.
fn generate(
    t: &SynthTensor,
    seed: u64,
    storage: Storage,
) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    match storage {
        Storage::Fp8(entropy) if is_fp8_linear(t) => {
            let multiplier = entropy.map_or(1.0, |bits| fit_fp8_multiplier(t, seed, bits));
            let rows = t.shape[0];
            let mut codes = vec![0u8; t.numel()];
            let mut scales = vec![0f32; rows];
            fill_tensor_fp8(t, seed, multiplier, &mut codes, &mut scales);
            let scales = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            vec![
                (t.name.clone(), Dtype::F8E4M3, t.shape.clone(), codes),
                (
                    format!("{}_scale", t.name),
                    Dtype::F32,
                    vec![rows, 1],
                    scales,
                ),
            ]
        }
        _ => {
            let (dtype, sdtype) = match storage {
                Storage::Half(d, s) => (d, s),
                Storage::Fp8(_) => (Dtype::BF16, SynthDtype::Bf16),
            };
            let mut buf = vec![0u8; 2 * t.numel()];
            fill_tensor_16(t, seed, sdtype, &mut buf);
            vec![(t.name.clone(), dtype, t.shape.clone(), buf)]
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let shape = SynthShape::parse(&a.shape).ok_or_else(|| {
        anyhow!(
            "unknown shape '{}': use one of {}",
            a.shape,
            SynthShape::names().join(", ")
        )
    })?;
    let (storage, torch) = match a.dtype.as_str() {
        "bf16" => (Storage::Half(Dtype::BF16, SynthDtype::Bf16), "bfloat16"),
        "fp16" => (Storage::Half(Dtype::F16, SynthDtype::F16), "float16"),
        "fp8-e4m3" => (Storage::Fp8(a.entropy), "bfloat16"),
        d => bail!("unknown dtype '{d}': use bf16, fp16 or fp8-e4m3"),
    };
    match (a.entropy, storage) {
        (Some(_), Storage::Half(..)) => bail!("--entropy applies to --dtype fp8-e4m3 only"),
        (Some(b), _) if !(0.5..=7.5).contains(&b) => {
            bail!("--entropy {b}: FP8 codes can carry between 0.5 and 7.5 bits")
        }
        _ => {}
    }
    let config = shape.config();
    let all = tensors(&config);
    // Shards in checkpoint order, each at most `shard_size` bytes (a larger tensor gets its own).
    let mut shards: Vec<Vec<&SynthTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in &all {
        let b = stored_bytes(t, storage);
        if size + b > a.shard_size && !shards.last().unwrap().is_empty() {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().unwrap().push(t);
        size += b;
    }
    let total: u64 = all.iter().map(|t| stored_bytes(t, storage)).sum();
    let staging =
        StagingDir::create(&a.output, a.overwrite).map_err(crate::compress::name_overwrite)?;
    let bar = progress::bytes(total, "synth");
    let mut weight_map = BTreeMap::new();
    let n = shards.len();
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let mut stored = Vec::new();
        for t in shard {
            for s in generate(t, a.seed, storage) {
                bar.inc(s.3.len() as u64);
                weight_map.insert(s.0.clone(), name.clone());
                stored.push(s);
            }
        }
        let views: Vec<TensorView> = stored
            .iter()
            .map(|(n, dtype, shape, bytes)| TensorView {
                name: n,
                dtype: *dtype,
                shape,
                bytes,
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
    let mut cfg: serde_json::Value = serde_json::from_str(&hf_config_json(&config, torch))?;
    if let Storage::Fp8(entropy) = storage {
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": { "group_0": {
                "targets": ["Linear"],
                "weights": { "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true },
            }},
            "ignore": ["lm_head"],
        });
        cfg["entrollm_fp8_code_entropy"] = serde_json::json!(entropy);
    }
    write("config.json", serde_json::to_string_pretty(&cfg)?)?;
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
        weight_map.len(),
        total as f64 / 1e9,
        n,
        if n == 1 { "" } else { "s" },
        a.output.display()
    );
    Ok(())
}
