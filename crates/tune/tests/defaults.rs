//! The default rule and the planner's promise, on models held in every kind of stored form: the
//! default budget is what the source's weights take as stored; the weights as they are held are
//! always a candidate; no plan is predicted slower than serving them as held, under the default
//! budget or a larger one; a larger budget never gives a slower plan. On the CPU with the tune
//! data shipped for this host (or the forms' model where none covers it) and on the GPU's cost
//! model and a GPU tune table (the GPU's choice checked on the host).

use entrollm_codec::lossy::{LossyTensor, Options, Quantizer, MIN_TILE_WEIGHTS};
use entrollm_format::coded::LossyCoded;
use entrollm_format::Dtype;
use entrollm_model::forms::by_name;
use entrollm_model::forms::layout::{apply, launches, source_launch_bytes, LaunchForm};
use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::synth::{shared_layer_weights, SynthShape};
use entrollm_model::weights::{DenseFp8, Linear, ModelWeights, RowScaled};
use entrollm_tune::costs::{self, CostTable, Costs, DeviceClass};
use entrollm_tune::planner::{default_budget, fixed_bytes, held_points, model_id, plan_model};
use entrollm_tune::{DeviceKind, TuneFile};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data")
        .join(rel)
}

fn weights_of(w: &ModelWeights) -> u64 {
    launches(w)
        .iter()
        .flat_map(|l| &l.matrices)
        .map(|m| (m.rows() * m.cols()) as u64)
        .sum()
}

fn tiny() -> ModelWeights {
    shared_layer_weights(&SynthShape::Tiny.config(), 7).unwrap()
}

/// Every matrix of `w` replaced by `f(matrix)` (shared matrices stay shared).
type Matrix = Arc<dyn Linear>;

fn map(w: &ModelWeights, f: &dyn Fn(&Matrix) -> Matrix) -> ModelWeights {
    let mut made: BTreeMap<usize, Arc<dyn Linear>> = BTreeMap::new();
    let mut get = |m: &Arc<dyn Linear>| {
        let key = Arc::as_ptr(m) as *const () as usize;
        Arc::clone(made.entry(key).or_insert_with(|| f(m)))
    };
    let layers = w
        .layers
        .iter()
        .map(|l| l.map_matrices(|_, _, m| Ok::<_, ()>(get(m))).unwrap())
        .collect();
    let embed = get(&w.embed);
    let lm_head = get(&w.lm_head);
    let out = ModelWeights {
        config: w.config.clone(),
        embed,
        layers,
        final_norm: w.final_norm.clone(),
        lm_head,
    };
    out.validate().unwrap();
    out
}

/// FP8 E4M3 codes with row scales, as an FP8 checkpoint is held.
fn fp8(w: &ModelWeights) -> ModelWeights {
    map(w, &|m| {
        let (rows, cols) = (m.rows(), m.cols());
        let codes = (0..rows * cols)
            .map(|i| {
                let v = ((i * 2_654_435_761) >> 7) % 0x7E;
                (v as u8) | if i % 3 == 0 { 0x80 } else { 0 }
            })
            .collect();
        let inner: Arc<dyn Linear> = Arc::new(DenseFp8::new("w", rows, cols, codes).unwrap());
        let scales = (0..rows).map(|r| 1e-3 * (1.0 + r as f32 / 64.0)).collect();
        Arc::new(RowScaled::new("w", inner, scales).unwrap())
    })
}

/// Every launch in `form`'s first variant, as a container holding it coded is loaded.
fn coded(w: &ModelWeights, form: &str) -> ModelWeights {
    let f = by_name(form).unwrap();
    let choices = launches(w)
        .iter()
        .filter_map(|l| {
            let v = f.variants(&l.matrices[0].source().unwrap()).unwrap();
            let v = v.first()?;
            Some((
                l.id.clone(),
                LaunchForm {
                    form: form.into(),
                    variant: v.variant.clone(),
                },
            ))
        })
        .collect();
    apply(w, &choices, &|_, _| {}).unwrap()
}

/// Every matrix lossily coded at 4 bits a weight from its BF16 values, as a lossy container's.
fn lossy(w: &ModelWeights) -> ModelWeights {
    map(w, &|m| {
        let mut row = vec![0f32; m.cols()];
        let mut all = Vec::with_capacity(m.rows() * m.cols());
        for r in 0..m.rows() {
            m.row(r, &mut row);
            all.extend_from_slice(&row);
        }
        let opts = Options {
            tile_weights: MIN_TILE_WEIGHTS,
            ..Options::new(4.0, Quantizer::Tcq { log2_states: 5 })
        };
        let (tensor, _) = LossyTensor::encode(&all, m.rows(), m.cols(), &opts).unwrap();
        let coded = LossyCoded {
            dtype: Dtype::BF16,
            tensor,
        };
        Arc::new(entrollm_model::forms::lossy::LossyLinear::new(coded).unwrap())
    })
}

fn gguf(rel: &str) -> ModelWeights {
    let opts = LoadOptions {
        fused: true,
        recorded_forms: false,
        ..LoadOptions::default()
    };
    open_weights_with(&data(rel), opts).unwrap()
}

/// A GPU table fitted to latencies that stream bytes at 3 TB/s plus per-weight decode work that
/// differs by form: what `entrollm tune --device cuda --costs` writes, made on the host.
fn gpu_table(models: &[&ModelWeights]) -> Costs {
    let class = DeviceClass::gpu("NVIDIA H100 80GB HBM3");
    let mut t = CostTable::new(class.clone(), "NVIDIA H100 80GB HBM3", "test");
    for (i, w) in models.iter().enumerate() {
        let id = model_id(w, &format!("model{i}")).unwrap();
        let mut tune =
            entrollm_tune::planner::tune_for(w, id, None, DeviceKind::Cuda, None).unwrap();
        for l in &mut tune.launches {
            let weights = (l.rows * l.cols) as f64;
            for p in &mut l.points {
                let per_weight = match p.form.as_str() {
                    "dtans" => 4e-7,
                    "ggml" => 1e-7,
                    _ => 0.0,
                };
                p.latency_us = 2.0 + p.bytes as f64 / 3e6 + weights * per_weight;
            }
            l.mark_pareto();
        }
        tune.step_overhead_us = Some(30.0 + tune.model.layers as f64);
        t.add(&tune, &class).unwrap();
    }
    Costs::new(t, "test-h100")
}

/// The stored form is a candidate of every launch, and plans at the default budget and at 1.5×
/// and 3× it fit, are never predicted slower than the weights as held, and a larger budget never
/// gives a slower plan.
fn check(name: &str, w: &ModelWeights, kind: DeviceKind, table: Option<&Costs>) {
    let id = model_id(w, name).unwrap();
    let tune: TuneFile = entrollm_tune::planner::tune_for(w, id, None, kind, table).unwrap();
    let held = held_points(w, &tune)
        .unwrap_or_else(|| panic!("{name} {kind}: a launch's held form is not a candidate"));
    for (l, &i) in tune.launches.iter().zip(&held) {
        let inst = launches(w).into_iter().find(|x| x.id == l.id).unwrap();
        assert_eq!(
            l.points[i].bytes,
            inst.stored_bytes() as u64,
            "{name} {kind} {}: the held point is not the launch as held",
            l.id
        );
    }
    let held_us: f64 = tune
        .launches
        .iter()
        .zip(&held)
        .map(|(l, &i)| l.points[i].latency_us)
        .sum::<f64>()
        + tune.step_overhead_us.unwrap_or(0.0);
    let reserved = 12345;
    let default = default_budget(w, reserved, u64::MAX).unwrap();
    let mut last = f64::INFINITY;
    for scale in [1.0, 1.5, 3.0] {
        let budget = (default as f64 * scale) as u64;
        let p = plan_model(w, &tune, Some(budget), reserved).unwrap();
        assert!(
            p.total_bytes + fixed_bytes(w) + reserved <= budget,
            "{name} {kind} ×{scale}: {} bytes of launches over the budget",
            p.total_bytes
        );
        // The weights as held fit the default budget wherever they are no larger than the
        // source (every stored form here); the plan is then never slower.
        let held_bytes: u64 = launches(w).iter().map(|l| l.stored_bytes() as u64).sum();
        if held_bytes <= source_launch_bytes(w).unwrap() {
            assert!(
                p.predicted_step_us <= held_us * (1.0 + 1e-12),
                "{name} {kind} ×{scale}: plan {} µs, as held {held_us} µs",
                p.predicted_step_us
            );
        }
        assert!(
            p.predicted_step_us <= last * (1.0 + 1e-12),
            "{name} {kind} ×{scale}: a larger budget gave a slower plan ({} µs after {last})",
            p.predicted_step_us
        );
        last = p.predicted_step_us;
    }
}

fn cpu_table() -> Option<Costs> {
    costs::shipped_for(&DeviceClass::this_cpu(2)).unwrap()
}

/// A GGUF loaded with `--activations q8` keeps its q8 products under the default plan: the
/// user's variant is the only one of the form offered, on the CPU and on the GPU.
#[test]
fn q8_activations_survive_the_default_plan() {
    let opts = LoadOptions {
        fused: true,
        recorded_forms: false,
        q8_activations: true,
        ..LoadOptions::default()
    };
    let w = open_weights_with(&data("families/qwen3/model.q8_0.gguf"), opts).unwrap();
    for kind in [DeviceKind::Cpu, DeviceKind::Cuda] {
        let id = model_id(&w, "q8").unwrap();
        let tune = entrollm_tune::planner::tune_for(&w, id, None, kind, None).unwrap();
        let default = default_budget(&w, 0, u64::MAX).unwrap();
        let p = plan_model(&w, &tune, Some(default), 0).unwrap();
        let ggml: Vec<_> = p.choices.iter().filter(|c| c.form == "ggml").collect();
        assert!(!ggml.is_empty(), "{kind}: no launch kept as ggml");
        assert!(
            ggml.iter().all(|c| c.variant == "q8"),
            "{kind}: a ggml launch planned without q8: {:?}",
            ggml.iter().map(|c| (&c.id, &c.variant)).collect::<Vec<_>>()
        );
        for l in &tune.launches {
            assert!(
                !l.points
                    .iter()
                    .any(|pt| pt.form == "ggml" && pt.variant.is_empty()),
                "{kind} {}: f32 ggml offered beside the chosen q8",
                l.id
            );
        }
    }
}

#[test]
fn the_default_budget_is_the_source_as_stored() {
    let bf16 = tiny();
    let n = weights_of(&bf16);
    assert_eq!(source_launch_bytes(&bf16).unwrap(), 2 * n);
    // FP8: a byte a weight and the row scales.
    let f = fp8(&bf16);
    let rows: u64 = launches(&f)
        .iter()
        .flat_map(|l| &l.matrices)
        .map(|m| m.rows() as u64)
        .sum();
    assert_eq!(source_launch_bytes(&f).unwrap(), n + 4 * rows);
    // A lossless container's coded matrices and a lossy one's count the BF16 they came from.
    let d = coded(&bf16, "dtans");
    assert!(launches(&d)
        .iter()
        .all(|l| l.matrices[0].form().form == "dtans"));
    assert_eq!(source_launch_bytes(&d).unwrap(), 2 * n);
    let l = lossy(&bf16);
    assert_eq!(source_launch_bytes(&l).unwrap(), 2 * n);
    // A GGUF: its blocks as the file stores them (it is loaded as stored).
    for g in ["gguf_tiny_llama.gguf", "families/qwen3/model.q8_0.gguf"] {
        let w = gguf(g);
        let held: u64 = launches(&w).iter().map(|l| l.stored_bytes() as u64).sum();
        assert_eq!(source_launch_bytes(&w).unwrap(), held, "{g}");
        assert!(launches(&w)
            .iter()
            .any(|l| l.matrices[0].form().form == "ggml"));
    }
    // Capped by free memory.
    let fixed = fixed_bytes(&bf16);
    assert_eq!(
        default_budget(&bf16, 10, u64::MAX).unwrap(),
        2 * n + fixed + 10
    );
    assert_eq!(default_budget(&bf16, 10, 1000).unwrap(), 1000);
}

#[test]
fn no_plan_is_dominated_by_the_weights_as_held() {
    let bf16 = tiny();
    let models = [
        ("bf16", tiny()),
        ("fp8", fp8(&bf16)),
        ("dtans", coded(&bf16, "dtans")),
        ("pal-bf16", coded(&bf16, "pal-bf16")),
        ("lossy", lossy(&bf16)),
        ("gguf", gguf("gguf_tiny_llama.gguf")),
        ("gguf-q8_0", gguf("families/qwen3/model.q8_0.gguf")),
    ];
    let refs: Vec<&ModelWeights> = models.iter().map(|(_, w)| w).collect();
    let gpu = gpu_table(&refs);
    let cpu = cpu_table();
    for (name, w) in &models {
        check(name, w, DeviceKind::Cpu, None);
        check(name, w, DeviceKind::Cpu, cpu.as_ref());
        check(name, w, DeviceKind::Cuda, None);
        check(name, w, DeviceKind::Cuda, Some(&gpu));
    }
}

/// The GPU's choice, made on the host from a GPU table: a BF16 model whose coded forms are
/// smaller and stream faster is served in them within its own size; one whose forms are all
/// slower is served as held.
#[test]
fn a_gpu_table_decides_on_the_host() {
    let bf16 = tiny();
    let gpu = gpu_table(&[&bf16]);
    let id = model_id(&bf16, "bf16").unwrap();
    let tune =
        entrollm_tune::planner::tune_for(&bf16, id, None, DeviceKind::Cuda, Some(&gpu)).unwrap();
    let budget = default_budget(&bf16, 0, u64::MAX).unwrap();
    let p = plan_model(&bf16, &tune, Some(budget), 0).unwrap();
    let held = held_points(&bf16, &tune).unwrap();
    let held_us: f64 = tune
        .launches
        .iter()
        .zip(&held)
        .map(|(l, &i)| l.points[i].latency_us)
        .sum();
    assert!(
        p.predicted_step_us < held_us + tune.step_overhead_us.unwrap(),
        "{p:?}"
    );
    assert!(p.choices.iter().any(|c| c.form != "dense"), "{p:?}");
    assert!(p.total_bytes < source_launch_bytes(&bf16).unwrap());
}
