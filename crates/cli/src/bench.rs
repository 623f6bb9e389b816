//! `entrollm bench`: the GPU decode benchmark (the protocol in docs/cli.md). A random prompt of
//! `--prompt-len` tokens, then exactly G = 64 and G = 128 greedy tokens (EOS ignored, decode steps
//! replayed from a CUDA graph), one warm-up then the median of 3 runs each; steady-state
//! tok/s = 64 / (t128 − t64). Also: achieved weight bandwidth, prefill throughput, GPU memory.
//!
//! `--synth SHAPE` builds the synthetic model on the host with layer 0's weights in every layer
//! (`model::synth::shared_layer_weights`; the GPU builder copies layer 0's launches into every
//! layer, so each layer owns its arrays). `--coded` codes its layer and head matrices at load
//! (dtANS-LLM, lossless; the embedding stays dense) with the codings of `--coding` /
//! `--coding-file` (default: the tuned table), `MODEL --code-at-load CODING` a checkpoint's BF16
//! matrices. `--budget`/`--plan`/`--tune` choose every launch's form, for a MODEL or --synth.
//! `--context N` sizes the KV cache for N tokens; `--long-prefill N` then times decode after an
//! N-token prefill.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use entrollm_codec::dtans::Coding;
use entrollm_cuda::engine_coded::{check_load_plan, free_memory, tuned_plan, Encoder};
use entrollm_cuda::linear::{Fp8Serving, Serving};
use entrollm_cuda::{GpuDevice, GpuEngine};
use entrollm_model::coding_plan::CodingPlan;
use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::synth::{shared_layer_weights, SynthShape};
use entrollm_model::ModelConfig;

/// The share's denominator: a GPU's HBM read bandwidth (GB/s) and where the figure comes from,
/// by the name the driver reports; `None` for other GPUs (no share is claimed).
fn hbm_gbps(name: &str) -> Option<(f64, &'static str)> {
    if name.contains("H200") {
        Some((
            4330.0,
            "the H200's, measured with a sum kernel (bench/RESULTS.md)",
        ))
    } else if name.contains("H100") && name.contains("HBM3") {
        Some((3350.0, "the H100 SXM's nominal 3.35 TB/s"))
    } else {
        None
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    model: Option<PathBuf>,
    /// Instead of a model: this synthetic shape, layer 0's weights in every layer (no disk; host
    /// memory for one layer and the embeddings).
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
    /// Code the layer and head matrices at load (dtANS-LLM, lossless BF16) with --coding /
    /// --coding-file, and serve them coded.
    #[arg(long)]
    coded: bool,
    /// Coding of every coded matrix: `auto` (the coder chooses) or MODE:LOG2M:SC[:T]
    /// (default: the tuned table, `tuned::bf16_coding_for`).
    #[arg(long)]
    coding: Option<String>,
    /// Coding per launch (JSON: qkv, o, gate_up, down, lm_head, default); --coding (with --coded)
    /// or --code-at-load fills the rest.
    #[arg(long)]
    coding_file: Option<PathBuf>,
    /// With --coded: where the matrices are coded, `gpu` (the default) or `cpu` (the host
    /// encoder); the coded arrays are byte-identical, only the load time differs. Layers that
    /// share layer 0's weights (--synth) are coded once and copied on the device.
    #[arg(long, default_value = "gpu")]
    encode: Encoder,
    /// With a MODEL path: code its dense BF16 layer and head matrices on the GPU at load, `auto`
    /// or MODE:LOG2M:SC[:T] (--coding-file: per launch), and serve them coded.
    #[arg(long, value_name = "CODING")]
    code_at_load: Option<String>,
    /// KV-cache capacity in tokens (default: the prompt + 128, or --prefill-len / --long-prefill).
    #[arg(long)]
    context: Option<usize>,
    /// Also time decode after a prefill of this many random tokens (64 steps; 0: skip).
    #[arg(long, default_value_t = 0)]
    long_prefill: usize,
    /// With an FP8 MODEL: how its matrices are kept, `auto`, `dense` or `palette` (see `run
    /// --help`).
    #[arg(long, default_value = "auto", value_parser = crate::generate::parse_fp8)]
    fp8: Fp8Serving,
    /// How BF16 matrices are kept, `dense` or `palette` (packed losslessly, 12 bits a weight; see
    /// `run --help`). Not with --code-at-load or --coded.
    #[arg(
        long,
        default_value = "dense",
        value_parser = crate::generate::parse_bf16,
        action = clap::ArgAction::Set
    )]
    bf16: bool,
    #[command(flatten)]
    decode: crate::generate::DecodeArgs,
    /// GGUF: `f32` or `q8` activations for the quantised matrices (as for `run`).
    #[arg(
        long = "activations",
        value_name = "f32|q8",
        default_value = "f32",
        value_parser = crate::generate::parse_activations,
        action = clap::ArgAction::Set
    )]
    q8_activations: bool,
    /// The forms of the launches chosen to fit a memory budget (see `run --help`); not with
    /// --code-at-load, --coded or --bf16 palette.
    #[command(flatten)]
    budget: crate::budget::BudgetArgs,
    /// Where to run: `cuda` (the GPU) or `cpu` (the CPU engine; a MODEL path, opened, planned and
    /// served as `run` serves it).
    #[arg(long, default_value = "cuda", value_parser = ["cuda", "cpu"])]
    device: String,
    /// Diagnostics: build every kernel with a trace in `pdl_wait` and write three decode steps'
    /// records to FILE as CSV (default: the environment's `ENTROLLM_TRACE`). The traced build's
    /// timings are not the engine's.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

/// The coding plan of `--coding` / `--coding-file` (neither: the tuned table for `c`).
fn coding_plan(a: &Args, c: &ModelConfig) -> Result<CodingPlan> {
    let default = match &a.coding {
        Some(s) => Coding::parse(s).map_err(|e| anyhow!("--coding: {e}"))?,
        None => None,
    };
    Ok(match (&a.coding_file, &a.coding) {
        (Some(f), _) => CodingPlan::from_file(f, default)?,
        (None, Some(_)) => CodingPlan::uniform(default),
        (None, None) => tuned_plan(c),
    })
}

/// The model path tune and plan files name a synthetic model by.
pub fn synth_id(name: &str, seed: u64) -> String {
    format!("synth:{name}:seed{seed}")
}

/// Bytes of the BF16 KV cache for `tokens` positions.
fn kv_bytes(c: &ModelConfig, tokens: usize) -> usize {
    2 * c.num_layers * tokens * c.kv_dim() * 2
}

/// Diagnostic builds (`--trace FILE`): three decode steps after 64 generated tokens, each
/// replayed alone with its kernels' pdl_wait records (common.cuh) written to `path` as CSV.
fn write_trace(e: &mut GpuEngine, dev: &GpuDevice, prompt: &[u32], path: &Path) -> Result<()> {
    e.reset();
    let toks = e.generate_greedy(prompt, 64)?;
    let mut tok = *toks.last().context("no token generated")?;
    let mut csv = String::from("step,arrived_ns,released_ns,sm,bx,by,gx,gy,threads\n");
    for step in 0..3 {
        dev.trace_reset()?;
        tok = e.step_greedy(tok)?;
        for r in dev.trace_records()? {
            csv += &format!(
                "{step},{},{},{},{},{},{},{},{}\n",
                r.arrived_ns,
                r.released_ns,
                r.sm,
                r.block.0,
                r.block.1,
                r.grid.0,
                r.grid.1,
                r.threads
            );
        }
    }
    std::fs::write(path, csv)
        .with_context(|| format!("writing the trace to {}", path.display()))?;
    eprintln!("bench: decode-step trace written to {}", path.display());
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = entrollm_codec::rng::SplitMix64::new(seed ^ 0x9A0B);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

pub fn run(a: Args) -> Result<()> {
    if let Some(m) = &a.model {
        a.budget.check_serving(m)?;
    }
    if a.device == "cpu" {
        return run_cpu(&a);
    }
    if a.repeats == 0 || a.prompt_len == 0 {
        bail!("--repeats and --prompt-len must be at least 1");
    }
    if a.coding.is_some() && !a.coded {
        bail!("--coding needs --coded");
    }
    if a.coding_file.is_some() && !a.coded && a.code_at_load.is_none() {
        bail!("--coding-file needs --coded or --code-at-load");
    }
    if a.code_at_load.is_some() && a.coded {
        bail!("--coded codes with --coding/--coding-file; --code-at-load with its own CODING");
    }
    if a.coded && a.bf16 {
        bail!("--coded codes the BF16 matrices; --bf16 palette packs them: choose one");
    }
    if a.budget.is_set() && (a.code_at_load.is_some() || a.coded || a.bf16) {
        bail!(
            "--budget/--plan/--tune choose every launch's form: not with --code-at-load, --coded \
             or --bf16 palette"
        );
    }
    crate::generate::check_bf16_palette(a.bf16, a.code_at_load.is_some())?;
    // A bad coding fails before any work.
    let code = a
        .code_at_load
        .as_deref()
        .map(|c| crate::generate::load_plan(c, a.coding_file.as_deref()))
        .transpose()?;
    let decode = a.decode.options()?;
    let trace = a.trace.clone().or_else(|| {
        std::env::var_os("ENTROLLM_TRACE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let dev = match &trace {
        Some(_) => GpuDevice::open_traced(0),
        None => GpuDevice::open(0),
    };
    let dev = Arc::new(dev.context("bench needs a CUDA GPU")?);
    let t_load = Instant::now();
    let by_hand = crate::generate::ByHand {
        forms: a.code_at_load.is_some() || a.coded || a.bf16 || a.fp8 == Fp8Serving::Palette,
        ..Default::default()
    };
    let mut opening = match &a.model {
        Some(m) => crate::generate::opening(m, &a.budget, by_hand, true),
        // A synthetic model is held dense BF16, as a checkpoint of it is stored.
        None => crate::generate::Opening {
            plan: a.budget.is_set() || !by_hand.forms,
            load: LoadOptions::default(),
        },
    };
    opening.load.q8_activations = a.q8_activations;
    // The host model: a checkpoint, or the synthetic shape with layer 0's weights in every layer
    // (the builder copies layer 0's launches on the device).
    let (w, path, mut source) = match (&a.synth, &a.model) {
        (Some(name), None) => {
            let shape = SynthShape::parse(name).expect("clap checked the name");
            let w = shared_layer_weights(&shape.config(), a.seed)?;
            let id = synth_id(name, a.seed);
            let what = format!("synthetic {name} (seed {}, layer 0 in every layer)", a.seed);
            (w, PathBuf::from(id), what)
        }
        (None, Some(path)) => {
            // Opened as `run` opens it (checksums verified at load).
            let w = open_weights_with(path, opening.load)?;
            (w, path.clone(), path.display().to_string())
        }
        _ => bail!("give either a MODEL path or --synth SHAPE"),
    };
    let code = match (code, a.coded) {
        (Some(p), _) => Some((p, Encoder::Gpu)),
        (None, true) => Some((coding_plan(&a, &w.config)?, a.encode)),
        (None, false) => None,
    };
    if let Some((plan, _)) = &code {
        check_load_plan(&w.config, plan)?;
    }
    let ctx = a.context.unwrap_or(
        (a.prompt_len + 128)
            .max(a.prefill_len)
            .max(a.long_prefill + 64),
    );
    let (w, launches) = crate::generate::planned(
        &a.budget,
        opening.plan,
        w,
        &path,
        crate::generate::DeviceArg::Cuda,
        ctx,
    )?;
    let serving = crate::generate::serving_under(
        launches,
        Serving {
            fp8: a.fp8,
            bf16_palette: a.bf16,
            ..Serving::default()
        },
    )?;
    let code_ref = code.as_ref().map(|(p, e)| (p, *e));
    let (model, r) = crate::generate::upload_gpu(&dev, &w, code_ref, serving)?;
    drop(w);
    let s = model.coded_summary();
    source += &match r {
        Some(r) => format!(
            " (launches taken by form {} on the {} (host plan {:.2} s, upload {:.2} s, encode \
             {:.2} s))",
            r.summary(),
            match code.as_ref().map(|c| c.1) {
                Some(Encoder::Cpu) => "host",
                _ => "GPU",
            },
            r.plan_s,
            r.upload_s,
            r.encode_s,
        ),
        None => format!(" ({} coded layer/head matrices served coded)", s.matrices),
    };
    dev.synchronize()?;
    let load_s = t_load.elapsed().as_secs_f64();
    let c = model.config.clone();
    let need_seq = (a.prompt_len + 128)
        .max(a.prefill_len)
        .max(a.long_prefill + 64);
    let max_seq = match a.context {
        Some(n) if n < need_seq => bail!(
            "--context {n} is shorter than the runs need ({need_seq} tokens: prompt + 128, \
             --prefill-len, --long-prefill + 64)"
        ),
        Some(n) if n > c.max_position_embeddings => bail!(
            "--context {n} exceeds the model's {} positions",
            c.max_position_embeddings
        ),
        Some(n) => n,
        None => need_seq.min(c.max_position_embeddings),
    };
    if need_seq > max_seq {
        bail!("the runs need {need_seq} positions, the model has {max_seq}");
    }
    let (free, _) = free_memory(&dev)?;
    let kv = kv_bytes(&c, max_seq);
    if kv > free {
        bail!(
            "not enough GPU memory for the KV cache: {max_seq} tokens need {:.3} GB, {:.3} GB \
             are free after the weights ({:.3} GB)",
            kv as f64 / 1e9,
            free as f64 / 1e9,
            model.weight_bytes() as f64 / 1e9
        );
    }
    let bytes_per_token = model.bytes_per_token();
    let coded = model.coded_summary();
    let (by_form, lm_head_form) = (model.matrices_by_form(), model.lm_head_form());
    let mut e = GpuEngine::with_options(Arc::clone(&dev), model, max_seq, decode)
        .with_context(|| format!("building the engine for {max_seq} tokens"))?;
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
    if let Some(path) = &trace {
        write_trace(&mut e, &dev, &prompt, path)?;
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
    let long = if a.long_prefill > 0 {
        // The main figures first (stderr), in case the long prefill is cut short.
        let m = e.memory();
        eprintln!(
            "bench: decode {tok_s:.2} tok/s ({:.3} ms/token) at a {}-token prompt; memory: \
             weights {} + KV cache {} ({max_seq} tokens) + workspace {} bytes; coded {:.4} \
             bits/weight; prefilling {} tokens next",
            step_s * 1e3,
            a.prompt_len,
            m.weights,
            m.kv_cache,
            m.workspace,
            coded.bits_per_weight(),
            a.long_prefill
        );
        let toks = random_tokens(a.long_prefill, c.vocab_size, a.seed ^ 2);
        e.reset();
        let t = Instant::now();
        let mut tok = e.prefill_greedy(&toks)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..64 {
            tok = e.step_greedy(tok)?;
        }
        let step = t.elapsed().as_secs_f64() / 64.0;
        Some((prefill_s, step))
    } else {
        None
    };
    let coded_error = e.model().coded_error(&dev)?;
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
            "hbm_share": hbm_gbps(&info.name).map(|(peak, _)| gbps / peak),
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
                "max_seq": max_seq,
            },
            "coded": {
                "matrices": coded.matrices,
                "weights": coded.weights,
                "bytes": coded.bytes,
                "bits_per_weight": coded.bits_per_weight(),
                "dense_matrices": coded.dense_matrices,
                "dense_weights": coded.dense_weights,
                "dense_bytes": coded.dense_bytes,
                "stream_errors": coded_error,
            },
            "matrices_by_form": by_form,
            "lm_head_form": lm_head_form,
            "long_prefill": a.long_prefill,
            "long_prefill_s": long.map(|l| l.0),
            "long_decode_tok_s": long.map(|l| 1.0 / l.1),
            "long_decode_ms_per_token": long.map(|l| l.1 * 1e3),
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
        let share = match hbm_gbps(&info.name) {
            Some((peak, of)) => format!(", {:.1} % of {of}", 100.0 * gbps / peak),
            None => String::new(),
        };
        println!(
            "bandwidth   {gbps:.0} GB/s of weights ({:.2} GB/token){share}",
            gb(bytes_per_token),
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
        if coded.matrices > 0 {
            println!(
                "coded       {} matrices, {:.3} G weights in {:.3} GB: {:.4} bits/weight (dtANS-LLM, lossless); {} dense matrices ({:.3} G weights in {:.3} GB){}",
                coded.matrices,
                coded.weights as f64 / 1e9,
                gb(coded.bytes),
                coded.bits_per_weight(),
                coded.dense_matrices,
                coded.dense_weights as f64 / 1e9,
                gb(coded.dense_bytes),
                if coded_error { "; STREAM ERRORS FLAGGED" } else { "" }
            );
        }
        if let Some((p, step)) = long {
            println!(
                "long        {} tokens prefilled in {:.2} s, then decode {:.1} tok/s ({:.3} ms/token, 64 steps)",
                a.long_prefill,
                p,
                1.0 / step,
                step * 1e3
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
    if coded_error {
        bail!("a coded kernel flagged an inconsistent stream");
    }
    Ok(())
}

/// Peak resident memory of this process, bytes (Linux `VmHWM`).
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = s.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    Some(
        kb.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?
            * 1024,
    )
}

/// Greedy tokens after `prompt` on the CPU engine: `g` of them, EOS ignored.
fn cpu_greedy(e: &mut entrollm_model::Engine, prompt: &[u32], g: usize) -> Result<Vec<u32>> {
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    e.reset();
    let mut logits = e.prefill(prompt)?;
    let mut out = Vec::with_capacity(g);
    for _ in 0..g {
        let t = argmax(&logits);
        out.push(t);
        if out.len() < g {
            logits = e.step(t)?;
        }
    }
    Ok(out)
}

/// `bench --device cpu MODEL`: the model opened, planned and served as `run` serves it, then the
/// decode protocol on the CPU engine (random prompt, G = 64 and 128 greedy tokens, one warm-up,
/// median of `--repeats`; tok/s = 64 / (t128 − t64)).
fn run_cpu(a: &Args) -> Result<()> {
    if a.coded || a.code_at_load.is_some() || a.bf16 || a.trace.is_some() || a.long_prefill > 0 {
        bail!(
            "bench --device cpu serves a model as `run` does: --coded, --code-at-load, --bf16, \
             --trace and --long-prefill are the GPU's"
        );
    }
    let Some(path) = &a.model else {
        bail!(
            "bench --device cpu needs a MODEL path (write a synthetic one with `entrollm synth`)"
        );
    };
    if a.repeats == 0 || a.prompt_len == 0 {
        bail!("--repeats and --prompt-len must be at least 1");
    }
    let t_load = Instant::now();
    let mut opening =
        crate::generate::opening(path, &a.budget, crate::generate::ByHand::default(), false);
    opening.load.q8_activations = a.q8_activations;
    let w = open_weights_with(path, opening.load)?;
    let need = a.prompt_len + 128;
    let ctx = a.context.unwrap_or(need);
    if ctx < need {
        bail!("--context {ctx} is shorter than the runs need ({need} tokens: prompt + 128)");
    }
    let (w, _) = crate::generate::planned(
        &a.budget,
        opening.plan,
        w,
        path,
        crate::generate::DeviceArg::Cpu,
        ctx,
    )?;
    let vocab = w.config.vocab_size;
    let mut e = entrollm_model::Engine::new(w, ctx)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let weights = e.weights().stored_bytes();
    let prompt = random_tokens(a.prompt_len, vocab, a.seed);
    let warm = cpu_greedy(&mut e, &prompt, 128)?;
    let (mut t64, mut t128, mut tpre) = (Vec::new(), Vec::new(), Vec::new());
    let mut consistent = true;
    for _ in 0..a.repeats {
        for (g, times) in [(64usize, &mut t64), (128, &mut t128)] {
            let t = Instant::now();
            let toks = cpu_greedy(&mut e, &prompt, g)?;
            times.push(t.elapsed().as_secs_f64());
            consistent &= toks[..] == warm[..g];
        }
        e.reset();
        let t = Instant::now();
        e.prefill(&prompt)?;
        tpre.push(t.elapsed().as_secs_f64());
    }
    let (m64, m128, mpre) = (median(&mut t64), median(&mut t128), median(&mut tpre));
    let step_s = (m128 - m64) / 64.0;
    let tok_s = 1.0 / step_s;
    let rss = peak_rss();
    let threads = rayon::current_num_threads();
    if a.json {
        let v = serde_json::json!({
            "device": format!("cpu ({threads} threads)"),
            "model": path.display().to_string(),
            "load_s": load_s,
            "prompt_len": a.prompt_len,
            "repeats": a.repeats,
            "t64_s": m64,
            "t128_s": m128,
            "decode_tok_s": tok_s,
            "decode_ms_per_token": step_s * 1e3,
            "prompt_prefill_tok_s": a.prompt_len as f64 / mpre,
            "memory": { "weights": weights, "peak_rss": rss, "max_seq": ctx },
            "tokens_consistent": consistent,
            "first_tokens": &warm[..8],
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("device      cpu, {threads} threads");
        println!("model       {}, loaded in {load_s:.2} s", path.display());
        println!(
            "decode      {tok_s:.2} tok/s ({:.2} ms/token; G=64 {:.1} ms, G=128 {:.1} ms; median \
             of {}, {}-token prompt)",
            step_s * 1e3,
            m64 * 1e3,
            m128 * 1e3,
            a.repeats,
            a.prompt_len
        );
        println!(
            "prefill     {:.1} tok/s for the {}-token prompt",
            a.prompt_len as f64 / mpre,
            a.prompt_len
        );
        println!(
            "memory      weights {:.1} MB; peak resident {}",
            weights as f64 / 1e6,
            rss.map_or("unknown".into(), |b| format!("{:.1} MB", b as f64 / 1e6))
        );
        println!(
            "check       G=64 and G=128 runs {} the warm-up's tokens; first tokens {:?}",
            if consistent { "repeat" } else { "DIFFER FROM" },
            &warm[..8]
        );
    }
    if !consistent {
        bail!("greedy tokens differ between runs of the same prompt");
    }
    Ok(())
}
