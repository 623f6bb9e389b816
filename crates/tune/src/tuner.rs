//! `entrollm tune`: per launch, every form's variants (pruned by predicted size), timed on the
//! device with a cold-cache protocol, kept as the launch's size–latency Pareto front.

use crate::file::{DeviceId, DeviceKind, LaunchTune, ModelId, Point, TuneFile};
use entrollm_model::coding_plan::Launch;
use entrollm_model::engine::Engine;
use entrollm_model::forms::layout::{launches, LaunchInstance};
use entrollm_model::forms::{self, Form, Source};
use entrollm_model::weights::{Linear, ModelWeights};
use std::collections::BTreeMap;
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
    fn time(
        &self,
        launch: &TimedLaunch,
        make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
    ) -> Result<Option<f64>>;
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
}

/// What is timed: a launch in one form.
pub struct TimedLaunch<'a> {
    pub form: &'a dyn Form,
    pub weights: usize,
    pub predicted_bytes: f64,
    /// Products of all matrices but the first: the first is an embedding looked up (a tied LM
    /// head is both: its product and a lookup).
    pub products: bool,
    pub gather: bool,
}

/// The CPU protocol: copies of the launch covering twice the last-level cache, products cycled
/// through them so none is cached, bursts of at least `burst_ms`, the median of `bursts` bursts'
/// mean time per launch; on the rayon pool of the thread count given.
pub struct CpuTimer {
    pub threads: usize,
    pub llc_bytes: usize,
    pub burst_ms: f64,
    pub bursts: usize,
    /// Most copies made (each is an encoding), whatever the cache.
    pub max_copies: usize,
}

impl CpuTimer {
    pub fn new(threads: usize) -> Self {
        CpuTimer {
            threads,
            llc_bytes: last_level_cache_bytes().unwrap_or(32 << 20),
            burst_ms: 20.0,
            bursts: 5,
            max_copies: 48,
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
            "cpu: copies covering 2x the last-level cache ({} KiB, at most {} copies), products \
             cycled through them, median of {} bursts of >= {} ms, {} threads",
            self.llc_bytes >> 10,
            self.max_copies,
            self.bursts,
            self.burst_ms,
            self.threads
        )
    }
    fn time(
        &self,
        launch: &TimedLaunch,
        make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
    ) -> Result<Option<f64>> {
        let first = make()?;
        let gather_us = match launch.gather {
            true => time_gather(&first[0], self.bursts),
            false => 0.0,
        };
        if !launch.products {
            return Ok(Some(gather_us));
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
        Ok(Some(means[means.len() / 2] + gather_us))
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
    for (l, inst) in launches
        .iter()
        .zip(entrollm_model::forms::layout::launches(w))
    {
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

/// Timings per shape key: (form, variant) → (µs, id of the launch timed).
type Timings = BTreeMap<String, BTreeMap<(String, String), (f64, String)>>;

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

/// Candidates for a launch shape from its representative: its current form as it is, and every
/// accepting form's variants (chosen on the first matrix, the same for all of the launch).
fn candidates(
    rep: &LaunchInstance,
    opts: &TuneOptions,
    device: forms::DeviceKind,
) -> Result<Vec<Planned>> {
    let src = rep.matrices[0].source().map_err(err)?;
    let mut out = Vec::new();
    let current = rep.matrices[0].form();
    let current_form = forms::by_name(current.form).map_err(err)?;
    if current_form.runs_on(device) {
        out.push(Planned {
            form: current_form,
            variant: current.variant.clone(),
        });
    }
    let others: Vec<_> = rep.matrices[1..]
        .iter()
        .map(|m| m.source())
        .collect::<std::result::Result<_, _>>()
        .map_err(err)?;
    for form in forms::all() {
        if !form.runs_on(device) || !form.accepts(&src) || !others.iter().all(|s| form.accepts(s)) {
            continue;
        }
        let mut vs = form.variants(&src).map_err(err)?;
        vs.sort_by(|a, b| a.predicted_bytes.total_cmp(&b.predicted_bytes));
        for c in vs.into_iter().take(opts.max_variants_per_form) {
            if form.name() == current.form && c.variant == current.variant {
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

/// A launch's matrices decoded once, for the size of each of its candidates.
struct LaunchSources {
    srcs: Vec<Source>,
    /// Bytes each matrix's wrappers (row scales, row order) add beside its inner values.
    wraps: Vec<f64>,
}

impl LaunchSources {
    fn of(inst: &LaunchInstance) -> Result<Self> {
        let mut srcs = Vec::with_capacity(inst.matrices.len());
        let mut wraps = Vec::with_capacity(inst.matrices.len());
        for m in &inst.matrices {
            let id = m.form();
            let src = m.source().map_err(err)?;
            let form = forms::by_name(id.form).map_err(err)?;
            let stored = m.stored_bytes() as f64;
            let inner = form.predict(&src, &id.variant).map_err(err)?.min(stored);
            wraps.push(stored - inner);
            srcs.push(src);
        }
        Ok(LaunchSources { srcs, wraps })
    }

    /// Bytes of `inst` in `form`/`variant`: exact where a matrix is in that form already, else
    /// predicted.
    fn bytes(&self, inst: &LaunchInstance, form: &dyn Form, variant: &str) -> Result<u64> {
        let mut total = 0f64;
        for ((m, src), wrap) in inst.matrices.iter().zip(&self.srcs).zip(&self.wraps) {
            let id = m.form();
            total += if id.form == form.name() && id.variant == variant {
                m.stored_bytes() as f64
            } else {
                form.predict(src, variant).map_err(err)? + wrap
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
                t.insert((p.form.clone(), p.variant.clone()), (p.latency_us, who));
            }
        }
    }
    let mut plan: Vec<(String, usize, Vec<Planned>)> = Vec::new();
    for (key, members) in &by_shape {
        let rep = &all[members[0]];
        let c = candidates(rep, opts, forms_device(timer.device().kind))?;
        plan.push((key.clone(), members[0], c));
    }
    let total: usize = plan
        .iter()
        .map(|(k, _, c)| {
            c.iter()
                .filter(|p| !has(&timed, k, p.form.name(), &p.variant))
                .count()
        })
        .sum();
    let mut done = 0;
    for (key, rep, cands) in &plan {
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
            let make = || -> Result<Vec<Arc<dyn Linear>>> {
                rep.matrices
                    .iter()
                    .map(|m| fresh(m, p.form, &p.variant))
                    .collect()
            };
            let weights: usize = rep.matrices.iter().map(|m| m.rows() * m.cols()).sum();
            let bytes = sources.bytes(rep, p.form, &p.variant)? as f64;
            let launch = TimedLaunch {
                form: p.form,
                weights,
                predicted_bytes: bytes,
                products: rep.launch != Launch::Embed,
                gather: matches!(rep.launch, Launch::Embed)
                    || (rep.launch == Launch::LmHead && rep.tensors.len() == 2),
            };
            let Some(us) = timer.time(&launch, &make)? else {
                done += 1;
                continue;
            };
            timed.entry(key.clone()).or_default().insert(
                (p.form.name().to_string(), p.variant.clone()),
                (us, rep.id.clone()),
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
    for l in &all {
        let key = l.shape_key();
        let t = &timed[&key];
        let sources = LaunchSources::of(l)?;
        let mut points = Vec::new();
        for ((form, variant), (us, who)) in t {
            let f = forms::by_name(form).map_err(err)?;
            // A point resumed from another model's launch of this shape still needs this
            // launch's own size; a form that no longer accepts it is left out.
            let Ok(bytes) = sources.bytes(l, f, variant) else {
                continue;
            };
            points.push(Point {
                form: form.clone(),
                variant: variant.clone(),
                bytes,
                latency_us: *us,
                timed_as: (who != &l.id).then(|| who.clone()),
                pareto: false,
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
    let step_overhead_us = match (opts.step_overhead, resume.and_then(|r| r.step_overhead_us)) {
        (_, Some(v)) => Some(v),
        (false, None) => None,
        (true, None) => timer.step_overhead_us(w, &out)?,
    };
    let mut tf = TuneFile::new(timer.device(), model, timer.protocol());
    tf.step_overhead_us = step_overhead_us;
    tf.launches = out;
    Ok(tf)
}

fn has(timed: &Timings, key: &str, form: &str, variant: &str) -> bool {
    timed
        .get(key)
        .is_some_and(|t| t.contains_key(&(form.to_string(), variant.to_string())))
}

/// A new copy of `m` in `form`/`variant` (its current form is re-encoded too, so copies are
/// distinct memory).
fn fresh(m: &Arc<dyn Linear>, form: &dyn Form, variant: &str) -> Result<Arc<dyn Linear>> {
    m.reform(&|src| forms::encode_checked(form, src, variant))
        .map_err(err)
}

/// Median µs of a greedy decode step of the CPU engine on `w` after a short prompt.
pub fn measure_step_us(w: &ModelWeights, steps: usize) -> Result<f64> {
    let shared = Arc::new(clone_weights(w));
    let mut e = Engine::new(shared, 64 + steps).map_err(err)?;
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
