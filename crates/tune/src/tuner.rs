//! `entrollm tune`: per launch, every form's variants (pruned by predicted size), timed on the
//! device, kept as the launch's size–latency Pareto front. On the GPU each candidate is timed on
//! its own with a cold-cache protocol; on the CPU inside the engine's own decode steps (see
//! [`StepProtocol`]).

use crate::file::{DeviceId, DeviceKind, LaunchTune, ModelId, Point, TuneFile};
use entrollm_model::coding_plan::Launch;
use entrollm_model::engine::Engine;
use entrollm_model::forms::layout::{launches, LaunchInstance};
use entrollm_model::forms::{self, Form, Source};
use entrollm_model::weights::{Linear, ModelWeights};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub type Result<T> = std::result::Result<T, crate::TuneError>;

pub(crate) fn err(m: impl std::fmt::Display) -> crate::TuneError {
    crate::TuneError::Tune(m.to_string())
}

/// The forms' device kind of a tune file's device.
pub fn forms_device(kind: DeviceKind) -> forms::DeviceKind {
    match kind {
        DeviceKind::Cpu => forms::DeviceKind::Cpu,
        DeviceKind::Cuda => forms::DeviceKind::Cuda,
    }
}

/// Times one launch: its matrices' batch-1 products, one after the other, cold.
pub trait LaunchTimer {
    fn device(&self) -> DeviceId;
    /// Median µs of the launch made of `make()`'s matrices (`make` builds a fresh copy each
    /// call, for copies that cover the caches), in `form`, `weights` weights and about
    /// `predicted_bytes` bytes: their batch-1 products, and with `gather` (the embedding) one row
    /// lookup of the first matrix.
    /// `None`: these forms have no kernel for this launch on this device (the point is left out).
    /// A form with several launch configurations on the device is timed in each, and the
    /// fastest is kept with its configuration.
    fn time(
        &self,
        launch: &TimedLaunch,
        make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
    ) -> Result<Option<Timing>>;
    /// A description of the protocol, for the tune file.
    fn protocol(&self) -> String;
    /// Whether `time` measures (false: a cost model).
    fn is_measured(&self) -> bool {
        true
    }
    /// The decode step's cost beyond its weight launches, µs, measured on this device with `w`
    /// in its current forms (`launches`: their tuned points); `None` where it cannot be measured.
    fn step_overhead_us(&self, _w: &ModelWeights, _launches: &[LaunchTune]) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Candidates are timed inside the CPU engine's decode steps with this protocol (and the
    /// step's cost beyond its launches measured in the same steps), not one by one with
    /// [`time`](Self::time).
    fn in_steps(&self) -> Option<StepProtocol> {
        None
    }
}

/// How candidates are timed inside the CPU engine's own decode steps. The launches of a shape
/// are put in the shape's candidates round robin over the layers (a shape with more candidates
/// than launches — the LM head — has its launches switch between several from step to step),
/// every launch's products are timed as the engine calls them, and greedy decode steps are run:
/// a candidate's latency is the median over the steps it ran in of its launches' mean, the
/// step's overhead the median of a step's wall time less all its launches. Timed so, a launch
/// pays what it pays in a real step — the thread pool's wake-ups, the caches as the rest of the
/// step leaves them, the forms of its neighbours — and all candidates see the machine at the
/// same moments, so a shared machine's slow phases move them together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepProtocol {
    /// Steps each candidate runs in, at least (after the prompt and two warm-up steps).
    pub min_steps: usize,
    /// Seconds of steps, at least (slow phases of a shared machine are averaged over).
    pub min_seconds: f64,
    /// Steps each candidate runs in, at most.
    pub max_steps: usize,
}

impl Default for StepProtocol {
    fn default() -> Self {
        StepProtocol {
            min_steps: 16,
            min_seconds: 2.0,
            max_steps: 256,
        }
    }
}

/// A launch timed in one form: median µs, and the launch configuration that took it (the
/// fastest of the form's on this device; `None` where the form has one launch).
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    pub us: f64,
    pub launch_config: Option<String>,
}

impl From<f64> for Timing {
    fn from(us: f64) -> Self {
        Timing {
            us,
            launch_config: None,
        }
    }
}

/// What is timed: a launch in one form.
pub struct TimedLaunch<'a> {
    /// Which launch of the decode step (the fusions it runs with).
    pub launch: Launch,
    pub form: &'a dyn Form,
    pub variant: &'a str,
    /// The values the launch holds, with its first matrix's layout (`ggml(Q4_1)`, `bf16`): what
    /// the tune data's latencies are keyed by besides the form.
    pub values: String,
    /// Matrices the launch multiplies.
    pub matrices: usize,
    pub weights: usize,
    pub predicted_bytes: f64,
    /// Products of all matrices but the first: the first is an embedding looked up (a tied LM
    /// head is both: its product and a lookup).
    pub products: bool,
    pub gather: bool,
}

/// The CPU timer. `tune` times inside the engine's decode steps ([`StepProtocol`], on the rayon
/// pool of the thread count given); [`LaunchTimer::time`] times one launch on its own (for
/// diagnostics): copies of the launch covering twice the last-level cache, products cycled
/// through them so none is cached, bursts of at least `burst_ms`, the median of `bursts` bursts'
/// mean time per launch.
pub struct CpuTimer {
    pub threads: usize,
    pub llc_bytes: usize,
    pub burst_ms: f64,
    pub bursts: usize,
    /// Most copies made (each is an encoding), whatever the cache.
    pub max_copies: usize,
    pub steps: StepProtocol,
}

impl CpuTimer {
    pub fn new(threads: usize) -> Self {
        CpuTimer {
            threads,
            llc_bytes: last_level_cache_bytes().unwrap_or(32 << 20),
            burst_ms: 20.0,
            bursts: 5,
            max_copies: 48,
            steps: StepProtocol::default(),
        }
    }
}

/// The largest data cache Linux reports for CPU 0.
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()? {
        let p = e.ok()?.path();
        let kind = std::fs::read_to_string(p.join("type")).unwrap_or_default();
        if kind.trim() == "Instruction" {
            continue;
        }
        let size = std::fs::read_to_string(p.join("size")).unwrap_or_default();
        let size = size.trim();
        let bytes = if let Some(k) = size.strip_suffix('K') {
            k.parse::<usize>().ok()? << 10
        } else if let Some(m) = size.strip_suffix('M') {
            m.parse::<usize>().ok()? << 20
        } else {
            size.parse().ok()?
        };
        best = best.max(Some(bytes));
    }
    best
}

/// CPU model name from /proc/cpuinfo.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn run_launch(ms: &[Arc<dyn Linear>], xs: &[Vec<f32>], ys: &mut [Vec<f32>]) {
    for ((m, x), y) in ms.iter().zip(xs).zip(ys.iter_mut()) {
        m.matvec(x, y);
    }
}

impl LaunchTimer for CpuTimer {
    fn device(&self) -> DeviceId {
        DeviceId {
            kind: DeviceKind::Cpu,
            name: cpu_name(),
            threads: Some(self.threads),
            sm_count: None,
            driver: None,
        }
    }
    fn protocol(&self) -> String {
        format!(
            "cpu: inside the engine's greedy decode steps, each launch in one of its shape's \
             candidates (round robin over the layers; switched per step where they outnumber \
             the launches), products timed as the engine calls them; median over >= {} steps \
             each and >= {} s of a candidate's mean over its launches; step overhead the median \
             of a step less its launches; {} threads",
            self.steps.min_steps, self.steps.min_seconds, self.threads
        )
    }
    fn in_steps(&self) -> Option<StepProtocol> {
        Some(self.steps)
    }
    fn time(
        &self,
        launch: &TimedLaunch,
        make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
    ) -> Result<Option<Timing>> {
        let first = make()?;
        let gather_us = match launch.gather {
            true => time_gather(&first[0], self.bursts),
            false => 0.0,
        };
        if !launch.products {
            return Ok(Some(gather_us.into()));
        }
        let bytes: usize = first.iter().map(|m| m.stored_bytes()).sum::<usize>().max(1);
        let copies = (2 * self.llc_bytes)
            .div_ceil(bytes)
            .clamp(1, self.max_copies);
        let mut sets = vec![first];
        for _ in 1..copies {
            sets.push(make()?);
        }
        let xs: Vec<Vec<f32>> = sets[0]
            .iter()
            .map(|m| {
                (0..m.cols())
                    .map(|i| ((i * 7919) % 13) as f32 * 0.01 - 0.06)
                    .collect()
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = sets[0].iter().map(|m| vec![0f32; m.rows()]).collect();
        // Warm-up: page in every copy once.
        for s in &sets {
            run_launch(s, &xs, &mut ys);
        }
        let mut means = Vec::with_capacity(self.bursts);
        let mut next = 0usize;
        for _ in 0..self.bursts {
            let t0 = Instant::now();
            let mut n = 0usize;
            while n == 0 || t0.elapsed().as_secs_f64() * 1e3 < self.burst_ms {
                run_launch(&sets[next], &xs, &mut ys);
                next = (next + 1) % sets.len();
                n += 1;
            }
            means.push(t0.elapsed().as_secs_f64() * 1e6 / n as f64);
        }
        means.sort_by(f64::total_cmp);
        Ok(Some((means[means.len() / 2] + gather_us).into()))
    }
    fn step_overhead_us(&self, w: &ModelWeights, launches: &[LaunchTune]) -> Result<Option<f64>> {
        let Some(weights_us) = current_forms_us(w, launches) else {
            return Ok(None);
        };
        let step = measure_step_us(w, 24)?;
        Ok(Some((step - weights_us).max(0.0)))
    }
}

/// The sum of the tuned latencies of `w`'s launches in their current forms, if each was timed.
pub fn current_forms_us(w: &ModelWeights, launches: &[LaunchTune]) -> Option<f64> {
    let mut total = 0.0;
    for inst in entrollm_model::forms::layout::launches(w) {
        let l = launches.iter().find(|l| l.id == inst.id)?;
        let id = inst.matrices[0].form();
        let p = l
            .points
            .iter()
            .find(|p| p.form == id.form && p.variant == id.variant)?;
        total += p.latency_us;
    }
    Some(total)
}

/// Median µs of one row lookup (the embedding's work in a decode step), over rows spread across
/// the matrix.
fn time_gather(m: &Arc<dyn Linear>, bursts: usize) -> f64 {
    let mut row = vec![0f32; m.cols()];
    let mut per = Vec::with_capacity(bursts);
    let mut r = 12345usize;
    for _ in 0..bursts {
        let t0 = Instant::now();
        let n = 16;
        for _ in 0..n {
            r = (r * 1_103_515_245 + 12_345) % m.rows();
            m.row(r, &mut row);
        }
        per.push(t0.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    per.sort_by(f64::total_cmp);
    per[per.len() / 2]
}

/// Timings per shape key: (form, variant) → (timing, id of the launch timed).
type Timings = BTreeMap<String, BTreeMap<(String, String), (Timing, String)>>;

/// What the tuner reports as it goes.
pub enum Progress<'a> {
    /// `done` of `total` variants timed; `what` is being timed now.
    Timing {
        done: usize,
        total: usize,
        what: &'a str,
    },
    /// A launch shape already in the tune file (resumed).
    Reused { shape: &'a str },
}

/// Options of one tuning run.
pub struct TuneOptions {
    /// Time at most this many variants of each form per launch shape (the smallest predicted).
    pub max_variants_per_form: usize,
    /// Measure the decode step's non-weight cost with the CPU engine.
    pub step_overhead: bool,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            max_variants_per_form: 12,
            step_overhead: true,
        }
    }
}

/// A point of a launch before its latency is known.
struct Planned {
    form: &'static dyn Form,
    variant: String,
}

/// Candidates for a launch shape: the current forms of its launches as they are (a container's
/// launches of one shape may be coded differently), and every accepting form's variants (chosen
/// on the representative's first matrix, the same for all of the launch).
fn candidates(
    rep: &LaunchInstance,
    members: &[&LaunchInstance],
    opts: &TuneOptions,
    device: forms::DeviceKind,
) -> Result<Vec<Planned>> {
    // Variants are chosen on a sample of a large matrix's rows, as their sizes are predicted.
    let sampled = |m: &Arc<dyn Linear>| -> Result<Source> {
        Ok(forms::size_source(&**m, forms::SIZE_SAMPLE_WEIGHTS)
            .map_err(err)?
            .0)
    };
    let src = sampled(&rep.matrices[0])?;
    let others: Vec<_> = rep.matrices[1..]
        .iter()
        .map(sampled)
        .collect::<Result<_>>()?;
    let mut out: Vec<Planned> = Vec::new();
    for m in members {
        let current = m.matrices[0].form();
        let current_form = forms::by_name(current.form).map_err(err)?;
        let seen = out
            .iter()
            .any(|p| p.form.name() == current.form && p.variant == current.variant);
        // (A launch whose matrices are held in different forms, a GGUF's q/k/v of different
        // block types, is "as held" under its first matrix's form: `layout::apply` keeps it.)
        if current_form.runs_on(device) && !seen {
            out.push(Planned {
                form: current_form,
                variant: current.variant.clone(),
            });
        }
    }
    for form in forms::all() {
        if !form.runs_on(device) || !form.accepts(&src) || !others.iter().all(|s| form.accepts(s)) {
            continue;
        }
        // The user chose the variant this form's matrices are held in (`--activations q8`):
        // no other of its variants.
        if form.held_variant_chosen() && out.iter().any(|p| p.form.name() == form.name()) {
            continue;
        }
        let mut vs = form.variants(&src).map_err(err)?;
        vs.sort_by(|a, b| a.predicted_bytes.total_cmp(&b.predicted_bytes));
        for c in vs.into_iter().take(opts.max_variants_per_form) {
            if out
                .iter()
                .any(|p| p.form.name() == form.name() && p.variant == c.variant)
            {
                continue;
            }
            out.push(Planned {
                form: *form,
                variant: c.variant,
            });
        }
    }
    Ok(out)
}

/// A launch's matrices decoded once, for the size of each of its candidates: a large matrix as
/// a sample of its rows and the factor that scales a size predicted on it
/// ([`forms::size_source`]), a small one whole (factor 1).
struct LaunchSources {
    srcs: Vec<(Source, f64)>,
    /// Bytes each matrix's wrappers (row scales, row order) add beside its inner values.
    wraps: Vec<f64>,
}

impl LaunchSources {
    fn of(inst: &LaunchInstance) -> Result<Self> {
        let srcs = inst
            .matrices
            .iter()
            .map(|m| forms::size_source(&**m, forms::SIZE_SAMPLE_WEIGHTS).map_err(err))
            .collect::<Result<_>>()?;
        let wraps = inst
            .matrices
            .iter()
            .map(|m| m.wrapper_bytes() as f64)
            .collect();
        Ok(LaunchSources { srcs, wraps })
    }

    /// Bytes of `inst` in `form`/`variant`: exact where a matrix is in that form already, else
    /// predicted; the launch as held where its first matrix is held in it (`layout::apply`
    /// keeps such a launch whole).
    fn bytes(&self, inst: &LaunchInstance, form: &dyn Form, variant: &str) -> Result<u64> {
        let first = inst.matrices[0].form();
        if first.form == form.name() && first.variant == variant {
            return Ok(inst.stored_bytes() as u64);
        }
        let mut total = 0f64;
        for ((m, (src, scale)), wrap) in inst.matrices.iter().zip(&self.srcs).zip(&self.wraps) {
            let id = m.form();
            total += if id.form == form.name() && id.variant == variant {
                m.stored_bytes() as f64
            } else {
                form.predict(src, variant).map_err(err)? * scale + wrap
            };
        }
        Ok(total.round() as u64)
    }
}

/// Tunes every launch of `w` on `timer`'s device. Launch shapes whose points `resume` already
/// holds (same shape key, same device) are not measured again.
pub fn tune(
    w: &ModelWeights,
    model: ModelId,
    resume: Option<&TuneFile>,
    timer: &dyn LaunchTimer,
    opts: &TuneOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<TuneFile> {
    let all = launches(w);
    let mut by_shape: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, l) in all.iter().enumerate() {
        by_shape.entry(l.shape_key()).or_default().push(i);
    }
    let mut timed: Timings = BTreeMap::new();
    if let Some(r) = resume {
        for l in &r.launches {
            let t = timed.entry(l.shape_key.clone()).or_default();
            for p in &l.points {
                let who = p.timed_as.clone().unwrap_or_else(|| l.id.clone());
                let timing = Timing {
                    us: p.latency_us,
                    launch_config: p.launch_config.clone(),
                };
                t.insert((p.form.clone(), p.variant.clone()), (timing, who));
            }
        }
    }
    // Each shape's candidates (their variants chosen from histograms), the shapes in parallel.
    let device = forms_device(timer.device().kind);
    let plan: Vec<(String, usize, Vec<Planned>)> = by_shape
        .par_iter()
        .map(|(key, members)| {
            let rep = &all[members[0]];
            let insts: Vec<&LaunchInstance> = members.iter().map(|&i| &all[i]).collect();
            let c = candidates(rep, &insts, opts, device)?;
            Ok((key.clone(), members[0], c))
        })
        .collect::<Result<_>>()?;
    let total: usize = plan
        .iter()
        .map(|(k, _, c)| {
            c.iter()
                .filter(|p| !has(&timed, k, p.form.name(), &p.variant))
                .count()
        })
        .sum();
    let mut done = 0;
    let mut in_step_overhead = None;
    if let Some(protocol) = timer.in_steps() {
        let groups: Vec<StepGroup> = plan
            .iter()
            .filter_map(|(key, _, cands)| {
                let todo: Vec<&Planned> = cands
                    .iter()
                    .filter(|p| !has(&timed, key, p.form.name(), &p.variant))
                    .collect();
                match todo.is_empty() {
                    true => {
                        progress(Progress::Reused { shape: key });
                        None
                    }
                    false => Some(StepGroup {
                        key: key.clone(),
                        members: by_shape[key].clone(),
                        cands: todo,
                    }),
                }
            })
            .collect();
        if !groups.is_empty() {
            let r = time_in_steps(w, &all, &groups, protocol, progress)?;
            for (key, t) in r.timings {
                timed.entry(key).or_default().extend(t);
            }
            in_step_overhead = r.overhead_us;
        }
        done = total;
    }
    for (key, rep, cands) in plan.iter().filter(|_| timer.in_steps().is_none()) {
        let rep = &all[*rep];
        if cands
            .iter()
            .all(|p| has(&timed, key, p.form.name(), &p.variant))
        {
            progress(Progress::Reused { shape: key });
            continue;
        }
        let sources = LaunchSources::of(rep)?;
        for p in cands {
            if has(&timed, key, p.form.name(), &p.variant) {
                continue;
            }
            let what = format!("{} {} {}", rep.id, p.form.name(), p.variant);
            progress(Progress::Timing {
                done,
                total,
                what: &what,
            });
            // A candidate the representative cannot hold (the form another launch of the shape
            // is held in: an F16 among BF16 launches) is timed on a launch that holds it.
            let (inst, bytes) = match sources.bytes(rep, p.form, &p.variant) {
                Ok(b) => (rep, b),
                Err(e) => {
                    let holder = by_shape[key].iter().map(|&i| &all[i]).find(|l| {
                        let f = l.matrices[0].form();
                        f.form == p.form.name() && f.variant == p.variant
                    });
                    let Some(h) = holder else { return Err(e) };
                    (h, h.stored_bytes() as u64)
                }
            };
            let first = inst.matrices[0].form();
            let as_held = first.form == p.form.name() && first.variant == p.variant;
            let make = || -> Result<Vec<Arc<dyn Linear>>> {
                inst.matrices
                    .iter()
                    .map(|m| match as_held && m.form() != first {
                        // A launch of mixed forms as held: its other matrices as they are.
                        true => Ok(Arc::clone(m)),
                        false => fresh(m, p.form, &p.variant),
                    })
                    .collect()
            };
            let weights: usize = inst.matrices.iter().map(|m| m.rows() * m.cols()).sum();
            let launch = TimedLaunch {
                launch: inst.launch,
                form: p.form,
                variant: &p.variant,
                values: crate::costs::values_of_shape_key(key),
                matrices: inst.matrices.len(),
                weights,
                predicted_bytes: bytes as f64,
                products: inst.launch != Launch::Embed,
                gather: matches!(inst.launch, Launch::Embed)
                    || (inst.launch == Launch::LmHead && inst.tensors.len() == 2),
            };
            let Some(timing) = timer.time(&launch, &make)? else {
                done += 1;
                continue;
            };
            timed.entry(key.clone()).or_default().insert(
                (p.form.name().to_string(), p.variant.clone()),
                (timing, inst.id.clone()),
            );
            done += 1;
        }
    }
    progress(Progress::Timing {
        done,
        total,
        what: "sizes",
    });
    let mut out = Vec::with_capacity(all.len());
    // Launches of the same matrices (a synthetic model's layers share layer 0's) have the same
    // sizes: predicted once.
    let mut sizes: BTreeMap<(String, Vec<usize>), Vec<Option<u64>>> = BTreeMap::new();
    // Without measurements (a plan at load from predicted sizes), a launch's candidates are sized
    // as its shape's first launch's, scaled by their sizes as held: predicting every launch
    // would read the whole model once per candidate at every load.
    type Sized = (forms::FormId, u64, Vec<Option<u64>>);
    let mut first_of_shape: BTreeMap<String, Sized> = BTreeMap::new();
    let predicted_only = !timer.is_measured();
    // The sizes of each shape's first launch, the shapes in parallel.
    let firsts: Vec<&LaunchInstance> = by_shape
        .iter()
        .filter(|(key, _)| timed.contains_key(*key))
        .map(|(_, members)| &all[members[0]])
        .collect();
    let first_sizes = firsts
        .par_iter()
        .map(|l| launch_sizes(l, &timed[&l.shape_key()]))
        .collect::<Result<Vec<_>>>()?;
    for (l, v) in firsts.iter().zip(first_sizes) {
        sizes.insert((l.shape_key(), matrix_ptrs(l)), v);
    }
    for l in &all {
        let key = l.shape_key();
        // No form has a kernel for this launch on this device (a GGUF's token embedding on the
        // GPU): it is left out, and served as the model builder serves it.
        let Some(t) = timed.get(&key) else {
            continue;
        };
        let ptrs = matrix_ptrs(l);
        let held = l.stored_bytes() as u64;
        let id = l.matrices[0].form();
        let scaled = first_of_shape
            .get(&key)
            .filter(|(rep_id, _, _)| predicted_only && *rep_id == id)
            .map(|(_, rep_held, rep)| {
                t.keys()
                    .zip(rep)
                    .map(
                        |((form, variant), b)| match *form == id.form && *variant == id.variant {
                            true => Some(held),
                            false => b.map(|b| {
                                (b as f64 * held as f64 / *rep_held as f64).round() as u64
                            }),
                        },
                    )
                    .collect::<Vec<_>>()
            });
        let bytes = match (scaled, sizes.entry((key.clone(), ptrs))) {
            (Some(v), _) => v,
            (None, std::collections::btree_map::Entry::Occupied(e)) => e.get().clone(),
            (None, std::collections::btree_map::Entry::Vacant(e)) => {
                e.insert(launch_sizes(l, t)?).clone()
            }
        };
        first_of_shape
            .entry(key.clone())
            .or_insert_with(|| (id, held.max(1), bytes.clone()));
        let mut points = Vec::new();
        for (((form, variant), (timing, who)), bytes) in t.iter().zip(bytes) {
            let Some(bytes) = bytes else {
                continue;
            };
            points.push(Point {
                form: form.clone(),
                variant: variant.clone(),
                bytes,
                latency_us: timing.us,
                timed_as: (who != &l.id).then(|| who.clone()),
                pareto: false,
                launch_config: timing.launch_config.clone(),
            });
        }
        let (rows, cols) = (
            l.matrices.iter().map(|m| m.rows()).sum(),
            l.matrices[0].cols(),
        );
        let mut lt = LaunchTune {
            id: l.id.clone(),
            launch: l.launch.name().to_string(),
            tensors: l.tensors.clone(),
            rows,
            cols,
            shape_key: key,
            points,
        };
        lt.mark_pareto();
        out.push(lt);
    }
    let step_overhead_us = match (
        opts.step_overhead,
        in_step_overhead,
        resume.and_then(|r| r.step_overhead_us),
    ) {
        (false, _, _) => None,
        // Measured in the steps just run: the newest figure.
        (true, Some(v), _) => Some(v),
        (true, None, Some(v)) => Some(v),
        (true, None, None) => timer.step_overhead_us(w, &out)?,
    };
    let mut tf = TuneFile::new(timer.device(), model, timer.protocol());
    tf.step_overhead_us = step_overhead_us;
    tf.launches = out;
    Ok(tf)
}

/// The matrices of a launch by address (launches of the same matrices have the same sizes).
fn matrix_ptrs(l: &LaunchInstance) -> Vec<usize> {
    l.matrices
        .iter()
        .map(|m| Arc::as_ptr(m) as *const () as usize)
        .collect()
}

/// The bytes of `l` in each of its shape's timed points (`None`: a form that does not accept it).
fn launch_sizes(
    l: &LaunchInstance,
    t: &BTreeMap<(String, String), (Timing, String)>,
) -> Result<Vec<Option<u64>>> {
    let sources = LaunchSources::of(l)?;
    let mut v = Vec::with_capacity(t.len());
    for (form, variant) in t.keys() {
        let f = forms::by_name(form).map_err(err)?;
        // A point resumed from another model's launch of this shape still needs this launch's
        // own size; a form that no longer accepts it is left out.
        v.push(sources.bytes(l, f, variant).ok());
    }
    Ok(v)
}

fn has(timed: &Timings, key: &str, form: &str, variant: &str) -> bool {
    timed
        .get(key)
        .is_some_and(|t| t.contains_key(&(form.to_string(), variant.to_string())))
}

/// One launch shape's candidates still to time inside decode steps, and its launches.
struct StepGroup<'a> {
    key: String,
    /// Indices into the model's launches.
    members: Vec<usize>,
    cands: Vec<&'a Planned>,
}

/// What timing in decode steps measured.
struct InStep {
    timings: Timings,
    overhead_us: Option<f64>,
}

/// A launch's matrix in the tuner's decode steps: one of its candidates' matrices, the one of the
/// current step (`step` modulo their number), whose products and row lookups add their time to
/// the launch's counter.
struct Switched {
    options: Vec<Arc<dyn Linear>>,
    step: Arc<AtomicU64>,
    counter: Arc<AtomicU64>,
}

impl Switched {
    fn active(&self) -> &Arc<dyn Linear> {
        let s = self.step.load(Ordering::Relaxed) as usize;
        &self.options[s % self.options.len()]
    }
    fn count<T>(&self, f: impl FnOnce(&dyn Linear) -> T) -> T {
        let t = Instant::now();
        let r = f(&**self.active());
        self.counter
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl Linear for Switched {
    fn rows(&self) -> usize {
        self.options[0].rows()
    }
    fn cols(&self) -> usize {
        self.options[0].cols()
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.count(|m| m.matvec(x, y))
    }
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.count(|m| m.matmul(x, n, y))
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.count(|m| m.row(r, out))
    }
    fn stored_bytes(&self) -> usize {
        self.active().stored_bytes()
    }
    fn wrapper_bytes(&self) -> usize {
        self.active().wrapper_bytes()
    }
    fn form(&self) -> forms::FormId {
        self.active().form()
    }
    fn source(&self) -> entrollm_model::Result<Source> {
        self.active().source()
    }
    fn source_rows(&self, rows: &[usize]) -> entrollm_model::Result<Source> {
        self.active().source_rows(rows)
    }
    fn values_kind(&self) -> &'static str {
        self.active().values_kind()
    }
    fn layout_tag(&self) -> Option<&'static str> {
        self.active().layout_tag()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `w` with launch `i`'s matrices switching between `options[i]` (per matrix of the launch, one
/// matrix per option) and counting into `counters[i]`.
fn switched_weights(
    w: &ModelWeights,
    options: &[Vec<Vec<Arc<dyn Linear>>>],
    counters: &[Arc<AtomicU64>],
    step: &Arc<AtomicU64>,
) -> ModelWeights {
    let ids: BTreeMap<String, usize> = launches(w)
        .into_iter()
        .enumerate()
        .map(|(i, l)| (l.id, i))
        .collect();
    let wrap = |id: &str, matrix: usize| -> Arc<dyn Linear> {
        let i = ids[id];
        Arc::new(Switched {
            options: options[i].iter().map(|o| Arc::clone(&o[matrix])).collect(),
            step: Arc::clone(step),
            counter: Arc::clone(&counters[i]),
        })
    };
    let tied = Arc::ptr_eq(&w.embed, &w.lm_head);
    let lm_head = wrap("lm_head", 0);
    let embed = match tied {
        true => Arc::clone(&lm_head),
        false => wrap("embed", 0),
    };
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let id = |s: &str| format!("layers.{i}.{s}");
            l.map_matrices(|launch, j, _| Ok::<_, ()>(wrap(&id(launch), j)))
                .expect("wrapping cannot fail")
        })
        .collect();
    ModelWeights {
        config: w.config.clone(),
        embed,
        layers,
        final_norm: w.final_norm.clone(),
        lm_head,
    }
}

fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// Times `groups`' candidates inside greedy decode steps of the CPU engine on `w` (see
/// [`StepProtocol`]): launch `j` of a shape with `C` candidates and `M` launches holds the
/// candidates `c ≡ j (mod M)` and switches between them from step to step, so each candidate
/// is made once and all of them run in the same stretch of steps.
fn time_in_steps(
    w: &ModelWeights,
    all: &[LaunchInstance],
    groups: &[StepGroup],
    protocol: StepProtocol,
    progress: &mut dyn FnMut(Progress),
) -> Result<InStep> {
    use entrollm_model::forms::layout::{apply, LaunchForm};
    // Per launch, the candidates it holds as (group, candidate); launches of shapes with nothing
    // to time hold their current form only.
    let mut holds: Vec<Vec<(usize, usize)>> = vec![Vec::new(); all.len()];
    for (gi, g) in groups.iter().enumerate() {
        for c in 0..g.cands.len() {
            holds[g.members[c % g.members.len()]].push((gi, c));
        }
        // Every launch of the shape takes part (the first candidates again where there are
        // fewer candidates than launches): more samples, and a step of the shape's real mix.
        for (j, &m) in g.members.iter().enumerate().skip(g.cands.len()) {
            holds[m].push((gi, j % g.cands.len()));
        }
    }
    let depth = holds.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let total: usize = groups.iter().map(|g| g.cands.len()).sum();
    // The k-th option of every launch, made by re-forming the model once per depth k.
    let mut options: Vec<Vec<Vec<Arc<dyn Linear>>>> = vec![Vec::new(); all.len()];
    for k in 0..depth {
        let what = format!("making the candidates ({} of {depth})", k + 1);
        progress(Progress::Timing {
            done: 0,
            total,
            what: &what,
        });
        let choices: BTreeMap<String, LaunchForm> = holds
            .iter()
            .enumerate()
            .filter_map(|(m, h)| {
                let &(gi, c) = h.get(k)?;
                let p = groups[gi].cands[c];
                Some((
                    all[m].id.clone(),
                    LaunchForm {
                        form: p.form.name().to_string(),
                        variant: p.variant.clone(),
                    },
                ))
            })
            .collect();
        let formed = apply(w, &choices, &|_, _| {}).map_err(err)?;
        for (m, l) in launches(&formed).into_iter().enumerate() {
            if k < holds[m].len() || k == 0 {
                options[m].push(l.matrices);
            }
        }
    }
    let counters: Vec<Arc<AtomicU64>> = (0..all.len())
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let step = Arc::new(AtomicU64::new(0));
    let model = switched_weights(w, &options, &counters, &step);
    drop(options);
    let warmup = 2;
    // Each candidate is active one step in `depth`: as many steps again for its samples.
    let (min_steps, max_steps) = (
        protocol.min_steps * depth,
        protocol.max_steps.max(protocol.min_steps) * depth,
    );
    // The context is started again when full, so attention stays at a chat's lengths.
    let context = (8 + warmup + protocol.max_steps).min(w.config.max_position_embeddings);
    let mut e = Engine::new(Arc::new(model), context).map_err(err)?;
    e.one_launch_at_a_time();
    let prompt: Vec<u32> = (1..9).collect();
    let mut logits = e.prefill(&prompt).map_err(err)?;
    let mut samples: BTreeMap<(usize, usize), (Vec<f64>, usize)> = BTreeMap::new();
    let mut overheads = Vec::new();
    let t_run = Instant::now();
    let mut steps = 0;
    for n in 0.. {
        let measuring = n >= warmup;
        if measuring
            && (steps >= max_steps
                || (steps >= min_steps && t_run.elapsed().as_secs_f64() >= protocol.min_seconds))
        {
            break;
        }
        if measuring && steps % 8 == 0 {
            let what = format!("decode steps ({steps} of at least {min_steps})");
            progress(Progress::Timing {
                done: (total * steps / min_steps).min(total.saturating_sub(1)),
                total,
                what: &what,
            });
        }
        if e.position() + 1 >= e.max_seq_len() {
            e.reset();
            logits = e.prefill(&prompt).map_err(err)?;
        }
        step.store(n as u64, Ordering::Relaxed);
        for c in &counters {
            c.store(0, Ordering::Relaxed);
        }
        let t0 = Instant::now();
        let tok = entrollm_model::sampler::argmax(&logits).unwrap_or(0);
        logits = e.step(tok).map_err(err)?;
        let wall = t0.elapsed().as_secs_f64() * 1e6;
        if !measuring {
            continue;
        }
        steps += 1;
        let us: Vec<f64> = counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as f64 / 1e3)
            .collect();
        overheads.push((wall - us.iter().sum::<f64>()).max(0.0));
        // Per candidate active in this step: the mean over the launches holding it.
        let mut per: BTreeMap<(usize, usize), (f64, usize, usize)> = BTreeMap::new();
        for (m, h) in holds.iter().enumerate() {
            if h.is_empty() {
                continue;
            }
            let e = per.entry(h[n % h.len()]).or_insert((0.0, 0, m));
            e.0 += us[m];
            e.1 += 1;
        }
        for (key, (sum, count, first)) in per {
            samples
                .entry(key)
                .or_insert_with(|| (Vec::new(), first))
                .0
                .push(sum / count as f64);
        }
    }
    let mut timings: Timings = BTreeMap::new();
    for ((gi, c), (mut v, first)) in samples {
        let (g, p) = (&groups[gi], groups[gi].cands[c]);
        if let Some(us) = median(&mut v) {
            timings.entry(g.key.clone()).or_default().insert(
                (p.form.name().to_string(), p.variant.clone()),
                (Timing::from(us.max(1e-3)), all[first].id.clone()),
            );
        }
    }
    Ok(InStep {
        timings,
        overhead_us: median(&mut overheads),
    })
}

/// A new copy of `m` in `form`/`variant` (its current form is re-encoded too, so copies are
/// distinct memory). A form no source can be encoded into (`lossy`) is timed as it is held.
fn fresh(m: &Arc<dyn Linear>, form: &dyn Form, variant: &str) -> Result<Arc<dyn Linear>> {
    let held = m.form();
    m.reform(&|src| forms::encode_checked(form, src, variant))
        .or_else(
            |e| match held.form == form.name() && held.variant == variant {
                true => Ok(Arc::clone(m)),
                false => Err(e),
            },
        )
        .map_err(err)
}

/// Median µs of a greedy decode step of the CPU engine on `w` after a short prompt.
pub fn measure_step_us(w: &ModelWeights, steps: usize) -> Result<f64> {
    let shared = Arc::new(clone_weights(w));
    let mut e = Engine::new(shared, 64 + steps).map_err(err)?;
    e.one_launch_at_a_time();
    let prompt: Vec<u32> = (1..9).collect();
    let mut logits = e.prefill(&prompt).map_err(err)?;
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let tok = entrollm_model::sampler::argmax(&logits).unwrap_or(0);
        let t0 = Instant::now();
        logits = e.step(tok).map_err(err)?;
        times.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn clone_weights(w: &ModelWeights) -> ModelWeights {
    entrollm_model::forms::layout::apply(w, &BTreeMap::new(), &|_, _| {})
        .expect("the same weights validate")
}

#[cfg(test)]
mod tests {
    use super::*;
    use entrollm_model::synth::{fill_tensor_16, tensors, SynthDtype, SynthShape};
    use entrollm_model::{HostTensor, TensorSource};

    /// The synthetic tiny model (2 layers, untied head), BF16, in memory.
    struct Tiny;
    impl TensorSource for Tiny {
        fn config(&self) -> entrollm_model::Result<entrollm_model::ModelConfig> {
            Ok(SynthShape::Tiny.config())
        }
        fn tensor(&self, name: &str) -> entrollm_model::Result<Option<HostTensor>> {
            let all = tensors(&SynthShape::Tiny.config());
            Ok(all.iter().find(|t| t.name == name).map(|t| {
                let mut b = vec![0u8; 2 * t.numel()];
                fill_tensor_16(t, 7, SynthDtype::Bf16, &mut b);
                HostTensor::Bf16 {
                    shape: t.shape.clone(),
                    data: b
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                }
            }))
        }
    }

    /// Every candidate of every shape is timed inside decode steps — the LM head's, which
    /// outnumber its one launch, too — each by one launch of its shape that the others name, and
    /// the step's overhead is measured in the same steps.
    #[test]
    fn candidates_are_timed_inside_decode_steps() {
        let w = entrollm_model::build_model(&Tiny).unwrap();
        let id = crate::planner::model_id(&w, "tiny").unwrap();
        let mut timer = CpuTimer::new(1);
        timer.steps = StepProtocol {
            min_steps: 3,
            min_seconds: 0.0,
            max_steps: 3,
        };
        let opts = TuneOptions {
            max_variants_per_form: 2,
            step_overhead: true,
        };
        let mut shown = Vec::new();
        let t = tune(&w, id, None, &timer, &opts, &mut |p| {
            if let Progress::Timing { what, .. } = p {
                shown.push(what.to_string())
            }
        })
        .unwrap();
        assert!(
            shown.iter().any(|s| s.contains("decode steps")),
            "{shown:?}"
        );
        assert!(t.step_overhead_us.is_some_and(|o| o > 0.0));
        assert!(t
            .protocol
            .contains("inside the engine's greedy decode steps"));
        let mut by_shape: BTreeMap<&str, Vec<&LaunchTune>> = BTreeMap::new();
        for l in &t.launches {
            by_shape.entry(&l.shape_key).or_default().push(l);
            assert!(l.points.iter().all(|p| p.latency_us > 0.0));
            let forms: std::collections::BTreeSet<&str> =
                l.points.iter().map(|p| p.form.as_str()).collect();
            if l.launch != "embed" {
                assert!(forms.contains("dense") && forms.contains("dtans"), "{l:?}");
            }
        }
        let head = t.launches.iter().find(|l| l.id == "lm_head").unwrap();
        assert!(head.points.len() >= 3, "{head:?}");
        for (key, ls) in by_shape {
            for (i, p) in ls[0].points.iter().enumerate() {
                let own: Vec<&str> = ls
                    .iter()
                    .filter(|l| l.points[i].timed_as.is_none())
                    .map(|l| l.id.as_str())
                    .collect();
                assert_eq!(own.len(), 1, "{key} {} {}: {own:?}", p.form, p.variant);
                assert!(ls
                    .iter()
                    .all(|l| l.points[i].timed_as.as_deref().is_none_or(|w| w == own[0])));
            }
        }
    }

    /// A timer that builds each candidate (as the GPU's uploads it) and prices it by its bytes.
    struct Building;
    impl LaunchTimer for Building {
        fn device(&self) -> DeviceId {
            crate::planner::DefaultCost {
                device: DeviceKind::Cuda,
                table: None,
            }
            .device()
        }
        fn protocol(&self) -> String {
            "test: built, priced by bytes".into()
        }
        fn time(
            &self,
            _l: &TimedLaunch,
            make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
        ) -> Result<Option<Timing>> {
            let bytes: usize = make()?.iter().map(|m| m.stored_bytes()).sum();
            Ok(Some((1.0 + bytes as f64 * 1e-3).into()))
        }
    }

    /// A launch that no form can be timed for on the device is left out of the tune (the
    /// others are all there), not a panic.
    #[test]
    fn a_launch_no_form_times_is_left_out() {
        struct NoEmbed;
        impl LaunchTimer for NoEmbed {
            fn device(&self) -> DeviceId {
                Building.device()
            }
            fn protocol(&self) -> String {
                "test: no embedding kernel".into()
            }
            fn time(
                &self,
                l: &TimedLaunch,
                make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
            ) -> Result<Option<Timing>> {
                match l.launch {
                    Launch::Embed => Ok(None),
                    _ => Building.time(l, make),
                }
            }
        }
        let w = entrollm_model::build_model(&Tiny).unwrap();
        let id = crate::planner::model_id(&w, "tiny").unwrap();
        let opts = TuneOptions {
            max_variants_per_form: 1,
            step_overhead: false,
        };
        let t = tune(&w, id, None, &NoEmbed, &opts, &mut |_| {}).unwrap();
        let all = entrollm_model::forms::layout::launches(&w);
        assert!(t.launches.iter().all(|l| l.launch != "embed"));
        assert_eq!(
            t.launches.len(),
            all.iter().filter(|l| l.launch != Launch::Embed).count()
        );
        assert!(t.launches.iter().all(|l| !l.points.is_empty()));
    }

    /// A model whose down projections are lossy-coded: each is timed as held (nothing can be
    /// encoded into `lossy`) beside the lossless forms of its reconstruction.
    #[test]
    fn lossy_launches_are_timed_as_held_beside_their_reconstructions() {
        use entrollm_codec::lossy::{LossyTensor, Options, Quantizer};
        use entrollm_format::coded::LossyCoded;
        use entrollm_model::forms::lossy::LossyLinear;
        let mut w = entrollm_model::build_model(&Tiny).unwrap();
        for l in &mut w.layers {
            let entrollm_model::weights::Mlp::Gated(mlp) = &mut l.mlp else {
                panic!("the tiny model is dense")
            };
            let (rows, cols) = (mlp.down.rows(), mlp.down.cols());
            let mut v = vec![0f32; rows * cols];
            for (r, row) in v.chunks_exact_mut(cols).enumerate() {
                mlp.down.row(r, row);
            }
            let (tensor, _) = LossyTensor::encode(
                &v,
                rows,
                cols,
                &Options::new(4.0, Quantizer::Tcq { log2_states: 5 }),
            )
            .unwrap();
            let m = LossyCoded {
                dtype: entrollm_format::Dtype::BF16,
                tensor,
            };
            mlp.down = Arc::new(LossyLinear::new(m).unwrap());
        }
        let id = crate::planner::model_id(&w, "tiny-lossy").unwrap();
        let opts = TuneOptions {
            max_variants_per_form: 1,
            step_overhead: false,
        };
        let t = tune(&w, id, None, &Building, &opts, &mut |_| {}).unwrap();
        for l in t.launches.iter().filter(|l| l.launch == "down") {
            let forms: std::collections::BTreeSet<&str> =
                l.points.iter().map(|p| p.form.as_str()).collect();
            assert!(
                forms.contains("lossy") && forms.contains("dense") && forms.contains("dtans"),
                "{l:?}"
            );
        }
    }
}
