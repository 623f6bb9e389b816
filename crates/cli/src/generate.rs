//! `entrollm run`, `entrollm chat` and `entrollm eval ppl`: text generation and scoring on the GPU
//! engine (`--device cuda`) or the CPU reference engine (`--device cpu`); `auto` takes the GPU when
//! one is usable and says on stderr why not otherwise.

use crate::budget::BudgetArgs;
use crate::progress;
use anyhow::Result;
use entrollm_codec::dtans::Coding;
use entrollm_cuda::engine_coded::{Encoder, LoadReport};
use entrollm_cuda::linear::{Fp8Serving, LaunchChoices, Serving};
use entrollm_cuda::{DecodeOptions, GpuDevice, GpuEngine, GpuModel};
use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::coding_plan::CodingPlan;
use entrollm_model::load::{open_model_with, LoadOptions};
use entrollm_model::sampler::{
    generate, GenerateOptions, Generation, Input, Sampler, SamplingParams, StopReason,
};
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::{Engine, ModelWeights};
use entrollm_tune::tuner::LaunchTimer;
use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// The GPU when one is usable, else the CPU (with one line on stderr saying why).
    Auto,
    Cpu,
    Cuda,
}

impl DeviceArg {
    /// Parses `--device` (a usage error is a clean failure with exit code 1, like other bad input).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceArg::Auto),
            "cpu" => Ok(DeviceArg::Cpu),
            "cuda" => Ok(DeviceArg::Cuda),
            _ => anyhow::bail!("--device {s}: expected auto, cpu or cuda"),
        }
    }
}

/// The engine a session runs on.
pub enum Backend {
    Cpu(Engine),
    Gpu(Box<GpuEngine>),
}

impl Backend {
    /// Builds the engine for `weights` on `device` with a context of `ctx` tokens; with `code`, the
    /// GPU codes the dense BF16 matrices at load with that plan; matrices are kept as `serving`
    /// says (see [`upload_gpu`]); the GPU decode step is put together as `decode` says.
    pub fn new(
        weights: ModelWeights,
        ctx: usize,
        device: DeviceArg,
        code: Option<&CodingPlan>,
        serving: Serving,
        decode: DecodeOptions,
    ) -> Result<Self> {
        if device != DeviceArg::Cpu {
            let gpu = GpuDevice::open(0)
                .map_err(anyhow::Error::from)
                .and_then(|dev| {
                    let dev = Arc::new(dev);
                    let code = code.map(|p| (p, Encoder::Gpu));
                    let (model, _) = upload_gpu(&dev, &weights, code, serving)?;
                    Ok(GpuEngine::with_options(dev, model, ctx, decode)?)
                });
            match gpu {
                Ok(e) => return Ok(Backend::Gpu(Box::new(e))),
                Err(e) if device == DeviceArg::Cuda => {
                    return Err(anyhow::anyhow!("--device cuda: {e:#}"))
                }
                Err(e) => eprintln!(
                    "note: running on the CPU{}: {e:#}",
                    if code.is_some() { " (uncoded)" } else { "" }
                ),
            }
        }
        Ok(Backend::Cpu(Engine::new(weights, ctx)?))
    }

    pub fn reset(&mut self) {
        match self {
            Backend::Cpu(e) => e.reset(),
            Backend::Gpu(e) => e.reset(),
        }
    }

    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(match self {
            Backend::Cpu(e) => e.prefill(tokens)?,
            Backend::Gpu(e) => e.prefill(tokens)?,
        })
    }

    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(match self {
            Backend::Cpu(e) => e.step(token)?,
            Backend::Gpu(e) => e.step(token)?,
        })
    }

    pub fn position(&self) -> usize {
        match self {
            Backend::Cpu(e) => e.position(),
            Backend::Gpu(e) => e.position(),
        }
    }

    pub fn max_seq_len(&self) -> usize {
        match self {
            Backend::Cpu(e) => e.max_seq_len(),
            Backend::Gpu(e) => e.max_seq_len(),
        }
    }
}

/// Forms a user chose by hand, which a model is then served in unplanned.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByHand {
    /// --code-at-load, --coded, --bf16 palette, --fp8 palette.
    pub forms: bool,
    pub keep_coded: bool,
    pub decode_at_load: bool,
}

/// How a model is opened to be served, the one rule of run, chat, serve, eval and bench: whether
/// it is planned, and how it is loaded.
pub struct Opening {
    pub plan: bool,
    pub load: LoadOptions,
}

/// The [`Opening`] of `model`: planned (by `--budget`/`--plan`/`--tune`, else by the default
/// rule) and loaded as stored, unless forms are chosen `by_hand` or the container records the
/// forms of a plan (served in them). Says on stderr what a container is served as.
pub fn opening(model: &Path, budget: &BudgetArgs, by_hand: ByHand, on_gpu: bool) -> Opening {
    let recorded = entrollm_model::load::container_records_forms(model);
    let hand = by_hand.forms || by_hand.keep_coded || by_hand.decode_at_load;
    let plan = budget.is_set() || !(hand || recorded);
    // As stored where a plan starts from them (coded matrices coded, GGUF blocks as blocks);
    // by hand: coded on the GPU and with --keep-coded, decoded with --decode-at-load.
    let fused = plan || by_hand.keep_coded || ((on_gpu || recorded) && !by_hand.decode_at_load);
    if recorded && !plan && !by_hand.decode_at_load {
        eprintln!(
            "container: served in the forms its plan recorded (--budget plans anew, \
             --decode-at-load decodes every matrix instead)"
        );
    }
    if model.join("entrollm.json").is_file() {
        lossy_note(model);
    }
    Opening {
        plan,
        load: LoadOptions {
            fused,
            // A plan made now starts from the container as stored (the source's forms).
            recorded_forms: !plan,
            verify: true,
            q8_activations: false,
        },
    }
}

/// The plan of `--code-at-load CODING` (`auto` or MODE:LOG2M:SC[:T]) and `--coding-file`
/// (per launch; CODING fills the launches it does not name).
pub fn load_plan(coding: &str, file: Option<&Path>) -> Result<CodingPlan> {
    let default = Coding::parse(coding).map_err(|e| anyhow::anyhow!("--code-at-load: {e}"))?;
    Ok(match file {
        Some(f) => CodingPlan::from_file(f, default)?,
        None => CodingPlan::uniform(default),
    })
}

/// Uploads `weights` to the GPU: dtANS-coded matrices (a container opened fused) are served coded;
/// with `code`, every other layer/head matrix that is BF16 is coded at load by its encoder and served
/// coded too (a progress bar follows the layers; one summary line on stderr: load time and memory,
/// coded against dense). An FP8 checkpoint's matrices stay FP8, kept as `serving.fp8` says, and
/// without `code` its BF16 LM head may be palette-packed losslessly (a line on stderr says how many
/// are palette-packed, and whether the head is); without `code`, `serving.bf16_palette` packs BF16
/// matrices losslessly (a line on stderr says how many).
pub fn upload_gpu(
    dev: &Arc<GpuDevice>,
    weights: &ModelWeights,
    code: Option<(&CodingPlan, Encoder)>,
    serving: Serving,
) -> Result<(GpuModel, Option<LoadReport>)> {
    // Which form serves how many layer/head launches.
    let report_forms = |m: &GpuModel| {
        let by = m.matrices_by_form();
        let list: Vec<String> = by.iter().map(|(f, n)| format!("{f} {n}")).collect();
        eprintln!(
            "forms: layer/head launches served {}{}; device weights {:.3} GB",
            list.join(", "),
            m.lm_head_form()
                .map_or(String::new(), |f| format!(" (the LM head {f})")),
            m.weight_bytes() as f64 / 1e9
        );
    };
    let Some((plan, encoder)) = code else {
        let configured = serving.launches.len();
        let model = GpuModel::upload_served(dev, weights, serving)?.0;
        report_forms(&model);
        if configured > 0 {
            eprintln!(
                "plan: {configured} launches in the launch configurations their tune file timed \
                 fastest"
            );
        }
        return Ok((model, None));
    };
    let t = Instant::now();
    let bar = progress::steps(weights.layers.len() as u64, "code at load");
    let (model, r) =
        GpuModel::upload_coded(dev, weights, plan, encoder, serving.fp8, &mut |done, _| {
            bar.set_position(done as u64)
        })?;
    report_forms(&model);
    bar.finish_and_clear();
    let s = model.coded_summary();
    let gb = |b: usize| b as f64 / 1e9;
    eprintln!(
        "code at load: launches taken by form {} in {:.2} s (host plan {:.2} s, upload {:.2} s, \
         GPU encode {:.2} s); coded matrices {:.3} GB for {:.3} GB BF16 ({:.3} bits/weight), \
         dense {:.3} GB (embedding{}); device weights {:.3} GB",
        r.summary(),
        t.elapsed().as_secs_f64(),
        r.plan_s,
        r.upload_s,
        r.encode_s,
        gb(s.bytes),
        gb(2 * s.weights),
        s.bits_per_weight(),
        gb(s.dense_bytes),
        if s.dense_matrices > 1 {
            " and others"
        } else {
            ""
        },
        gb(model.weight_bytes()),
    );
    for n in r.dense_notes.iter().take(4) {
        eprintln!("note: {n}");
    }
    if r.dense_notes.len() > 4 {
        eprintln!(
            "note: … and {} more dense launches",
            r.dense_notes.len() - 4
        );
    }
    Ok((model, Some(r)))
}

impl entrollm_model::Decoder for Backend {
    type Error = anyhow::Error;
    fn reset(&mut self) {
        Backend::reset(self)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Backend::prefill(self, tokens)
    }
    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        Backend::step(self, token)
    }
    fn position(&self) -> usize {
        Backend::position(self)
    }
    fn max_seq_len(&self) -> usize {
        Backend::max_seq_len(self)
    }
    /// The GPU takes the argmax on the device (no logits copy).
    fn greedy(&mut self, input: Input<'_>) -> Result<Option<u32>> {
        let Backend::Gpu(e) = self else {
            return Ok(None);
        };
        Ok(Some(match input {
            Input::Prefill(t) => e.prefill_greedy(t)?,
            Input::Step(t) => e.step_greedy(t)?,
        }))
    }
}

#[derive(clap::Args)]
pub struct ModelArgs {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    pub model: PathBuf,
    /// Most tokens to generate (per reply in `chat`; default 256; `serve`: a request's default,
    /// up to the context by default).
    #[arg(short = 'n', long, visible_alias = "n-predict")]
    pub max_tokens: Option<usize>,
    /// Sampling temperature (0: greedy, the default).
    #[arg(
        long,
        allow_negative_numbers = true,
        visible_alias = "temp",
        default_value_t = 0.0
    )]
    temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of tokens with this much probability (1: all).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the tokens at least this share as probable as the most probable one (0: all).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    min_p: f32,
    /// Divide the logits of tokens already in the sequence by this (1: off).
    #[arg(
        long,
        allow_negative_numbers = true,
        visible_alias = "repetition-penalty",
        default_value_t = 1.0
    )]
    repeat_penalty: f32,
    /// Seed of the sampler (the same seed and options give the same tokens).
    #[arg(short, long, default_value_t = 0)]
    seed: u64,
    /// Context length to allocate, in tokens (default: the model's, at most 4096).
    #[arg(short = 'c', long, visible_alias = "ctx-size")]
    context: Option<usize>,
    /// When the context fills up, keep its first token and its newer half and go on generating
    /// (llama.cpp's context shift); without it, generation stops there and says so.
    #[arg(long)]
    context_shift: bool,
    /// No timing summary on stderr after each reply.
    #[arg(short, long)]
    quiet: bool,
    /// Where to run: auto (the GPU if usable, else the CPU), cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Containers: decode the coded matrices once at load (the default on the CPU, where it is
    /// the faster form: bench/RESULTS.md), also on the GPU where they would not fit dense by the
    /// default's reckoning.
    #[arg(long)]
    decode_at_load: bool,
    /// Containers: keep the coded matrices coded in memory, decoded inside every product (the
    /// container's size in memory; on the CPU a fraction of the decoded speed; on the GPU the
    /// default where the dense form does not fit). Quantised GGUF files on the GPU: serve their
    /// blocks as stored (the file's size; slower than dense BF16, the default where it fits).
    #[arg(long, conflicts_with = "decode_at_load")]
    keep_coded: bool,
    /// GGUF: what the quantised matrices multiply: `f32` activations (exact: the products of
    /// the dequantised weights) or `q8`, activations quantised to 8 bits per 32 as llama.cpp does
    /// (integer dot products, faster; logits differ in the third or fourth digit). On the GPU,
    /// the decode products of Q4_K blocks (the others stay f32).
    #[arg(
        long = "activations",
        value_name = "f32|q8",
        default_value = "f32",
        value_parser = parse_activations,
        action = clap::ArgAction::Set
    )]
    pub q8_activations: bool,
    /// GPU: code the dense BF16 layer and head matrices at load (dtANS-LLM, lossless, on the GPU)
    /// and serve them with the fused decode-matvec: `auto` (the coder chooses per launch) or
    /// MODE:LOG2M:SC[:T].
    #[arg(long, value_name = "CODING")]
    code_at_load: Option<String>,
    /// With --code-at-load: codings per launch (JSON: qkv, o, gate_up, down, lm_head, default);
    /// --code-at-load's coding fills the launches it does not name.
    #[arg(long, value_name = "PLAN.json", requires = "code_at_load")]
    coding_file: Option<PathBuf>,
    /// GPU, FP8 checkpoints: how their matrices are kept, `auto` (palette-packed — 4-bit indices
    /// into 16 codes plus escapes, half the bytes — where that is at most 0.6 of the codes'
    /// bytes, as in low-entropy checkpoints), `dense` (as stored) or `palette` (wherever the
    /// columns are a multiple of 32).
    #[arg(long, default_value = "auto", value_parser = parse_fp8)]
    fp8: Fp8Serving,
    /// GPU, BF16 matrices: `dense` (as stored) or `palette` (packed losslessly: each value's high
    /// byte as a 4-bit index into 16, its low byte as stored, escapes listed — 12 bits a weight —
    /// wherever the columns are a multiple of 64 and that takes at most 0.8 of the bytes; the
    /// products decode it on the tensor cores). Not with --code-at-load.
    #[arg(long, default_value = "dense", value_parser = parse_bf16, action = clap::ArgAction::Set)]
    bf16: bool,
    #[command(flatten)]
    budget: BudgetArgs,
    #[command(flatten)]
    decode: DecodeArgs,
}

/// How the GPU decode step is put together: comparison runs (the defaults are the fastest
/// measured, bench/RESULTS.md). A flag not given falls back to its environment variable
/// (`ENTROLLM_DECODE_ATTN`, `_NORM`, `_ROPE`, `_PDL`, `_CHUNK`: the benchmark scripts set them).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct DecodeArgs {
    /// GPU decode: attention as `split` (partial + combine) or `fused` (one launch whose last
    /// block merges).
    #[arg(long, value_name = "split|fused")]
    decode_attention: Option<String>,
    /// GPU decode: RMSNorm `chained` through the GEMVs (each residual GEMV leaves the next norm's
    /// input, the next dense GEMV scales by it), `split` (a kernel of its own) or `fused`
    /// (recomputed inside each following GEMV).
    #[arg(long, value_name = "chained|split|fused")]
    decode_norm: Option<String>,
    /// GPU decode: RoPE and the KV-cache append `fused` into the dense q/k/v GEMV's epilogue or
    /// `split` (a kernel of their own).
    #[arg(long, value_name = "fused|split")]
    decode_rope: Option<String>,
    /// GPU decode: programmatic dependent launch `on`, `off` (plain graph edges) or `all` (into
    /// the dense FP8 GEMVs too).
    #[arg(long, value_name = "on|off|all")]
    decode_pdl: Option<String>,
    /// GPU decode: attention chunking, positions per block × warps (e.g. 64x8).
    #[arg(long, value_name = "POSITIONSxWARPS")]
    decode_chunk: Option<String>,
}

impl DecodeArgs {
    /// The options the flags (else the environment variables) give; a bad value names its flag
    /// or variable and the values it takes.
    pub fn options(&self) -> Result<DecodeOptions> {
        let mut o = DecodeOptions::default();
        for (knob, flag, var, value) in [
            (
                "attention",
                "--decode-attention",
                "ENTROLLM_DECODE_ATTN",
                &self.decode_attention,
            ),
            (
                "norm",
                "--decode-norm",
                "ENTROLLM_DECODE_NORM",
                &self.decode_norm,
            ),
            (
                "rope",
                "--decode-rope",
                "ENTROLLM_DECODE_ROPE",
                &self.decode_rope,
            ),
            (
                "pdl",
                "--decode-pdl",
                "ENTROLLM_DECODE_PDL",
                &self.decode_pdl,
            ),
            (
                "chunk",
                "--decode-chunk",
                "ENTROLLM_DECODE_CHUNK",
                &self.decode_chunk,
            ),
        ] {
            let (v, from) = match value {
                Some(v) => (v.clone(), flag),
                None => match std::env::var(var) {
                    Ok(v) if !v.is_empty() => (v, var),
                    _ => continue,
                },
            };
            o.set(knob, &v)
                .map_err(|e| anyhow::anyhow!("{from}: {e}"))?;
        }
        Ok(o)
    }
}

impl ModelArgs {
    /// How the GPU keeps the matrices (`--fp8`, `--bf16`).
    fn serving(&self) -> Serving {
        Serving {
            fp8: self.fp8,
            bf16_palette: self.bf16,
            ..Serving::default()
        }
    }
}

/// How the GPU keeps the matrices: as `asked` (`--fp8`, `--bf16`), or, under a plan (the default
/// rule's, `--budget`, `--plan`: `Some`), as the plan chose them on the host, in the plan's
/// `launches`; asking for palette packing beside a plan is an error (both choose forms).
pub fn serving_under(plan: Option<LaunchChoices>, asked: Serving) -> Result<Serving> {
    let Some(launches) = plan else {
        return Ok(asked);
    };
    if asked.bf16_palette || asked.fp8 == Fp8Serving::Palette {
        anyhow::bail!(
            "--budget/--plan choose each launch's form (palette forms included): leave out              --bf16 palette and --fp8 palette"
        );
    }
    Ok(Serving {
        launches,
        ..Serving::AS_HELD
    })
}

/// `--bf16 palette` and `--code-at-load` both say how BF16 matrices are kept: one at a time.
pub fn check_bf16_palette(bf16_palette: bool, code_at_load: bool) -> Result<()> {
    if bf16_palette && code_at_load {
        anyhow::bail!(
            "--bf16 palette and --code-at-load both choose how BF16 matrices are kept: use one"
        );
    }
    Ok(())
}

/// `--bf16 dense|palette`: whether BF16 matrices are palette-packed.
pub fn parse_bf16(s: &str) -> std::result::Result<bool, String> {
    match s {
        "dense" => Ok(false),
        "palette" => Ok(true),
        _ => Err(format!("`{s}`: expected dense or palette")),
    }
}

/// `--activations f32|q8`: whether the quantised matrices take 8-bit activations.
pub fn parse_activations(s: &str) -> std::result::Result<bool, String> {
    match s {
        "f32" => Ok(false),
        "q8" => Ok(true),
        _ => Err(format!("`{s}`: expected f32 or q8")),
    }
}

/// `--fp8 auto|dense|palette`.
pub fn parse_fp8(s: &str) -> std::result::Result<Fp8Serving, String> {
    s.parse()
}

/// Bytes the CPU engine takes beside its weights for a context of `ctx` tokens: the f32 KV cache
/// and the step's buffers (logits, activations).
pub fn cpu_reserved(c: &entrollm_model::ModelConfig, ctx: usize) -> u64 {
    let kv = 2 * c.num_layers * ctx * c.kv_dim() * 4;
    let buffers = 4 * (2 * c.vocab_size + 8 * (c.hidden_size + c.intermediate_size + c.q_dim()));
    (kv + buffers) as u64
}

/// `weights` (loaded as stored) in the forms of their plan — `--plan`, `--budget`, else the
/// default rule's: the fastest within what the source's weights take as stored, capped by free
/// memory — with the launch configurations the plan's latencies were measured in; the plan is
/// made for where the model will run. `plan` false: served as they are (forms chosen by hand, or
/// recorded by the container), no launch choices.
pub fn planned(
    b: &BudgetArgs,
    plan: bool,
    weights: ModelWeights,
    path: &Path,
    device: DeviceArg,
    ctx: usize,
) -> Result<(ModelWeights, Option<LaunchChoices>)> {
    if !plan {
        return Ok((weights, None));
    }
    let gpu = match device {
        DeviceArg::Cpu => None,
        _ => GpuDevice::open(0).ok(),
    };
    if device == DeviceArg::Cuda && gpu.is_none() {
        anyhow::bail!("--device cuda: no usable GPU to plan for");
    }
    let (kind, id, reserved) = match &gpu {
        None => (
            entrollm_tune::DeviceKind::Cpu,
            entrollm_tune::tuner::CpuTimer::new(rayon::current_num_threads()).device(),
            cpu_reserved(&weights.config, ctx),
        ),
        Some(dev) => (
            entrollm_tune::DeviceKind::Cuda,
            entrollm_cuda::tune::device_id(dev),
            entrollm_cuda::tune::reserved_bytes(&weights.config, ctx),
        ),
    };
    let free = || -> Result<u64> {
        match &gpu {
            None => crate::budget::free_ram(),
            Some(dev) => Ok(entrollm_cuda::engine_coded::free_memory(dev)?.0 as u64),
        }
    };
    let target = crate::budget::Target {
        kind,
        device: Some(&id),
        reserved,
    };
    let t0 = Instant::now();
    let plan = crate::budget::plan(b, &weights, path, &target, free)?;
    let planned_s = t0.elapsed().as_secs_f64();
    // Launches already in their planned forms are kept as they are (no re-forming).
    let held: std::collections::HashMap<String, _> =
        entrollm_model::forms::layout::launches(&weights)
            .into_iter()
            .map(|l| (l.id, l.matrices[0].form()))
            .collect();
    let reform = plan
        .choices
        .iter()
        .filter(|c| {
            held.get(&c.id)
                .is_none_or(|h| h.form != c.form || h.variant != c.variant)
        })
        .count();
    let t1 = Instant::now();
    let out = crate::budget::apply(&weights, &plan)?;
    eprintln!(
        "plan: made in {planned_s:.2} s; {reform} of {} launches re-formed in {:.2} s",
        plan.choices.len(),
        t1.elapsed().as_secs_f64()
    );
    let launches: LaunchChoices = plan
        .choices
        .iter()
        .filter_map(|c| Some((c.id.clone(), c.launch_config.clone()?)))
        .collect();
    Ok((out, Some(launches)))
}

#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (raw text; `chat` applies the model's chat template).
    #[arg(short, long)]
    prompt: String,
}

#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A system message to open the conversation (`-sys` as in llama.cpp).
    #[arg(long, visible_alias = "sys")]
    system: Option<String>,
}

pub struct Session {
    pub engine: Backend,
    pub tokenizer: Tokenizer,
    pub sampler: Sampler,
    max_tokens: usize,
    context_shift: bool,
    quiet: bool,
    /// Bytes the weights take where the engine holds them, and how many weights they are.
    pub weights: (usize, usize),
}

/// Weights in the model's matrices (a tied LM head counted once).
fn matrix_weights(w: &ModelWeights) -> usize {
    let n = |m: &Arc<dyn entrollm_model::weights::Linear>| m.rows() * m.cols();
    let head = if Arc::ptr_eq(&w.embed, &w.lm_head) {
        0
    } else {
        n(&w.lm_head)
    };
    let layers: usize = w
        .layers
        .iter()
        .map(|l| l.matrices().into_iter().map(n).sum::<usize>())
        .sum();
    n(&w.embed) + head + layers
}

/// A model this machine cannot hold is an error before any of it is read, never an allocation
/// failure half way through the load; one whose file pages do not fit beside it too is a warning
/// (they are read from disk again as they are used).
fn check_cpu_memory(model: &Path, context: Option<usize>) -> Result<()> {
    let Some((need, config)) = entrollm_model::load::cpu_memory_need(model)? else {
        return Ok(());
    };
    let ctx = context.unwrap_or(config.max_position_embeddings.min(4096));
    let state = entrollm_model::engine::state_bytes(&config, ctx);
    if let Some(warning) = memory_verdict(need, state, ctx, crate::budget::free_ram()?)? {
        eprintln!("warning: {warning}");
    }
    Ok(())
}

/// [`check_cpu_memory`]'s judgement of `need` and an engine `state` for `ctx` tokens against
/// `available` bytes: an error naming what to change, a warning, or neither.
fn memory_verdict(
    need: entrollm_model::load::MemoryNeed,
    state: u64,
    ctx: usize,
    available: u64,
) -> Result<Option<String>> {
    let gb = |b: u64| b as f64 / 1e9;
    let held = need.allocated + state;
    if held > available {
        anyhow::bail!(
            "the model needs {:.2} GB of memory on the CPU ({:.2} GB of weights copied at load, \
             {:.2} GB of KV cache and buffers for a {ctx}-token context) besides its {:.2} GB of \
             quantised weights read from the file, and {:.2} GB is available: lower the context \
             (-c) or use a smaller model or quantisation",
            gb(held),
            gb(need.allocated),
            gb(state),
            gb(need.mapped),
            gb(available)
        );
    }
    Ok((held + need.mapped > available).then(|| {
        format!(
            "the model's {:.2} GB of quantised weights do not fit in memory beside the {:.2} GB it \
             allocates ({:.2} GB available): they are read from disk as they are used, slowly",
            gb(need.mapped),
            gb(held),
            gb(available)
        )
    }))
}

/// Says so when a container is lossy: what it serves is a reconstruction of the source.
pub fn lossy_note(dir: &std::path::Path) {
    if let Ok(r) = entrollm_format::ContainerReader::open(dir) {
        if let Some(l) = r.manifest().metadata.get("lossy") {
            eprintln!(
                "lossy container: {} matrices coded with {} at {} bits a weight; they are served \
                 as their reconstruction, not the source's weights",
                l["tensors"],
                l["quantizer"].as_str().unwrap_or("?"),
                l["bits"]
            );
        }
    }
}

pub fn open(a: &ModelArgs) -> Result<Session> {
    a.budget.check_serving(&a.model)?;
    let device = DeviceArg::parse(&a.device)?;
    let decode = a.decode.options()?;
    check_bf16_palette(a.bf16, a.code_at_load.is_some())?;
    // The plan first: a bad coding fails before the checkpoint is read.
    let code = match &a.code_at_load {
        Some(_) if device == DeviceArg::Cpu => {
            anyhow::bail!("--code-at-load codes for the GPU kernels: use --device cuda")
        }
        Some(c) => {
            let plan = load_plan(c, a.coding_file.as_deref())?;
            Some(plan)
        }
        None => None,
    };
    if a.budget.is_set() && (code.is_some() || a.bf16) {
        anyhow::bail!(
            "--budget/--plan/--tune choose every launch's form: not with --code-at-load or --bf16 palette"
        );
    }
    let on_gpu = match device {
        DeviceArg::Cpu => false,
        DeviceArg::Cuda => true,
        DeviceArg::Auto => entrollm_cuda::device::device_count().is_ok_and(|n| n > 0),
    };
    let by_hand = ByHand {
        forms: code.is_some() || a.bf16 || a.fp8 == Fp8Serving::Palette,
        keep_coded: a.keep_coded,
        decode_at_load: a.decode_at_load,
    };
    let Opening { plan, load } = opening(&a.model, &a.budget, by_hand, on_gpu);
    let load = LoadOptions {
        q8_activations: a.q8_activations,
        ..load
    };
    if !on_gpu {
        check_cpu_memory(&a.model, a.context)?;
    }
    let (weights, tokenizer) = open_model_with(&a.model, load)?;
    if let Some(plan) = &code {
        entrollm_cuda::engine_coded::check_load_plan(&weights.config, plan)?;
    }
    let ctx = a
        .context
        .unwrap_or(weights.config.max_position_embeddings.min(4096));
    let (weights, launches) = planned(&a.budget, plan, weights, &a.model, device, ctx)?;
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repeat_penalty,
        seed: a.seed,
    };
    // (The sampler's message names the parameter; the flag is its name with dashes.)
    let sampler = Sampler::new(params)
        .map_err(|e| anyhow::anyhow!("{e} (--temperature, --top-p, --min-p, --repeat-penalty)"))?;
    let n_weights = matrix_weights(&weights);
    let serving = serving_under(launches, a.serving())?;
    let engine = Backend::new(weights, ctx, device, code.as_ref(), serving, decode)?;
    let bytes = match &engine {
        Backend::Cpu(e) => e.weights().stored_bytes(),
        Backend::Gpu(e) => e.model().weight_bytes(),
    };
    Ok(Session {
        engine,
        tokenizer,
        sampler,
        max_tokens: a.max_tokens.unwrap_or(256),
        context_shift: a.context_shift,
        quiet: a.quiet,
        weights: (bytes, n_weights),
    })
}

impl Session {
    /// Generates after `prompt` (token ids), streaming text to stdout; returns the generated ids
    /// and why generation stopped. Unless `quiet`, one line on stderr: prompt and decode speed,
    /// time to the first token, the weights in memory, and a full context's stop.
    fn stream(&mut self, prompt: &[u32]) -> Result<(Vec<u32>, StopReason)> {
        let ctx = self.engine.max_seq_len();
        if prompt.len() >= ctx {
            anyhow::bail!(
                "the prompt is {} tokens, the context {ctx}: raise --context (-c) past {}",
                prompt.len(),
                prompt.len()
            );
        }
        let stops = self.tokenizer.eos_ids().to_vec();
        let mut decoder = self.tokenizer.stream_decoder();
        let mut out = std::io::stdout().lock();
        let mut failed = None;
        let t0 = Instant::now();
        let (mut first, mut last) = (None, None);
        let opts = GenerateOptions {
            max_new_tokens: self.max_tokens,
            stop_tokens: &stops,
            context_shift: self.context_shift,
            logits: false,
        };
        let Generation { tokens, stop } = generate(
            &mut self.engine,
            &mut self.sampler,
            prompt,
            &opts,
            |id, _| {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                if stops.contains(&id) {
                    return ControlFlow::Continue(());
                }
                match decoder.push(id) {
                    Ok(Some(text)) => {
                        let _ = out.write_all(text.as_bytes());
                        let _ = out.flush();
                    }
                    Ok(None) => {}
                    Err(e) => {
                        failed = Some(e);
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            },
        )?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        if let Some(rest) = decoder.flush()? {
            out.write_all(rest.as_bytes())?;
        }
        writeln!(out)?;
        out.flush()?;
        if stop == StopReason::ContextFull {
            eprintln!(
                "stopped: the context of {ctx} tokens is full (raise --context/-c, or \
                 --context-shift to go on)"
            );
        }
        if !self.quiet {
            let end = last.unwrap_or_else(Instant::now);
            let ttft = first.map_or(end - t0, |f| f - t0).as_secs_f64();
            let decode_s = first.map_or(0.0, |f| (end - f).as_secs_f64());
            let (bytes, n) = self.weights;
            eprintln!(
                "[ prompt {} tokens, {:.1} tok/s | first token {:.0} ms | decode {} tokens{} | \
                 weights {:.1} MB, {:.2} bits/weight ]",
                prompt.len(),
                prompt.len() as f64 / ttft.max(1e-9),
                ttft * 1e3,
                tokens.len(),
                match tokens.len() > 1 && decode_s > 0.0 {
                    true => format!(", {:.1} tok/s", (tokens.len() - 1) as f64 / decode_s),
                    false => String::new(),
                },
                bytes as f64 / 1e6,
                bytes as f64 * 8.0 / n.max(1) as f64,
            );
        }
        Ok((tokens, stop))
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let mut s = open(&a.model)?;
    let ids = s.tokenizer.encode(&a.prompt, true)?;
    s.engine.reset();
    let (tokens, _) = s.stream(&ids)?;
    let has_template = ChatTemplate::for_tokenizer(&s.tokenizer).is_ok_and(|t| !t.is_fallback());
    if tokens.len() <= 1 && has_template {
        eprintln!(
            "note: `run` feeds the prompt as raw text; this is a chat model: `entrollm chat` \
             applies its chat template"
        );
    }
    Ok(())
}

/// Interactive chat with the model's chat template; reads one user turn per line from stdin (so it
/// also works piped). An empty line or end of input ends the session. A conversation that outgrows
/// the context loses its oldest turns (the system message stays) with `--context-shift`, and is an
/// error naming `--context` without it.
pub fn chat(a: ChatArgs) -> Result<()> {
    let mut s = open(&a.model)?;
    let template = ChatTemplate::for_tokenizer(&s.tokenizer)?;
    if template.is_fallback() {
        eprintln!("note: the model has no chat template; using ChatML");
    }
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(sys) = &a.system {
        messages.push(ChatMessage::system(sys.clone()));
    }
    let kept = messages.len();
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    let ctx = s.engine.max_seq_len();
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::user(line));
        let ids = loop {
            let prompt = template.render(&messages, true)?;
            let ids = s.tokenizer.encode(&prompt, false)?;
            // Room for a reply; with the context shift, the oldest turns go first.
            if ids.len() + 1 < ctx || !a.model.context_shift || messages.len() <= kept + 1 {
                break ids;
            }
            messages.drain(kept..kept + 2.min(messages.len() - kept - 1));
        };
        s.engine.reset();
        let (reply, _) = s.stream(&ids)?;
        messages.push(ChatMessage::assistant(
            s.tokenizer.decode(&reply)?.trim().to_string(),
        ));
        if interactive {
            eprint!("> ");
        }
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct PplArgs {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    model: PathBuf,
    /// The text to score (UTF-8).
    #[arg(long, required_unless_present = "tokens", conflicts_with = "tokens")]
    file: Option<PathBuf>,
    /// Token ids to score instead of a text, separated by white space (a model without a
    /// tokenizer can be scored so).
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Tokens per window.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Tokens between window starts; each window scores only the tokens the previous one did not.
    #[arg(long, default_value_t = 512)]
    stride: usize,
    /// Score at most this many tokens of the file (0: all).
    #[arg(long, default_value_t = 0)]
    max_tokens: usize,
    /// No timing summary on stderr.
    #[arg(short, long)]
    quiet: bool,
    /// Where to run: auto (the GPU if usable, else the CPU), cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// A reference model (same tokenizer) to compare with on the same windows, on the CPU: both
    /// perplexities, the KL divergence of the model from it, how often both pick the same top
    /// token and the largest logit difference (llama.cpp's `--kl-divergence`).
    #[arg(long, value_name = "MODEL")]
    reference: Option<PathBuf>,
    /// CPU, GGUF: `f32` or `q8` activations for the quantised matrices (as for `run`; the
    /// reference is always f32).
    #[arg(
        long = "activations",
        value_name = "f32|q8",
        default_value = "f32",
        value_parser = parse_activations,
        action = clap::ArgAction::Set
    )]
    q8_activations: bool,
    #[command(flatten)]
    budget: BudgetArgs,
    #[command(flatten)]
    decode: DecodeArgs,
}

/// `entrollm_model::perplexity`'s sliding window on the GPU engine: each window prefills its
/// context up to the first token it scores, then takes one decode step per further token.
fn gpu_perplexity(
    e: &mut GpuEngine,
    tokens: &[u32],
    window: usize,
    stride: usize,
) -> Result<entrollm_model::Perplexity> {
    let mut nll = entrollm_model::eval::Nll::default();
    for w in entrollm_model::eval::windows(tokens.len(), window, stride, e.max_seq_len() + 1)? {
        e.reset();
        let ctx = w.first_target - 1;
        let mut logits = e.prefill(&tokens[w.begin..=ctx])?;
        for i in ctx..w.end - 1 {
            if i > ctx {
                logits = e.step(tokens[i])?;
            }
            nll.add(&logits, tokens[i + 1] as usize);
        }
    }
    Ok(nll.perplexity())
}

/// `entrollm eval ppl`: perplexity of a text file, HF-style sliding window.
pub fn ppl(a: PplArgs) -> Result<()> {
    a.budget.check_serving(&a.model)?;
    let device = DeviceArg::parse(&a.device)?;
    let decode = a.decode.options()?;
    let input = a
        .file
        .as_ref()
        .or(a.tokens.as_ref())
        .expect("clap requires one");
    let text = entrollm_format::input::read_text_limited(input, 1 << 30)
        .map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
    // As stored, to plan from (a reference comparison serves the model decoded, unplanned).
    let plan = a.reference.is_none();
    let load = LoadOptions {
        fused: plan,
        recorded_forms: false,
        verify: true,
        q8_activations: a.q8_activations,
    };
    // Token ids need no tokenizer; a text does.
    let (weights, tokenizer) = match a.tokens {
        Some(_) => (
            entrollm_model::load::open_weights_with(&a.model, load)?,
            None,
        ),
        None => {
            let (w, t) = open_model_with(&a.model, load)?;
            (w, Some(t))
        }
    };
    let vocab = weights.config.vocab_size;
    let (weights, launches) = planned(&a.budget, plan, weights, &a.model, device, a.window)?;
    let mut tokens = match &tokenizer {
        Some(t) => t.encode(&text, true)?,
        None => parse_token_ids(&text, vocab)
            .map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?,
    };
    if a.max_tokens > 0 {
        tokens.truncate(a.max_tokens);
    }
    if let Some(reference) = &a.reference {
        return compare(&a, weights, reference, &tokens, tokenizer.as_ref());
    }
    let serving = serving_under(launches, Serving::default())?;
    let n_weights = matrix_weights(&weights);
    let t0 = Instant::now();
    let backend = Backend::new(weights, a.window, device, None, serving, decode)?;
    let (p, bytes) = match backend {
        Backend::Cpu(mut engine) => (
            entrollm_model::perplexity(&mut engine, &tokens, a.window, a.stride)?,
            engine.weights().stored_bytes(),
        ),
        Backend::Gpu(mut engine) => (
            gpu_perplexity(&mut engine, &tokens, a.window, a.stride)?,
            engine.model().weight_bytes(),
        ),
    };
    if !a.quiet {
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "[ {} tokens scored in {s:.1} s, {:.1} tok/s | weights {:.1} MB, {:.2} bits/weight ]",
            p.tokens_scored,
            p.tokens_scored as f64 / s.max(1e-9),
            bytes as f64 / 1e6,
            bytes as f64 * 8.0 / n_weights.max(1) as f64
        );
    }
    println!(
        "{}: perplexity {:.4} (mean NLL {:.6} nats over {} tokens; window {}, stride {})",
        input.display(),
        p.ppl,
        p.mean_nll,
        p.tokens_scored,
        a.window,
        a.stride
    );
    Ok(())
}

/// Token ids separated by white space, each below `vocab`.
fn parse_token_ids(text: &str, vocab: usize) -> std::result::Result<Vec<u32>, String> {
    let ids = text
        .split_whitespace()
        .enumerate()
        .map(|(i, w)| match w.parse::<u32>() {
            Ok(id) if (id as usize) < vocab => Ok(id),
            _ => Err(format!(
                "token {} is `{w}`: expected a token id below the vocabulary's {vocab}",
                i + 1
            )),
        })
        .collect::<std::result::Result<Vec<u32>, String>>()?;
    if ids.len() < 2 {
        return Err(format!(
            "{} token ids: perplexity needs at least 2",
            ids.len()
        ));
    }
    Ok(ids)
}

/// `eval ppl --reference`: the model and the reference on the CPU, window by window.
fn compare(
    a: &PplArgs,
    weights: ModelWeights,
    reference: &Path,
    tokens: &[u32],
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    anyhow::ensure!(
        DeviceArg::parse(&a.device)? != DeviceArg::Cuda && !a.budget.is_set(),
        "--reference compares on the CPU, as loaded: not with --device cuda or --budget/--plan/--tune"
    );
    let load = LoadOptions {
        fused: false,
        recorded_forms: false,
        verify: true,
        q8_activations: false,
    };
    // Token ids given: the same ids go to both.
    let ref_weights = match tokenizer {
        None => entrollm_model::load::open_weights_with(reference, load)
            .map_err(|e| anyhow::anyhow!("the reference model: {e}"))?,
        Some(tokenizer) => {
            let (ref_weights, ref_tokenizer) = open_model_with(reference, load)
                .map_err(|e| anyhow::anyhow!("the reference model: {e}"))?;
            // The same text must be the same ids in both, or the comparison means nothing.
            let text = tokenizer.decode(tokens)?;
            anyhow::ensure!(
                ref_tokenizer.encode(&text, true)? == tokens,
                "{}: its tokenizer encodes the text differently from {}'s: a reference must \
                 share the model's tokenizer",
                reference.display(),
                a.model.display()
            );
            ref_weights
        }
    };
    let t0 = Instant::now();
    let mut engine = Engine::new(weights, a.window)?;
    let mut ref_engine = Engine::new(ref_weights, a.window)?;
    let d =
        entrollm_model::eval::divergence(&mut engine, &mut ref_engine, tokens, a.window, a.stride)?;
    if !a.quiet {
        eprintln!(
            "[ {} tokens scored by both in {:.1} s ]",
            d.model.tokens_scored,
            t0.elapsed().as_secs_f64()
        );
    }
    println!(
        "{}: perplexity {:.4} (reference {:.4}); KL divergence from the reference: mean {:.6}, \
         max {:.6} nats; same top token {:.2} %; largest logit difference {:.3e} ({} tokens; \
         window {}, stride {})",
        a.file
            .as_ref()
            .or(a.tokens.as_ref())
            .expect("clap requires one")
            .display(),
        d.model.ppl,
        d.reference.ppl,
        d.mean_kl,
        d.max_kl,
        100.0 * d.same_top,
        d.max_logit_diff,
        d.model.tokens_scored,
        a.window,
        a.stride
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_the_cpu_cannot_hold_is_refused_naming_the_context() {
        use entrollm_model::load::MemoryNeed;
        let gb = 1_000_000_000u64;
        // The 7B Q4_K_M: 4.7 GB mapped, 1.1 GB copied (embedding rows widened, norms).
        let need = MemoryNeed {
            mapped: 47 * gb / 10,
            allocated: 11 * gb / 10,
        };
        assert_eq!(memory_verdict(need, gb, 4096, 24 * gb).unwrap(), None);
        // The file's pages do not fit beside the rest: a warning only.
        let w = memory_verdict(need, gb, 4096, 5 * gb).unwrap().unwrap();
        assert!(w.contains("read from disk"), "{w}");
        // What is allocated does not fit: an error naming -c, before anything is loaded.
        let e = memory_verdict(need, 3 * gb, 32768, 4 * gb)
            .unwrap_err()
            .to_string();
        assert!(e.contains("-c") && e.contains("32768-token"), "{e}");
        assert!(memory_verdict(need, 29 * gb / 10, 4096, 4 * gb).is_ok());
    }
}
