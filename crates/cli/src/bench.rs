//! `entrollm bench`: the decode benchmark of DESIGN.md on the GPU engine. A random prompt of
//! `--prompt-len` tokens, then exactly G = 64 and G = 128 greedy tokens (EOS ignored, decode steps
//! replayed from a CUDA graph), one warm-up then the median of 3 runs each; steady-state
//! tok/s = 64 / (t128 − t64). Also: achieved weight bandwidth, prefill throughput, GPU memory.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use entrollm_cuda::{GpuDevice, GpuEngine, GpuModel};
use entrollm_model::load::open_model;
use entrollm_model::synth::SynthShape;

/// HBM read bandwidth of the H200 measured with a sum kernel (DESIGN.md), the share's denominator.
const H200_HBM_GBPS: f64 = 4330.0;

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    model: Option<PathBuf>,
    /// Instead of a model: build this synthetic shape directly in GPU memory (no disk).
    #[arg(long, value_parser = SynthShape::names().to_vec())]
    synth: Option<String>,
    /// Seed of the synthetic weights and of the random prompt.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens of the random prompt.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Also time a prefill of this many random tokens (0: only the prompt's).
    #[arg(long, default_value_t = 0)]
    prefill_len: usize,
    /// Timed runs per measurement (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = entrollm_cuda::selftest::Rng::new(seed ^ 0x9A0B);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

pub fn run(a: Args) -> Result<()> {
    if a.repeats == 0 || a.prompt_len == 0 {
        bail!("--repeats and --prompt-len must be at least 1");
    }
    let dev = Arc::new(GpuDevice::open(0).context("bench needs a CUDA GPU")?);
    let t_load = Instant::now();
    let (model, source) = match (&a.synth, &a.model) {
        (Some(name), None) => {
            let shape = SynthShape::parse(name).expect("clap checked the name");
            let c = shape.config();
            (
                GpuModel::synth(&dev, &c, a.seed)?,
                format!("synthetic {name} (seed {}, built on the GPU)", a.seed),
            )
        }
        (None, Some(path)) => {
            let (w, _) = open_model(path, false)?;
            (GpuModel::upload(&dev, &w)?, path.display().to_string())
        }
        _ => bail!("give either a MODEL path or --synth SHAPE"),
    };
    dev.synchronize()?;
    let load_s = t_load.elapsed().as_secs_f64();
    let c = model.config.clone();
    let max_seq = (a.prompt_len + 128)
        .max(a.prefill_len)
        .min(c.max_position_embeddings);
    if a.prompt_len + 128 > max_seq {
        bail!(
            "--prompt-len {} + 128 exceeds the model's context",
            a.prompt_len
        );
    }
    let bytes_per_token = model.bytes_per_token();
    let mut e = GpuEngine::new(Arc::clone(&dev), model, max_seq)?;
    let prompt = random_tokens(a.prompt_len, c.vocab_size, a.seed);

    // Warm-up (kernel loads, cuBLASLt plans), then the protocol.
    e.reset();
    let warm = e.generate_greedy(&prompt, 128)?;
    let (mut t64, mut t128, mut tpre) = (Vec::new(), Vec::new(), Vec::new());
    let mut consistent = true;
    for _ in 0..a.repeats {
        for (g, times) in [(64usize, &mut t64), (128, &mut t128)] {
            e.reset();
            let t = Instant::now();
            let toks = e.generate_greedy(&prompt, g)?;
            times.push(t.elapsed().as_secs_f64());
            consistent &= toks.len() == g && toks[..] == warm[..g];
        }
        e.reset();
        let t = Instant::now();
        e.prefill_greedy(&prompt)?;
        tpre.push(t.elapsed().as_secs_f64());
    }
    let (m64, m128, mpre) = (median(&mut t64), median(&mut t128), median(&mut tpre));
    let step_s = (m128 - m64) / 64.0;
    let tok_s = 1.0 / step_s;
    let gbps = bytes_per_token as f64 / step_s / 1e9;
    let long_prefill = if a.prefill_len > 0 {
        let toks = random_tokens(a.prefill_len, c.vocab_size, a.seed ^ 1);
        e.reset();
        e.prefill_greedy(&toks)?;
        let mut ts = Vec::new();
        for _ in 0..a.repeats {
            e.reset();
            let t = Instant::now();
            e.prefill_greedy(&toks)?;
            ts.push(t.elapsed().as_secs_f64());
        }
        Some(median(&mut ts))
    } else {
        None
    };
    let mem = e.memory();
    let (free, total) = dev
        .context()
        .mem_get_info()
        .map_err(|err| anyhow::anyhow!("cuMemGetInfo: {err}"))?;
    let info = dev.info();
    if a.json {
        let v = serde_json::json!({
            "device": info.name,
            "model": source,
            "load_s": load_s,
            "prompt_len": a.prompt_len,
            "repeats": a.repeats,
            "t64_s": m64,
            "t128_s": m128,
            "decode_tok_s": tok_s,
            "decode_ms_per_token": step_s * 1e3,
            "weight_bytes_per_token": bytes_per_token,
            "achieved_gb_s": gbps,
            "hbm_share": gbps / H200_HBM_GBPS,
            "prompt_prefill_s": mpre,
            "prompt_prefill_tok_s": a.prompt_len as f64 / mpre,
            "prefill_len": a.prefill_len,
            "prefill_s": long_prefill,
            "prefill_tok_s": long_prefill.map(|t| a.prefill_len as f64 / t),
            "memory": {
                "weights": mem.weights,
                "kv_cache": mem.kv_cache,
                "workspace": mem.workspace,
                "device_used": total - free,
                "device_total": total,
            },
            "decode_step": e.decode_layout(),
            "tokens_consistent": consistent,
            "first_tokens": &warm[..8.min(warm.len())],
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let gb = |b: usize| b as f64 / 1e9;
        println!("device      {} ({} SMs)", info.name, info.sm_count);
        println!("model       {source}, loaded in {load_s:.2} s");
        println!(
            "decode      {tok_s:.1} tok/s ({:.3} ms/token; G=64 {:.1} ms, G=128 {:.1} ms; median of {}, {}-token prompt)",
            step_s * 1e3,
            m64 * 1e3,
            m128 * 1e3,
            a.repeats,
            a.prompt_len
        );
        println!(
            "step        one CUDA graph per token ({})",
            e.decode_layout()
        );
        println!(
            "bandwidth   {gbps:.0} GB/s of weights ({:.2} GB/token), {:.1} % of the H200's {H200_HBM_GBPS:.0} GB/s",
            gb(bytes_per_token),
            100.0 * gbps / H200_HBM_GBPS
        );
        println!(
            "prefill     {:.0} tok/s for the {}-token prompt ({:.1} ms)",
            a.prompt_len as f64 / mpre,
            a.prompt_len,
            mpre * 1e3
        );
        if let Some(t) = long_prefill {
            println!(
                "prefill     {:.0} tok/s for {} tokens ({:.1} ms)",
                a.prefill_len as f64 / t,
                a.prefill_len,
                t * 1e3
            );
        }
        println!(
            "memory      weights {:.3} GB + KV cache {:.3} GB ({max_seq} tokens) + workspace {:.3} GB; device in use {:.3} GB of {:.1} GB",
            gb(mem.weights),
            gb(mem.kv_cache),
            gb(mem.workspace),
            gb(total - free),
            gb(total)
        );
        println!(
            "check       G=64 and G=128 runs {} the warm-up's tokens; first tokens {:?}",
            if consistent { "repeat" } else { "DIFFER FROM" },
            &warm[..8.min(warm.len())]
        );
    }
    if !consistent {
        bail!("greedy tokens differ between runs of the same prompt");
    }
    Ok(())
}
