//! `--budget SIZE`, `--tune TUNE.json`, `--plan PLAN.json` on run/chat/eval/bench/compress: the
//! forms of a model's launches chosen to fit a memory budget (tune crate's planner).

use crate::progress;
use anyhow::{bail, Context, Result};
use entrollm_model::ModelWeights;
use entrollm_tune::budget::Budget;
use entrollm_tune::costs::{self, Costs, DeviceClass};
use entrollm_tune::file::{DeviceId, PlanFile, TuneFile};
use entrollm_tune::lossy::{plan_allowing_lossy, LossyOffer, LossyPlan};
use entrollm_tune::planner;
use entrollm_tune::DeviceKind;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct BudgetArgs {
    /// Memory for the model: `12GB`, `11.5GiB`, `500MB`, or `80%` of free memory (device memory
    /// on the GPU, RAM on the CPU). The KV cache for the context and the workspace are reserved
    /// first; each launch then gets the fastest form whose bytes fit (lossless forms only, but
    /// for `compress --allow-lossy`).
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<Budget>,
    /// Latencies measured by `entrollm tune` for this model and device (default: the forms'
    /// predicted sizes and the default cost model, docs/forms.md).
    #[arg(long, value_name = "TUNE.json")]
    pub tune: Option<PathBuf>,
    /// Use a tune file made on another device or entrollm version.
    #[arg(long)]
    pub force_tune: bool,
    /// Serve the forms this plan (from `entrollm plan -o`) chooses, instead of planning.
    #[arg(long, value_name = "PLAN.json", conflicts_with_all = ["budget", "tune"])]
    pub plan: Option<PathBuf>,
    /// compress: where the budget cannot be met losslessly, code the matrices --bits would code
    /// lossily, at the highest average rate (1.5 to 8 bits a weight) at which the plan fits; the
    /// other launches get the fastest lossless forms in what is left. Off: a budget lossless
    /// forms cannot meet is an error. (Lossy coding is done once, by compress.)
    #[arg(long, requires = "budget")]
    pub allow_lossy: bool,
}

impl BudgetArgs {
    pub fn is_set(&self) -> bool {
        self.budget.is_some() || self.plan.is_some() || self.tune.is_some()
    }

    /// For the commands that serve a model: `--allow-lossy` is compress's, which codes once what
    /// they then serve.
    pub fn check_serving(&self, model: &Path) -> Result<()> {
        if self.allow_lossy {
            bail!(
                "--allow-lossy: lossy coding is done once, by compress: `entrollm compress {} -o \
                 DST --budget SIZE --allow-lossy`, then serve DST (it is served in the forms its \
                 plan chose)",
                model.display()
            );
        }
        Ok(())
    }
}

/// Free memory the `%` form of `--budget` is a share of: RAM on the CPU (MemAvailable).
pub fn free_ram() -> Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("/proc/meminfo has no MemAvailable")?;
    Ok(kb * 1024)
}

/// Where a plan is made for.
pub struct Target<'a> {
    pub kind: DeviceKind,
    /// The device at hand, which a tune file must have been made on; `None`: a device not at
    /// hand (`compress --device cuda` on a machine without it), whose tune file is taken as the
    /// device's and is then required.
    pub device: Option<&'a DeviceId>,
    /// Bytes reserved before the weights: KV cache and workspace.
    pub reserved: u64,
}

/// Reads a tune file and checks it against this device (`None`: a device not at hand; only its
/// kind is checked).
pub fn read_tune(
    path: &Path,
    device: Option<&DeviceId>,
    kind: DeviceKind,
    force: bool,
) -> Result<TuneFile> {
    let t = TuneFile::read(path)?;
    let Some(device) = device else {
        if t.device.kind != kind && !force {
            bail!(
                "{}: a tune file of a {} device, and the plan is for {}; tune on that device \
                 (`entrollm tune --device {}`) or pass --force-tune",
                path.display(),
                t.device.kind,
                kind,
                kind
            );
        }
        return Ok(t);
    };
    let diffs = t
        .check_device(device, force)
        .with_context(|| format!("{}", path.display()))?;
    for d in diffs {
        eprintln!(
            "warning: {}: made on another device: {d} (--force-tune)",
            path.display()
        );
    }
    Ok(t)
}

/// The plan for `w` under `args` on `target`: its `reserved` bytes (KV cache, workspace) come off
/// the budget first. Prints the plan's summary on stderr.
pub fn plan(
    args: &BudgetArgs,
    w: &ModelWeights,
    model_path: &Path,
    target: &Target,
    free: impl FnOnce() -> Result<u64>,
) -> Result<PlanFile> {
    Ok(plan_allowing(args, w, model_path, target, free, None)?.plan)
}

/// [`plan`], with the launches of `lossy` coded lossily where a `--budget` cannot be met
/// losslessly (`compress --allow-lossy`; the tune crate's `lossy` module).
pub fn plan_allowing(
    args: &BudgetArgs,
    w: &ModelWeights,
    model_path: &Path,
    target: &Target,
    free: impl FnOnce() -> Result<u64>,
    lossy: Option<&LossyOffer>,
) -> Result<LossyPlan> {
    let (device, reserved) = (target.kind, target.reserved);
    let id = planner::model_id(w, &model_path.display().to_string())?;
    if let Some(p) = &args.plan {
        let plan = PlanFile::read(p)?;
        if plan.model.fingerprint != id.fingerprint {
            bail!(
                "{}: the plan was made for another model ({}, fingerprint {}), not for {} \
                 (fingerprint {}); make one for this model with `entrollm tune` and \
                 `entrollm plan`, or use `--budget`",
                p.display(),
                plan.model.path,
                plan.model.fingerprint,
                model_path.display(),
                id.fingerprint
            );
        }
        return Ok(LossyPlan { plan, rate: None });
    }
    let fixed = planner::fixed_bytes(w);
    let budget = match &args.budget {
        // The default rule: the weights as the source stores them, capped by free memory.
        None => Some(planner::default_budget(w, reserved, free()?)?),
        Some(b) => {
            // Free memory only for a share of it (a size needs no device).
            let total = match b {
                Budget::Percent(_) => b.resolve(free()?),
                _ => b.resolve(0),
            };
            let off = reserved + fixed;
            if total <= off {
                bail!(
                    "--budget {b} ({:.3} GB) does not cover the KV cache and workspace ({:.3} GB) \
                     and the model's norms and biases ({:.3} GB); use a shorter --context or a \
                     larger budget",
                    total as f64 / 1e9,
                    reserved as f64 / 1e9,
                    fixed as f64 / 1e9
                );
            }
            Some(total)
        }
    };
    let tune = match &args.tune {
        Some(t) => Some(read_tune(t, target.device, device, args.force_tune)?),
        None if target.device.is_none() => bail!(
            "planning for a {device} device that is not here needs its latencies: pass --tune \
             TUNE.json made by `entrollm tune --device {device}` on it"
        ),
        None => None,
    };
    let measured = tune.is_some();
    let (table, latencies) = match measured {
        true => (None, "measured by `entrollm tune` (--tune)".to_string()),
        false => tune_data(target)?,
    };
    let tune = planner::tune_for(w, id, tune, device, table.as_ref())?;
    let made = match (lossy, budget) {
        (Some(offer), Some(b)) => plan_allowing_lossy(&tune, b, reserved + fixed, offer),
        _ => planner::plan_model(w, &tune, budget, reserved)
            .map(|plan| LossyPlan { plan, rate: None }),
    };
    let LossyPlan { mut plan, rate } = made.map_err(|e| {
        anyhow::anyhow!(
            "{e}{}",
            match &args.budget {
                Some(b) => format!(
                    " (--budget {b}: KV cache and workspace {:.3} GB and norms {:.3} GB come first)",
                    reserved as f64 / 1e9,
                    fixed as f64 / 1e9
                ),
                None => String::new(),
            }
        )
    })?;
    if !measured {
        plan.cost_model = match table {
            Some(_) => entrollm_tune::CostModel::TuneData,
            None => entrollm_tune::CostModel::Default,
        };
    }
    if args.budget.is_some() {
        print_summary(&plan, &mut std::io::stderr())?;
    }
    let within = match &args.budget {
        Some(b) => format!("--budget {b}"),
        None => "the default budget: the weights as the source stores them, capped by free memory"
            .into(),
    };
    eprintln!("{}", sentence(&plan, &within, &latencies));
    if let (Some(offer), Some(r)) = (lossy, rate) {
        eprintln!(
            "plan: the budget cannot be met losslessly: {} launches coded lossily ({}) at {r:.2} \
             bits a weight on average (the highest rate that fits; their latencies from the \
             default cost model)",
            offer.launches.len(),
            offer.variant
        );
    } else if lossy.is_some() {
        eprintln!("plan: the budget is met losslessly; no matrix is coded lossily");
    }
    Ok(LossyPlan { plan, rate })
}

/// The tune data shipped for `target`'s device, and where a plan's latencies come from in words;
/// `None` (the forms' cost model) where no shipped data covers the device.
fn tune_data(target: &Target) -> Result<(Option<Costs>, String)> {
    let class = match (target.kind, target.device) {
        (DeviceKind::Cpu, Some(d)) => DeviceClass::this_cpu(d.threads.unwrap_or(1)),
        (DeviceKind::Cpu, None) => DeviceClass::this_cpu(rayon::current_num_threads()),
        (DeviceKind::Cuda, Some(d)) => DeviceClass::gpu(&d.name),
        (DeviceKind::Cuda, None) => bail!("planning for a GPU that is not here needs --tune"),
    };
    let user = match entrollm_model::load::cache_root() {
        Some(root) => costs::user_for(&root.join("costs"), &class)?,
        None => None,
    };
    if let Some(c) = user {
        let what = format!(
            "your tune data for {class} ({}, measured on {})",
            c.name, c.table.measured_on
        );
        return Ok((Some(c), what));
    }
    Ok(match costs::shipped_for(&class)? {
        Some(c) => {
            let what = format!(
                "the tune data shipped for {class} ({}, measured on {})",
                c.name, c.table.measured_on
            );
            (Some(c), what)
        }
        None => (
            None,
            format!(
                "the forms' cost model (docs/forms.md): no tune data is shipped for {class} \
                 (shipped: {}); `entrollm tune` measures this model",
                match costs::shipped_devices() {
                    d if d.is_empty() => "none".to_string(),
                    d => d.join("; "),
                }
            ),
        ),
    })
}

/// The plan in one sentence: its forms and their bytes, the budget, the predicted speed and
/// where the latencies come from.
pub fn sentence(plan: &PlanFile, within: &str, latencies: &str) -> String {
    use std::collections::BTreeMap;
    let mut forms: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for c in &plan.choices {
        let kind = c.variant.split([':', ' ']).next().unwrap_or("");
        let name = match kind.is_empty() {
            true => c.form.clone(),
            false => format!("{} {kind}", c.form),
        };
        let e = forms.entry(name).or_default();
        e.0 += 1;
        e.1 += c.bytes;
    }
    let mut forms: Vec<_> = forms.into_iter().collect();
    forms.sort_by_key(|(_, (_, b))| std::cmp::Reverse(*b));
    let list: Vec<String> = forms
        .iter()
        .map(|(f, (n, b))| format!("{n} as {f} ({:.1} MB)", *b as f64 / 1e6))
        .collect();
    format!(
        "plan: {} launches: {}; weights {:.1} MB within {} ({:.1} MB in all, {:.1} MB of it \
         reserved for the KV cache, workspace and norms); predicted {:.1} tok/s, latencies from \
         {latencies}",
        plan.choices.len(),
        list.join(", "),
        plan.total_bytes as f64 / 1e6,
        within,
        plan.budget_bytes.unwrap_or(0) as f64 / 1e6,
        plan.reserved_bytes as f64 / 1e6,
        plan.predicted_tok_s,
    )
}

/// `w` re-formed by `plan`, with a progress bar.
pub fn apply(w: &ModelWeights, plan: &PlanFile) -> Result<ModelWeights> {
    let bar = progress::steps(plan.choices.len() as u64, "re-form");
    let out = planner::apply_plan(w, plan, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    Ok(out)
}

/// The plan's choices grouped by launch kind and form, and its totals.
pub fn print_summary(plan: &PlanFile, out: &mut dyn std::io::Write) -> Result<()> {
    use std::collections::BTreeMap;
    let mut groups: BTreeMap<(String, String, String), (usize, u64, f64)> = BTreeMap::new();
    for c in &plan.choices {
        let g = groups
            .entry((c.launch.clone(), c.form.clone(), c.variant.clone()))
            .or_default();
        g.0 += 1;
        g.1 += c.bytes;
        g.2 += c.latency_us;
    }
    writeln!(
        out,
        "{:<8} {:<6} {:<16} {:>6} {:>12} {:>10}",
        "launch", "form", "variant", "count", "MB", "µs each"
    )?;
    for ((launch, form, variant), (n, bytes, us)) in &groups {
        writeln!(
            out,
            "{launch:<8} {form:<6} {:<16} {n:>6} {:>12.3} {:>10.1}",
            if variant.is_empty() { "-" } else { variant },
            *bytes as f64 / 1e6,
            us / *n as f64
        )?;
    }
    let cert = plan.certificate.as_ref().map_or(String::new(), |c| {
        format!(
            "; certificate: LP bound {:.1} µs, gap {:.3} %, grid {} B",
            c.lp_bound_us,
            100.0 * c.gap,
            c.grid_bytes
        )
    });
    writeln!(
        out,
        "plan: weights {:.3} GB of launches{}, predicted {:.1} tok/s ({:.1} µs a step, {} cost model){cert}",
        plan.total_bytes as f64 / 1e9,
        plan.budget_bytes.map_or(String::new(), |b| format!(
            " (budget {:.3} GB, of which {:.3} GB reserved first)",
            b as f64 / 1e9,
            plan.reserved_bytes as f64 / 1e9
        )),
        plan.predicted_tok_s,
        plan.predicted_step_us,
        match plan.cost_model {
            entrollm_tune::CostModel::Measured => "measured",
            entrollm_tune::CostModel::TuneData => "tune data",
            entrollm_tune::CostModel::Default => "default",
        },
    )?;
    Ok(())
}
