//! Where a CPU decode step's time goes, launch by launch, against the tuner's isolated timings.
//!
//! `cargo run --release -p entrollm-tune --example step_profile -- MODEL [PLAN.json] [STEPS]`
//!
//! Loads MODEL as `--budget` does (GGUF blocks as `int`), re-forms it by PLAN.json when given,
//! wraps every launch's matrices in a timer and runs greedy decode steps on the CPU engine; then
//! times each launch shape's first launch in its form with the tuner's `CpuTimer`. Prints, per
//! launch kind and form, the µs a launch took inside the step and in isolation, and the step's
//! time outside the launches.

use entrollm_model::forms::layout::{launches, LaunchForm};
use entrollm_model::forms::{self, FormId, Source};
use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::weights::{Linear, ModelWeights};
use entrollm_model::Engine;
use entrollm_tune::file::PlanFile;
use entrollm_tune::tuner::{CpuTimer, LaunchTimer, TimedLaunch};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

struct Timed {
    inner: Arc<dyn Linear>,
    slot: usize,
    acc: Arc<Vec<AtomicU64>>,
}

impl Linear for Timed {
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        let t = Instant::now();
        self.inner.matvec(x, y);
        self.acc[self.slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let t = Instant::now();
        self.inner.matmul(x, n, y);
        self.acc[self.slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        let t = Instant::now();
        self.inner.row(r, out);
        self.acc[self.slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    fn stored_bytes(&self) -> usize {
        self.inner.stored_bytes()
    }
    fn form(&self) -> FormId {
        self.inner.form()
    }
    fn source(&self) -> entrollm_model::Result<Source> {
        self.inner.source()
    }
    fn values_kind(&self) -> &'static str {
        self.inner.values_kind()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model = std::path::PathBuf::from(args.get(1).ok_or("usage: MODEL [PLAN.json] [STEPS]")?);
    let plan = args.get(2).filter(|p| p.ends_with(".json"));
    let steps: usize = args.last().and_then(|s| s.parse().ok()).unwrap_or(32);
    let w = open_weights_with(
        &model,
        LoadOptions {
            fused: true,
            recorded_forms: false,
            verify: true,
            q8_activations: false,
        },
    )?;
    let w = match plan {
        Some(p) => {
            let plan = PlanFile::read(std::path::Path::new(p))?;
            let choices: BTreeMap<String, LaunchForm> = plan
                .choices
                .iter()
                .map(|c| {
                    (
                        c.id.clone(),
                        LaunchForm {
                            form: c.form.clone(),
                            variant: c.variant.clone(),
                        },
                    )
                })
                .collect();
            forms::layout::apply(&w, &choices, &|_, _| {})?
        }
        None => w,
    };
    let all = launches(&w);
    let acc: Arc<Vec<AtomicU64>> = Arc::new((0..all.len()).map(|_| AtomicU64::new(0)).collect());
    let slot: BTreeMap<&str, usize> = all
        .iter()
        .enumerate()
        .map(|(i, l)| (l.id.as_str(), i))
        .collect();
    let wrap = |id: &str, m: &Arc<dyn Linear>| -> Arc<dyn Linear> {
        Arc::new(Timed {
            inner: Arc::clone(m),
            slot: slot[id],
            acc: Arc::clone(&acc),
        })
    };
    let tied = Arc::ptr_eq(&w.embed, &w.lm_head);
    let lm_head = wrap("lm_head", &w.lm_head);
    let embed = match tied {
        true => Arc::clone(&lm_head),
        false => wrap("embed", &w.embed),
    };
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let id = |s: &str| format!("layers.{i}.{s}");
            l.map_matrices(|launch, _, m| Ok::<_, ()>(wrap(&id(launch), m)))
                .expect("wrapping cannot fail")
        })
        .collect();
    let timed = ModelWeights {
        config: w.config.clone(),
        embed,
        layers,
        final_norm: w.final_norm.clone(),
        lm_head,
    };
    let mut e = Engine::new(Arc::new(timed), 64 + steps)?;
    let prompt: Vec<u32> = (1..9).collect();
    let mut logits = e.prefill(&prompt)?;
    for a in acc.iter() {
        a.store(0, Ordering::Relaxed);
    }
    let mut step_us = Vec::new();
    for _ in 0..steps {
        let tok = entrollm_model::sampler::argmax(&logits).unwrap_or(0);
        let t0 = Instant::now();
        logits = e.step(tok)?;
        step_us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    if std::env::var_os("STEP_PROFILE_STEPS").is_some() {
        let list: Vec<String> = step_us.iter().map(|t| format!("{:.0}", t / 1e3)).collect();
        println!("steps (ms): {}", list.join(" "));
    }
    let mean_step = step_us.iter().sum::<f64>() / steps as f64;
    let mut sorted = step_us.clone();
    sorted.sort_by(f64::total_cmp);
    // Per launch kind and form: in-step µs per launch.
    let mut kinds: BTreeMap<(String, String), (usize, f64, usize)> = BTreeMap::new();
    let mut in_launches = 0.0;
    for (i, l) in all.iter().enumerate() {
        let us = acc[i].load(Ordering::Relaxed) as f64 / 1e3 / steps as f64;
        in_launches += us;
        let k = kinds
            .entry((
                l.launch.name().to_string(),
                l.matrices[0].form().to_string(),
            ))
            .or_insert((0, 0.0, i));
        k.0 += 1;
        k.1 += us;
    }
    let timer = CpuTimer::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    println!(
        "{:<8} {:<22} {:>5} {:>12} {:>12} {:>7}",
        "launch", "form", "count", "in step µs", "isolated µs", "ratio"
    );
    let mut predicted = 0.0;
    for ((launch, form), (n, us, first)) in &kinds {
        let rep = &all[*first];
        let f = forms::by_name(rep.matrices[0].form().form)?;
        let variant = rep.matrices[0].form().variant;
        let make = || -> entrollm_tune::planner::Result<Vec<Arc<dyn Linear>>> {
            rep.matrices
                .iter()
                .map(|m| {
                    m.reform(&|s| forms::encode_checked(f, s, &variant))
                        .map_err(|e| entrollm_tune::TuneError::Tune(e.to_string()))
                })
                .collect()
        };
        let tl = TimedLaunch {
            launch: rep.launch,
            form: f,
            variant: &variant,
            values: entrollm_tune::costs::values_of_shape_key(&rep.shape_key()),
            matrices: rep.matrices.len(),
            weights: rep.matrices.iter().map(|m| m.rows() * m.cols()).sum(),
            predicted_bytes: rep.stored_bytes() as f64,
            products: launch != "embed",
            gather: launch == "embed" || (launch == "lm_head" && rep.tensors.len() == 2),
        };
        let iso = timer.time(&tl, &make)?.map_or(f64::NAN, |t| t.us);
        predicted += iso * *n as f64;
        let each = us / *n as f64;
        println!(
            "{launch:<8} {form:<22} {n:>5} {each:>12.1} {iso:>12.1} {:>7.3}",
            each / iso
        );
    }
    println!(
        "step: mean {mean_step:.1} µs, median {:.1}, min {:.1}; in launches {in_launches:.1} µs, \
         outside {:.1} µs; isolated timings add up to {predicted:.1} µs ({:.3} of the step)",
        sorted[steps / 2],
        sorted[0],
        mean_step - in_launches,
        predicted / mean_step
    );
    Ok(())
}
