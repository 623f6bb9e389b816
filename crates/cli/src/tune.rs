//! `entrollm tune` (size–latency fronts per launch, measured) and `entrollm plan` (a budget
//! turned into a choice per launch).

use crate::budget::print_summary;
use crate::progress;
use anyhow::{bail, Context, Result};
use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::synth::{shared_layer_weights, SynthShape};
use entrollm_tune::budget::Budget;
use entrollm_tune::costs::{CostTable, DeviceClass};
use entrollm_tune::file::{DeviceId, PlanFile, TuneFile};
use entrollm_tune::tuner::{tune, CpuTimer, LaunchTimer, Progress, TuneOptions};
use entrollm_tune::{plan, planner};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct TuneArgs {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    #[arg(required_unless_present = "synth")]
    model: Option<PathBuf>,
    /// Instead of a model: this synthetic shape in BF16, layer 0's weights in every layer (no
    /// disk; as `bench --synth` serves it). Its tune file plans `bench --synth` of the same shape.
    #[arg(long, conflicts_with = "model", value_parser = SynthShape::names().to_vec())]
    synth: Option<String>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0, requires = "synth")]
    seed: u64,
    /// Where to time: cpu, or cuda (the GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The tune file to write; if it exists and was made for this model and device, the launches
    /// it already holds are not measured again.
    #[arg(short, long, default_value = "tune.json")]
    output: PathBuf,
    /// Resume from a tune file made on another device or entrollm version.
    #[arg(long)]
    force_tune: bool,
    /// Time at most this many variants of each form per launch shape (the smallest predicted).
    #[arg(long, default_value_t = 12)]
    max_variants: usize,
    /// CPU: run the decode steps the candidates are timed in for at least this many seconds
    /// (longer averages a shared machine's slow and fast phases better).
    #[arg(long, default_value_t = 2.0, value_name = "S")]
    seconds: f64,
    /// Also add this model's timings to the tune data file FILE (created if missing): the
    /// latencies plans use on this kind of device without a tune file of their model
    /// (crates/tune/data/ ships them; docs/tune.md, *Tune data*).
    #[arg(long, value_name = "FILE")]
    costs: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A tune file from `entrollm tune`.
    tune: PathBuf,
    /// Bytes the launches' weights may take: `12GB`, `11.5GiB`, `500MB` (the KV cache is not in a
    /// tune file: `run --budget` reserves it first). Without it, the fastest plan.
    #[arg(long, value_name = "SIZE")]
    budget: Option<Budget>,
    /// Draw each launch's front and the model's size–speed front (.svg or .png).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Write the plan (for `compress --plan` and `run --plan`).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

fn timer(device: &str, seconds: f64) -> Result<Box<dyn LaunchTimer>> {
    if !(seconds.is_finite() && (0.0..=3600.0).contains(&seconds)) {
        bail!("--seconds {seconds}: expected 0 to 3600");
    }
    match device {
        "cpu" => {
            let mut t = CpuTimer::new(rayon::current_num_threads());
            t.steps.min_seconds = seconds;
            Ok(Box::new(t))
        }
        "cuda" => Ok(Box::new(entrollm_cuda::tune::GpuTimer::open(0)?)),
        d => bail!("--device {d}: expected cpu or cuda"),
    }
}

pub fn run_tune(a: TuneArgs) -> Result<()> {
    let timer = timer(&a.device, a.seconds)?;
    let device: DeviceId = timer.device();
    let (w, path) = match (&a.model, &a.synth) {
        (Some(model), _) => (
            // As `--budget` loads it: as stored (coded matrices coded, GGUF blocks as blocks).
            open_weights_with(
                model,
                LoadOptions {
                    fused: true,
                    // As stored, so that a container and its source have the same fingerprint.
                    recorded_forms: false,
                    verify: true,
                    q8_activations: false,
                },
            )?,
            model.display().to_string(),
        ),
        (None, Some(name)) => {
            let shape = SynthShape::parse(name).expect("clap checked the name");
            let w = shared_layer_weights(&shape.config(), a.seed)?;
            (w, crate::bench::synth_id(name, a.seed))
        }
        (None, None) => bail!("give a MODEL path or --synth SHAPE"),
    };
    let id = planner::model_id(&w, &path)?;
    let resume = match a.output.exists() {
        false => None,
        true => {
            let t = TuneFile::read(&a.output)?;
            for d in t
                .check_device(&device, a.force_tune)
                .with_context(|| format!("{} (resuming)", a.output.display()))?
            {
                eprintln!("warning: resuming a tune file of another device: {d}");
            }
            if t.model.fingerprint != id.fingerprint {
                bail!(
                    "{} holds the tune of another model ({}); choose another -o",
                    a.output.display(),
                    t.model.path
                );
            }
            eprintln!("tune: resuming {}", a.output.display());
            Some(t)
        }
    };
    let opts = TuneOptions {
        max_variants_per_form: a.max_variants,
        ..TuneOptions::default()
    };
    let bar = progress::steps(0, "tune");
    let t0 = std::time::Instant::now();
    let mut reused = 0;
    // Without a terminal (a log), one line per candidate instead of the bar.
    let lines = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let tf = tune(&w, id, resume.as_ref(), &*timer, &opts, &mut |p| match p {
        Progress::Timing { done, total, what } => {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(what.to_string());
            if lines {
                eprintln!(
                    "tune: [{done}/{total}] {what} ({:.1} s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        Progress::Reused { .. } => reused += 1,
    })?;
    bar.finish_and_clear();
    tf.write(&a.output)?;
    let shapes: std::collections::BTreeSet<&str> =
        tf.launches.iter().map(|l| l.shape_key.as_str()).collect();
    let points: usize = tf.launches.iter().map(|l| l.points.len()).sum();
    let front: usize = tf
        .launches
        .iter()
        .map(|l| l.points.iter().filter(|p| p.pareto).count())
        .sum();
    eprintln!(
        "tune: {} launches of {} shapes ({} reused from the file), {points} points, {front} on \
         their fronts, in {:.1} s on {}; wrote {}",
        tf.launches.len(),
        shapes.len(),
        reused,
        t0.elapsed().as_secs_f64(),
        device.name,
        a.output.display()
    );
    if let Some(path) = &a.costs {
        let class = match device.kind {
            entrollm_tune::DeviceKind::Cpu => DeviceClass::this_cpu(device.threads.unwrap_or(1)),
            entrollm_tune::DeviceKind::Cuda => DeviceClass::gpu(&device.name),
        };
        let mut table = match path.exists() {
            true => CostTable::read(path)?,
            false => CostTable::new(class.clone(), &device.name, &tf.protocol),
        };
        table
            .add(&tf, &class)
            .with_context(|| format!("{}", path.display()))?;
        table.write(path)?;
        eprintln!(
            "tune: added {} to the tune data {} ({} samples of {} models, {})",
            tf.model.path,
            path.display(),
            table.samples.len(),
            table.steps.len(),
            table.device
        );
    }
    Ok(())
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    let tf = TuneFile::read(&a.tune)?;
    let budget = a.budget.as_ref().map(|b| match b {
        Budget::Percent(_) => Err(anyhow::anyhow!(
            "--budget {b}: a share of free memory needs a device; give a size (12GB) or use \
             `run --budget {b}`"
        )),
        b => Ok(b.resolve(0)),
    });
    let budget = budget.transpose()?;
    let p: PlanFile = plan(&tf, budget, 0)?;
    print_summary(&p, &mut std::io::stdout())?;
    if let Some(o) = &a.output {
        p.write(o)?;
        eprintln!("plan: wrote {}", o.display());
    }
    if let Some(f) = &a.plot {
        entrollm_tune::plot::plot(&tf, Some(&p), f)?;
        eprintln!("plan: drew {}", f.display());
    }
    Ok(())
}
