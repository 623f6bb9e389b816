//! `entrollm compress`: code a checkpoint losslessly into an entrollm container (the pipeline is
//! `entrollm_model::compress`); with `--plan` or `--budget`, in the weight forms a plan chooses.

use crate::budget::{BudgetArgs, Target};
use crate::progress;
use anyhow::{anyhow, bail, Context, Result};
use entrollm_codec::dtans::Coding;
use entrollm_codec::lossy::scalar::Scalar;
use entrollm_format::Dtype;
use entrollm_format::FormEntry;
use entrollm_model::calib::Calibration;
use entrollm_model::coding_plan::CodingPlan;
use entrollm_model::compress::{
    compress, lossy_eligible, plan_lossy, Coder, CompressOptions, LossyOptions, LossyPlanning,
    LossyQuantizer, Progress, SourceKind,
};
use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::rates::BitsFile;
use entrollm_tune::file::PlanFile;
use entrollm_tune::lossy::{LossyOffer, LossyPlan};
use entrollm_tune::tuner::LaunchTimer;
use entrollm_tune::DeviceKind;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("lossy").args(["bits", "allow_lossy"]).multiple(true)))]
pub struct Args {
    /// A Hugging Face checkpoint: a directory (sharded with an index, or of .safetensors files) or
    /// one .safetensors file; BF16, FP16 and FP8 tensors are coded, others stored as they are. Or a
    /// GGUF file: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 codes and F16/BF16 matrices are coded, other tensors
    /// (F32, k-quants) stored as they are; the GGUF is restored bit for bit by `decompress`.
    src: PathBuf,
    /// Output container directory (must not exist or be empty, unless --overwrite).
    #[arg(short, long)]
    output: PathBuf,
    /// auto (dtANS-LLM, but a BF16/F16 matrix it would code more than 0.1 bit a weight over its
    /// entropy bound, as narrow ones, rANS beside its raw bytes where smaller: stored smaller,
    /// served decoded), dtans (every matrix dtANS: what fused products decode in place) or df11
    /// (DFloat11 layout, BF16 only).
    #[arg(long, default_value = "auto")]
    coder: String,
    /// dtANS coding: "auto" (smallest predicted size per tensor) or MODE:LOG2M:SC[:T], e.g.
    /// pair:12:512:64 (mode single|pair|quad, table 2^8..2^12, slice width, values kept).
    #[arg(long, default_value = "auto")]
    coding: String,
    /// A JSON file of codings per launch (qkv, o, gate_up, down, lm_head, embed, default), e.g.
    /// from a tuner; launches it does not name get --coding.
    #[arg(long)]
    coding_file: Option<PathBuf>,
    /// Code the float matrices lossily at this many stored bits a weight on average, every byte
    /// counted (e.g. 4, or 3.3): the container then decodes to their reconstruction. The average
    /// is allocated across matrices by rate and distortion (see --allocate). The token embedding,
    /// the output projection and tensors that are not matrices stay exact. Off: lossless.
    #[arg(long, value_name = "R")]
    bits: Option<f64>,
    /// With --bits or --allow-lossy: `rd` gives each matrix the rate that minimises the sum of the matrices'
    /// relative (with --calib: output) errors at the average; `uniform` codes every matrix at R.
    #[arg(
        long,
        default_value = "rd",
        value_name = "rd|uniform",
        requires = "lossy"
    )]
    allocate: String,
    /// With --bits or --allow-lossy: a JSON object of launch (qkv, o, gate_up, down) or tensor name → bits a
    /// weight, e.g. {"down": 5, "model.layers.0.self_attn.v_proj.weight": 6}; the matrices it
    /// names take those rates, the others share --bits.
    #[arg(long, value_name = "FILE", requires = "lossy")]
    bits_file: Option<PathBuf>,
    /// With --bits or --allow-lossy: a calibration text (UTF-8). The source model runs over it on the CPU, and
    /// each matrix's error is weighted by its input channels' activation energy (as GPTQ and AWQ
    /// weigh), in the row fit, the TCQ search, the RDO and the allocation: the bits buy output
    /// accuracy rather than weight accuracy. With --quantizer int, codes are also rounded with
    /// GPTQ error feedback from each launch's input Hessian (on the same grid).
    #[arg(long, value_name = "FILE", requires = "lossy")]
    calib: Option<PathBuf>,
    /// With --calib: the text's first this many tokens are run.
    #[arg(long, default_value_t = 8192, value_name = "N", requires = "calib")]
    calib_tokens: usize,
    /// With --bits or --allow-lossy: the per-row rate–distortion optimisation, with this many candidate step
    /// multipliers per row (EntroPack's optional pass, e.g. 8): lower error where rows differ in
    /// scale, about K times the encode time. 0: off.
    #[arg(long, default_value_t = 0, value_name = "K", requires = "lossy")]
    rdo: usize,
    /// With --bits or --allow-lossy, the quantiser: tcqN (entropy-coded trellis-coded quantisation, N = 4 … 256
    /// states: more states code closer to the bound and encode slower) or e8 (EntroPack's E8
    /// lattice, about 0.1 bit further from the bound, faster to encode): lossy tiles, decoded by
    /// their own tile decoder. Or, served by the fused dtANS products as they are (fast): int
    /// (a uniform integer grid with one f16 scale per --group columns) or fp8 (FP8 E4M3 codes,
    /// one scale per row); each matrix's grid is chosen so that its codes *entropy-coded* (and
    /// its scales) take R bits a weight.
    #[arg(long, default_value = "tcq32", value_name = "tcqN|e8|int|fp8")]
    quantizer: String,
    /// With --quantizer int: columns a scale covers (rows must hold whole groups; narrower rows
    /// are one group).
    #[arg(long, default_value_t = entrollm_codec::lossy::scalar::INT_GROUP, value_name = "N", requires = "lossy")]
    group: usize,
    /// With --quantizer int: weights within (0.5 + F) steps of zero are coded 0 (0 to 0.5; 0:
    /// plain rounding). A dead zone lowers the codes' entropy at low rates.
    #[arg(long, default_value_t = 0.0, value_name = "F", requires = "lossy")]
    dead_zone: f32,
    /// With --bits or --allow-lossy, the weights a tile holds at least (whole rows), 1024 to 32768: smaller tiles
    /// decode faster on a GPU (more of them at once) and cost 132 bytes each, about 0.13 bit a
    /// weight at 8192.
    #[arg(long, default_value_t = entrollm_codec::lossy::TILE_WEIGHTS, value_name = "N", requires = "lossy")]
    tile_weights: usize,
    /// Tensors with fewer elements than this stay uncoded.
    #[arg(long, default_value_t = 4096)]
    min_elements: usize,
    /// Replace what the output directory holds (never the source).
    #[arg(long)]
    overwrite: bool,
    /// Largest container shard, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    shard_size: u64,
    /// `--plan PLAN.json` writes each launch in the form that plan chose (docs/tune.md);
    /// `--budget SIZE [--tune TUNE.json]` plans for that memory as `run --budget` does. The forms
    /// are recorded in entrollm.json and `run`/`chat` serve them; --coder/--coding then only say
    /// how launches in forms a container cannot hold as such are stored.
    #[command(flatten)]
    budget: BudgetArgs,
    /// The device `--budget` plans for: cpu (this machine; without --tune the default cost
    /// model) or cuda (a GPU, which needs --tune TUNE.json from `entrollm tune --device cuda`).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda")]
    device: String,
    /// With --budget: the context the KV cache is reserved for, as `run --context` (default: the
    /// model's, at most 4096).
    #[arg(long, value_name = "N", requires = "budget")]
    context: Option<usize>,
}

/// The options of `--coder`, `--coding`, `--coding-file` and the rest.
fn options(a: &Args) -> Result<CompressOptions> {
    let default = Coding::parse(&a.coding).map_err(|e| anyhow!("--coding: {e}"))?;
    let plan = match &a.coding_file {
        Some(f) => CodingPlan::from_file(f, default)?,
        None => CodingPlan::uniform(default),
    };
    let tiles = entrollm_codec::lossy::MIN_TILE_WEIGHTS..=entrollm_codec::lossy::TILE_WEIGHTS;
    if !tiles.contains(&a.tile_weights) {
        bail!(
            "--tile-weights {}: give {} to {} weights",
            a.tile_weights,
            tiles.start(),
            tiles.end()
        );
    }
    if a.rdo == 1 || a.rdo > 64 {
        bail!("--rdo {}: give 2 to 64 candidates (0: off)", a.rdo);
    }
    if a.bits.is_some() && a.budget.is_set() {
        bail!(
            "--bits names the rate and --budget/--plan the size: give --budget SIZE --allow-lossy \
             to have the budget choose the rate, or --bits R alone"
        );
    }
    let lossy = a.bits.map(|bits| lossy_options(a, bits)).transpose()?;
    Ok(CompressOptions {
        lossy,
        coder: Coder::parse(&a.coder).map_err(|e| anyhow!(e))?,
        dtans_only: a.coder == "dtans",
        plan,
        min_elements: a.min_elements,
        shard_size: a.shard_size,
        overwrite: a.overwrite,
        ..CompressOptions::default()
    })
}

/// `--quantizer` (with `--group` and `--dead-zone`).
fn quantizer(a: &Args) -> Result<LossyQuantizer> {
    LossyQuantizer::parse(&a.quantizer, a.group, a.dead_zone)
        .map_err(|e| anyhow!("--quantizer {}: {e}", a.quantizer))
}

/// Lossy coding at an average of `bits` (`--bits`, or the rate `--allow-lossy` planned).
fn lossy_options(a: &Args, bits: f64) -> Result<LossyOptions> {
    Ok(LossyOptions {
        tile_weights: a.tile_weights,
        rdo: a.rdo,
        ..LossyOptions::new(bits, quantizer(a)?)
    })
}

/// The launches `--allow-lossy` may code lossily: those whose every matrix `--bits` would code.
fn lossy_offer(a: &Args, w: &entrollm_model::ModelWeights) -> Result<LossyOffer> {
    let q = quantizer(a)?;
    if let LossyQuantizer::Scalar(_) = q {
        bail!(
            "--allow-lossy plans the lossy tile form (--quantizer tcqN or e8); --quantizer {q} is \
             given a rate with --bits R"
        );
    }
    let dtype = |kind: &str| match kind {
        "bf16" => Some(Dtype::BF16),
        "f16" => Some(Dtype::F16),
        "f32" => Some(Dtype::F32),
        _ => None,
    };
    let launches = entrollm_model::forms::layout::launches(w)
        .into_iter()
        .filter(|l| {
            l.tensors.iter().zip(&l.matrices).all(|(name, m)| {
                dtype(m.values_kind()).is_some_and(|d| {
                    lossy_eligible(name, &[m.rows(), m.cols()], d, a.min_elements, q)
                })
            })
        })
        .map(|l| {
            let weights = l.matrices.iter().map(|m| m.rows() * m.cols()).sum();
            (l.id, weights)
        })
        .collect();
    Ok(LossyOffer {
        launches,
        variant: q.to_string(),
    })
}

/// The pipeline's progress as a bar over the source bytes.
struct Bar(Option<indicatif::ProgressBar>, &'static str);

impl Progress for Bar {
    fn start(&mut self, total_bytes: u64) {
        self.0 = Some(progress::bytes(total_bytes, self.1));
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&mut self) {
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
        }
    }
}

/// The plan of `--plan`/`--budget` for the source, checked to be the source's, made by the code
/// of `run --budget` for `--device`; with `--allow-lossy`, the rate of its lossy launches.
fn plan(a: &Args) -> Result<LossyPlan> {
    let kind = match a.device.as_str() {
        "cpu" => DeviceKind::Cpu,
        "cuda" => DeviceKind::Cuda,
        d => bail!("--device {d}: expected cpu or cuda"),
    };
    // As `--budget` loads a model: as stored (coded matrices coded, GGUF blocks as blocks).
    let w = open_weights_with(
        &a.src,
        LoadOptions {
            fused: true,
            recorded_forms: false,
            verify: true,
            q8_activations: false,
        },
    )
    .with_context(|| {
        format!(
            "{}: reading the model to plan its forms (a checkpoint directory with config.json, \
             or a GGUF file)",
            a.src.display()
        )
    })?;
    let ctx = a
        .context
        .unwrap_or(w.config.max_position_embeddings.min(4096));
    let cpu = entrollm_tune::tuner::CpuTimer::new(rayon::current_num_threads()).device();
    let target = match kind {
        DeviceKind::Cpu => Target {
            kind,
            device: Some(&cpu),
            reserved: crate::generate::cpu_reserved(&w.config, ctx),
        },
        DeviceKind::Cuda => Target {
            kind,
            device: None,
            reserved: entrollm_cuda::tune::reserved_bytes(&w.config, ctx),
        },
    };
    let free = || match kind {
        DeviceKind::Cpu => crate::budget::free_ram(),
        DeviceKind::Cuda => Err(anyhow!(
            "--budget as a share of free memory needs the device: give a size (12GB) with \
             --device cuda"
        )),
    };
    let offer = a
        .budget
        .allow_lossy
        .then(|| lossy_offer(a, &w))
        .transpose()?;
    crate::budget::plan_allowing(&a.budget, &w, &a.src, &target, free, offer.as_ref())
}

/// The plan's forms by the HF names of the tensors of each launch.
fn forms_of(plan: &PlanFile) -> std::collections::BTreeMap<String, FormEntry> {
    let mut out = std::collections::BTreeMap::new();
    for c in &plan.choices {
        for t in &c.tensors {
            out.insert(
                t.clone(),
                FormEntry {
                    form: c.form.clone(),
                    variant: c.variant.clone(),
                },
            );
        }
    }
    out
}

pub fn run(a: Args) -> Result<()> {
    let mut opts = options(&a)?;
    if a.budget.is_set() {
        let LossyPlan { plan, rate } = plan(&a)?;
        opts.forms = forms_of(&plan);
        opts.metadata
            .insert("plan".into(), serde_json::to_value(&plan)?);
        if let Some(r) = rate {
            opts.lossy = Some(lossy_options(&a, r)?);
        }
    }
    if opts.lossy.is_some() {
        opts = plan_rates(&a, &opts)?;
    }
    let mut bar = Bar(None, "compress");
    let s = compress(&a.src, &a.output, &opts, &mut bar);
    bar.finish();
    let s = s.map_err(|e| match e {
        entrollm_model::compress::CompressError::Format(f) => name_overwrite(f),
        e => e.into(),
    })?;
    for n in &s.notes {
        eprintln!("note: {n}");
    }
    let ratio = 100.0 * s.coded_bytes as f64 / s.coded_source_bytes.max(1) as f64;
    match s.source {
        SourceKind::Safetensors => eprintln!(
            "coded {} tensors: {:.3} GB -> {:.3} GB ({ratio:.1} %); container written to {}",
            s.coded_tensors,
            s.coded_source_bytes as f64 / 1e9,
            s.coded_bytes as f64 / 1e9,
            a.output.display()
        ),
        SourceKind::Gguf => {
            let bpw = |bytes: u64| bytes as f64 * 8.0 / s.coded_weights.max(1) as f64;
            eprintln!(
                "coded {} tensors: {:.1} MB at {:.3} bits/weight in the GGUF -> {:.1} MB at {:.3} \
                 ({ratio:.1} %); container written to {}",
                s.coded_tensors,
                s.coded_source_bytes as f64 / 1e6,
                bpw(s.coded_source_bytes),
                s.coded_bytes as f64 / 1e6,
                bpw(s.coded_bytes),
                a.output.display()
            )
        }
    }
    let (src, dst) = (tree_bytes(&a.src), tree_bytes(&a.output));
    eprintln!(
        "container {:.1} MB for a {:.1} MB source ({:.1} %, everything included)",
        dst as f64 / 1e6,
        src as f64 / 1e6,
        100.0 * dst as f64 / src.max(1) as f64
    );
    if let (Some(l), true) = (&opts.lossy, s.lossy_tensors > 0) {
        eprintln!(
            "lossy: {} matrices coded with {} at {} bits a weight on average; the container \
             decodes to their reconstruction (`decompress` writes it, not the source)",
            s.lossy_tensors, l.quantizer, l.bits
        );
    }
    if s.formed_tensors > 0 {
        eprintln!(
            "compress: {} tensors in the forms of the plan, recorded in entrollm.json (run and \
             chat serve them so)",
            s.formed_tensors
        );
    }
    Ok(())
}

/// The lossy matrices' rates and column weights (--allocate, --bits-file, --calib).
fn plan_rates(a: &Args, opts: &CompressOptions) -> Result<CompressOptions> {
    let allocate = match a.allocate.as_str() {
        "rd" => true,
        "uniform" => false,
        o => bail!("--allocate {o}: expected rd or uniform"),
    };
    let bits_file = a
        .bits_file
        .as_deref()
        .map(BitsFile::read)
        .transpose()
        .context("--bits-file")?;
    let calibration = match &a.calib {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| {
                format!("--calib {}: reading the calibration text", f.display())
            })?;
            let bar = progress::steps(1, "calibrate");
            // Integer codes are rounded with GPTQ feedback, from each launch's Hessian.
            let hessians = matches!(quantizer(a)?, LossyQuantizer::Scalar(Scalar::Int { .. }));
            let c = Calibration::collect(&a.src, &text, a.calib_tokens, hessians, |done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            })
            .with_context(|| {
                format!(
                    "--calib: running {} over {} (a checkpoint directory with config.json and \
                     tokenizer.json, or a GGUF file)",
                    a.src.display(),
                    f.display()
                )
            })?;
            bar.finish_and_clear();
            eprintln!("calibration: {} tokens of {}", c.tokens, f.display());
            Some(c)
        }
        None => None,
    };
    let planning = LossyPlanning {
        allocate,
        bits_file,
        calibration,
    };
    let mut bar = Bar(None, "rates");
    let out = plan_lossy(&a.src, opts, &planning, &mut bar);
    bar.finish();
    let out = out?;
    if let Some(l) = &out.lossy {
        let rates: Vec<f64> = l.planned.values().map(|p| p.bits).collect();
        if let (Some(lo), Some(hi)) = (
            rates.iter().copied().reduce(f64::min),
            rates.iter().copied().reduce(f64::max),
        ) {
            eprintln!(
                "rates: {} matrices at {lo:.2} to {hi:.2} bits a weight ({})",
                rates.len(),
                if allocate { "allocated" } else { "uniform" }
            );
        }
    }
    Ok(out)
}

/// `e`, where it says the output exists, with the flag that replaces it.
pub fn name_overwrite(e: entrollm_format::FormatError) -> anyhow::Error {
    match e {
        entrollm_format::FormatError::DestinationExists { path } => anyhow!(
            "{}: exists and is not empty; add --overwrite to replace it",
            path.display()
        ),
        e => e.into(),
    }
}

/// Bytes of a file, or of the files under a directory (links not followed).
fn tree_bytes(p: &std::path::Path) -> u64 {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| tree_bytes(&e.path()))
            .sum(),
        Ok(m) if m.is_file() => m.len(),
        _ => 0,
    }
}
