//! Tune data: the default latencies of the forms on a device, fitted from `entrollm tune` files
//! measured on it (`entrollm tune --costs FILE`). The tables made on the devices people use are
//! shipped in `crates/tune/data/` and chosen by device when a plan is made without a tune file of
//! its own; a device none covers is planned with the forms' cost model, and the plan says so
//! (docs/tune.md, *Tune data*).
//!
//! A table keeps the measured samples themselves (per launch shape and form: weights, bytes, µs),
//! so that adding a model's tune file refits it; the fit is computed when the table is read.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use crate::file::{DeviceKind, LaunchTune, TuneFile, MAX_FILE_BYTES};
use crate::{TuneError, ENTROLLM_VERSION};

pub const COSTS_FORMAT: &str = "entrollm-costs";
pub const COSTS_VERSION: u32 = 1;

/// Which devices a table's timings hold for: the same kind, class and thread count.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceClass {
    pub kind: DeviceKind,
    /// CPU: the widest vector instructions the kernels run with (`avx512`, `avx2`, `base`);
    /// GPU: the device name as the driver reports it.
    pub class: String,
    /// CPU threads the timings ran on (`None` on the GPU).
    pub threads: Option<usize>,
}

impl std::fmt::Display for DeviceClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.class)?;
        if let Some(t) = self.threads {
            write!(f, ", {t} threads")?;
        }
        Ok(())
    }
}

impl DeviceClass {
    /// This host's CPU class with `threads` threads.
    pub fn this_cpu(threads: usize) -> DeviceClass {
        DeviceClass {
            kind: DeviceKind::Cpu,
            class: cpu_class().into(),
            threads: Some(threads),
        }
    }

    /// A GPU by the name its driver reports.
    pub fn gpu(name: &str) -> DeviceClass {
        DeviceClass {
            kind: DeviceKind::Cuda,
            class: name.into(),
            threads: None,
        }
    }
}

/// The widest vector instructions this CPU offers the kernels.
pub fn cpu_class() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512";
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return "avx2";
        }
    }
    "base"
}

/// What a sample's latency depends on besides its sizes: the form, its variant's kind (a dense
/// matrix's element type, a dtANS coding's mode), the values held (with a GGUF's block type) and
/// whether the launch is the embedding's row lookup.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostKey {
    pub form: String,
    pub variant: String,
    pub values: String,
    pub lookup: bool,
}

impl CostKey {
    /// The key of a form's `variant` holding `values` (`embed`: the row lookup).
    pub fn new(form: &str, variant: &str, values: &str, lookup: bool) -> CostKey {
        CostKey {
            form: form.into(),
            variant: variant_kind(variant).into(),
            values: values.into(),
            lookup,
        }
    }
}

/// The part of a variant that changes the work per weight: its first word (`bf16` of a dense
/// variant, `pair` of `pair:12:512:64`).
fn variant_kind(variant: &str) -> &str {
    variant.split([':', ' ']).next().unwrap_or("")
}

/// A shape key's values (`ggml(Q4_1)`, `bf16`): the values kind it ends with and the first
/// matrix's layout tag.
pub fn values_of_shape_key(key: &str) -> String {
    let kind = key.rsplit(':').next().unwrap_or("");
    match key.split_once('(').and_then(|(_, r)| r.split_once(')')) {
        Some((tag, _)) => format!("{kind}({tag})"),
        None => kind.to_string(),
    }
}

/// The matrices of a launch by its shape key (`qkv:576x576:192x576:192x576:bf16`: 3).
pub fn matrices_of_shape_key(key: &str) -> usize {
    key.split(':')
        .filter(|p| {
            let dims = p.split('(').next().unwrap_or("");
            dims.split_once('x').is_some_and(|(r, c)| {
                !r.is_empty()
                    && !c.is_empty()
                    && r.bytes().all(|b| b.is_ascii_digit())
                    && c.bytes().all(|b| b.is_ascii_digit())
            })
        })
        .count()
        .max(1)
}

/// One launch timed in one form.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sample {
    #[serde(flatten)]
    pub key: CostKey,
    /// Matrices the launch multiplies (q/k/v: 3, gate/up: 2): each product has a fixed cost.
    pub matrices: usize,
    pub weights: u64,
    pub bytes: u64,
    pub latency_us: f64,
    /// The model and launch it was timed in.
    pub model: String,
    pub launch: String,
}

/// One model's step overhead (attention, norms, the argmax) as its tune file measured it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSample {
    pub model: String,
    pub layers: usize,
    /// Σ over layers of the layer's q/k/v rows (what attention and the norms scale with).
    pub width: u64,
    pub us: f64,
}

/// A device's tune data file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostTable {
    pub format: String,
    pub version: u32,
    pub entrollm_version: String,
    pub device: DeviceClass,
    /// The device the timings were taken on, as its tune files name it.
    pub measured_on: String,
    pub protocol: String,
    pub samples: Vec<Sample>,
    pub steps: Vec<StepSample>,
}

/// `latency = a·matrices + b·weights + c·bytes`, fitted with non-negative terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Linear3 {
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

impl Linear3 {
    pub fn at(&self, matrices: f64, weights: f64, bytes: f64) -> f64 {
        self.a * matrices + self.b * weights + self.c * bytes
    }
}

/// Least squares of relative errors, `Σ ((x·θ − y) / y)²`, over the terms `cols` of `xs`;
/// `None` where the terms are collinear.
fn rel_lsq(xs: &[[f64; 3]], ys: &[f64], cols: &[usize]) -> Option<[f64; 3]> {
    let n = cols.len();
    let mut m = vec![vec![0f64; n + 1]; n];
    for (x, &y) in xs.iter().zip(ys) {
        let w = 1.0 / (y * y);
        for i in 0..n {
            for j in 0..n {
                m[i][j] += w * x[cols[i]] * x[cols[j]];
            }
            m[i][n] += w * x[cols[i]] * y;
        }
    }
    // Gauss-Jordan with partial pivoting on the normal equations (at most 3×3).
    for c in 0..n {
        let p = (c..n).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        m.swap(c, p);
        let scale = (0..n).map(|j| m[c][j].abs()).fold(0.0, f64::max);
        if m[c][c].abs() <= 1e-12 * scale.max(f64::MIN_POSITIVE) {
            return None;
        }
        let pivot = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut out = [0f64; 3];
    for (i, &c) in cols.iter().enumerate() {
        out[c] = m[i][n] / m[i][i];
    }
    Some(out)
}

/// The non-negative fit of least relative error over the subsets of the terms.
fn fit(xs: &[[f64; 3]], ys: &[f64]) -> Option<Linear3> {
    const SUBSETS: [&[usize]; 7] = [&[0, 1, 2], &[0, 1], &[0, 2], &[1, 2], &[1], &[2], &[0]];
    let mut best: Option<(f64, [f64; 3])> = None;
    for cols in SUBSETS {
        let Some(t) = rel_lsq(xs, ys, cols) else {
            continue;
        };
        if t.iter().any(|&v| v < 0.0 || !v.is_finite()) {
            continue;
        }
        let err: f64 = xs
            .iter()
            .zip(ys)
            .map(|(x, &y)| ((x[0] * t[0] + x[1] * t[1] + x[2] * t[2] - y) / y).powi(2))
            .sum();
        if best.is_none_or(|(e, _)| err < e * (1.0 - 1e-9)) {
            best = Some((err, t));
        }
    }
    best.map(|(_, t)| Linear3 {
        a: t[0],
        b: t[1],
        c: t[2],
    })
}

/// A table's fits: per key, and the step overhead in the layers' width.
#[derive(Clone, Debug)]
pub struct Costs {
    pub table: CostTable,
    pub name: String,
    launches: BTreeMap<CostKey, Linear3>,
    step: Option<Linear3>,
}

impl Costs {
    /// The fits of `table`, named `name` in messages.
    pub fn new(table: CostTable, name: &str) -> Costs {
        let mut by_key: BTreeMap<&CostKey, (Vec<[f64; 3]>, Vec<f64>)> = BTreeMap::new();
        for s in &table.samples {
            let e = by_key.entry(&s.key).or_default();
            e.0.push([s.matrices as f64, s.weights as f64, s.bytes as f64]);
            e.1.push(s.latency_us);
        }
        let launches = by_key
            .into_iter()
            .filter_map(|(k, (xs, ys))| Some((k.clone(), fit(&xs, &ys)?)))
            .collect();
        let (xs, ys): (Vec<[f64; 3]>, Vec<f64>) = table
            .steps
            .iter()
            .map(|s| ([1.0, s.layers as f64, s.width as f64], s.us))
            .unzip();
        let step = fit(&xs, &ys);
        Costs {
            table,
            name: name.into(),
            launches,
            step,
        }
    }

    /// µs of a launch of `matrices` matrices, `weights` weights in `bytes`, where the table
    /// covers its key.
    pub fn launch_us(
        &self,
        key: &CostKey,
        matrices: usize,
        weights: usize,
        bytes: f64,
    ) -> Option<f64> {
        self.launches
            .get(key)
            .map(|f| f.at(matrices as f64, weights as f64, bytes).max(1e-3))
    }

    /// µs a decode step costs beyond its launches, for `layers` layers of `width` summed q/k/v
    /// rows.
    pub fn step_us(&self, layers: usize, width: u64) -> Option<f64> {
        self.step.map(|f| f.at(1.0, layers as f64, width as f64))
    }
}

impl CostTable {
    pub fn new(device: DeviceClass, measured_on: &str, protocol: &str) -> CostTable {
        CostTable {
            format: COSTS_FORMAT.into(),
            version: COSTS_VERSION,
            entrollm_version: ENTROLLM_VERSION.into(),
            device,
            measured_on: measured_on.into(),
            protocol: protocol.into(),
            samples: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// Reads and checks a table (`what` names it in messages).
    pub fn parse(text: &str, what: &str) -> Result<CostTable, TuneError> {
        let bad = |why: String| TuneError::Tune(format!("{what}: {why}"));
        let t: CostTable = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if t.format != COSTS_FORMAT || t.version != COSTS_VERSION {
            return Err(bad(format!(
                "not an {COSTS_FORMAT} file of version {COSTS_VERSION} (format {:?}, version {})",
                t.format, t.version
            )));
        }
        for s in &t.samples {
            if !(s.latency_us.is_finite() && s.latency_us > 0.0) || s.weights == 0 {
                return Err(bad(format!(
                    "sample {} of {}: latency {} µs for {} weights",
                    s.launch, s.model, s.latency_us, s.weights
                )));
            }
        }
        if let Some(s) = t.steps.iter().find(|s| !(s.us.is_finite() && s.us > 0.0)) {
            return Err(bad(format!("step overhead {} µs of {}", s.us, s.model)));
        }
        Ok(t)
    }

    pub fn read(path: &Path) -> Result<CostTable, TuneError> {
        let what = path.display().to_string();
        let len = std::fs::metadata(path)
            .map_err(|e| TuneError::Tune(format!("{what}: {e}")))?
            .len();
        if len > MAX_FILE_BYTES {
            return Err(TuneError::Tune(format!("{what}: larger than 64 MiB")));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| TuneError::Tune(format!("{what}: {e}")))?;
        CostTable::parse(&text, &what)
    }

    pub fn write(&self, path: &Path) -> Result<(), TuneError> {
        let mut text = serde_json::to_string_pretty(self)
            .map_err(|e| TuneError::Tune(format!("{}: {e}", path.display())))?;
        text.push('\n');
        crate::file::write_atomic(path, text.as_bytes())
    }

    /// Adds the timings of `tune` (measured on this table's device class), replacing the samples
    /// of a model of the same path.
    pub fn add(&mut self, tune: &TuneFile, class: &DeviceClass) -> Result<(), TuneError> {
        if *class != self.device {
            return Err(TuneError::Tune(format!(
                "the tune data is for {}, and this tune file was measured on {class}",
                self.device
            )));
        }
        let model = tune.model.path.clone();
        self.samples.retain(|s| s.model != model);
        self.steps.retain(|s| s.model != model);
        for l in &tune.launches {
            let values = values_of_shape_key(&l.shape_key);
            let weights = (l.rows * l.cols) as u64;
            let matrices = matrices_of_shape_key(&l.shape_key);
            for p in l.points.iter().filter(|p| p.timed_as.is_none()) {
                self.samples.push(Sample {
                    key: CostKey::new(&p.form, &p.variant, &values, l.launch == "embed"),
                    matrices,
                    weights,
                    bytes: p.bytes,
                    latency_us: p.latency_us,
                    model: model.clone(),
                    launch: l.id.clone(),
                });
            }
        }
        if let Some(us) = tune.step_overhead_us.filter(|&u| u > 0.0) {
            self.steps.push(StepSample {
                model,
                layers: tune.model.layers,
                width: step_width(&tune.launches),
                us,
            });
        }
        self.measured_on = tune.device.name.clone();
        self.protocol = tune.protocol.clone();
        self.entrollm_version = ENTROLLM_VERSION.into();
        Ok(())
    }
}

/// Σ over a model's q/k/v launches of their rows: the step overhead's measure of a model.
pub fn step_width(launches: &[LaunchTune]) -> u64 {
    launches
        .iter()
        .filter(|l| l.launch == "qkv")
        .map(|l| l.rows as u64)
        .sum()
}

/// The tables shipped with entrollm: (name, JSON).
const SHIPPED: [(&str, &str); 1] = [("cpu-avx512-2t", include_str!("../data/cpu-avx512-2t.json"))];

/// The shipped tables' devices, for messages.
pub fn shipped_devices() -> Vec<String> {
    SHIPPED
        .iter()
        .filter_map(|(name, text)| CostTable::parse(text, name).ok())
        .map(|t| t.device.to_string())
        .collect()
}

/// The shipped tune data for `device`, if any covers it.
pub fn shipped_for(device: &DeviceClass) -> Result<Option<Costs>, TuneError> {
    find_for(&SHIPPED, device)
}

/// The user's tune data in `dir` (its `*.json` tables; `costs/` in entrollm's cache folder) for
/// `device`, if any covers it: it comes before the shipped data. A table that cannot be read is an error naming it.
pub fn user_for(dir: &std::path::Path, device: &DeviceClass) -> Result<Option<Costs>, TuneError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut paths: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut tables = Vec::with_capacity(paths.len());
    for p in &paths {
        let text = std::fs::read_to_string(p)
            .map_err(|e| TuneError::Tune(format!("{}: {e}", p.display())))?;
        tables.push((p.display().to_string(), text));
    }
    let named: Vec<(&str, &str)> = tables
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    find_for(&named, device)
}

/// The table of `tables` ((name, JSON)) made on `device`'s class, if any: the same kind, CPU
/// class and thread count, or the same GPU name.
fn find_for(tables: &[(&str, &str)], device: &DeviceClass) -> Result<Option<Costs>, TuneError> {
    for (name, text) in tables {
        let t = CostTable::parse(text, name)?;
        if t.device == *device {
            return Ok(Some(Costs::new(t, name)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_users_tune_data_is_found_by_device_and_a_bad_table_is_named() {
        let dir = std::env::temp_dir().join(format!("entrollm-costs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gpu = DeviceClass::gpu("NVIDIA H100 80GB HBM3");
        assert!(user_for(&dir, &gpu).unwrap().is_none());
        assert!(user_for(&dir.join("absent"), &gpu).unwrap().is_none());
        let table = CostTable::new(gpu.clone(), "NVIDIA H100 80GB HBM3", "test");
        std::fs::write(
            dir.join("mine.json"),
            serde_json::to_string(&table).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("notes.txt"), "not a table").unwrap();
        let found = user_for(&dir, &gpu)
            .unwrap()
            .expect("the table of this GPU");
        assert!(found.name.ends_with("mine.json"), "{}", found.name);
        assert!(user_for(&dir, &DeviceClass::gpu("NVIDIA H200"))
            .unwrap()
            .is_none());
        std::fs::write(dir.join("broken.json"), "{").unwrap();
        let e = user_for(&dir, &gpu).unwrap_err().to_string();
        assert!(e.contains("broken.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fits_recover_a_linear_cost_and_stay_non_negative() {
        let (xs, ys): (Vec<[f64; 3]>, Vec<f64>) = [(1e6, 2e6), (4e6, 8e6), (9e6, 5e6), (3e5, 6e5)]
            .iter()
            .map(|&(w, b)| ([1.0, w, b], 3.0 + 2e-4 * w + 1e-4 * b))
            .unzip();
        let f = fit(&xs, &ys).unwrap();
        assert!(
            (f.a - 3.0).abs() < 1e-6 && (f.b - 2e-4).abs() < 1e-10,
            "{f:?}"
        );
        // A cost that falls with size has no non-negative exact fit: the best one is kept.
        let f = fit(&[[1.0, 1.0, 1.0], [1.0, 2.0, 2.0]], &[10.0, 5.0]).unwrap();
        assert!(f.a >= 0.0 && f.b >= 0.0 && f.c >= 0.0, "{f:?}");
    }

    #[test]
    fn shape_keys_give_values_with_their_block_type() {
        assert_eq!(
            values_of_shape_key("qkv:576x576(Q4_1):192x576(Q4_1):ggml"),
            "ggml(Q4_1)"
        );
        assert_eq!(values_of_shape_key("down:4096x14336:bf16"), "bf16");
        assert_eq!(
            CostKey::new("dtans", "pair:12:512:64", "bf16", false).variant,
            "pair"
        );
        assert_eq!(
            matrices_of_shape_key("qkv:576x576(Q4_1):192x576(Q4_1):192x576(Q4_1):ggml"),
            3
        );
        assert_eq!(matrices_of_shape_key("lm_head:49152x576:bf16"), 1);
    }

    #[test]
    fn the_shipped_tables_parse_and_cover_their_forms() {
        for (name, text) in SHIPPED {
            let t = CostTable::parse(text, name).unwrap();
            assert!(!t.samples.is_empty() && !t.steps.is_empty(), "{name}");
            let c = Costs::new(t.clone(), name);
            assert!(c.step_us(30, 30 * 960).is_some(), "{name}");
            for s in &t.samples {
                let us = c.launch_us(&s.key, s.matrices, s.weights as usize, s.bytes as f64);
                assert!(us.is_some(), "{name}: {:?}", s.key);
            }
            assert_eq!(shipped_for(&t.device).unwrap().unwrap().name, name);
        }
    }

    /// A GPU's table is found by its device name and priced from its own samples; another GPU,
    /// or a CPU, finds none (and is planned with the forms' cost model). The table is a small
    /// synthetic one: the GPU tables come from device runs.
    #[test]
    fn a_gpu_table_is_found_by_name_and_others_fall_back() {
        let mut t = CostTable::new(DeviceClass::gpu("NVIDIA H100 80GB HBM3"), "synthetic", "-");
        for (weights, us) in [(1u64 << 20, 2.0), (1 << 22, 5.0), (1 << 24, 17.0)] {
            t.samples.push(Sample {
                key: CostKey::new("dense", "bf16", "bf16", false),
                matrices: 1,
                weights,
                bytes: 2 * weights,
                latency_us: us,
                model: "synthetic".into(),
                launch: format!("w{weights}"),
            });
        }
        t.steps.push(StepSample {
            model: "synthetic".into(),
            layers: 4,
            width: 4096,
            us: 40.0,
        });
        let text = serde_json::to_string(&t).unwrap();
        let tables = [
            ("cpu-avx512-2t", SHIPPED[0].1),
            ("gpu-synthetic", text.as_str()),
        ];
        let found = find_for(&tables, &DeviceClass::gpu("NVIDIA H100 80GB HBM3"))
            .unwrap()
            .unwrap();
        assert_eq!(found.name, "gpu-synthetic");
        let key = CostKey::new("dense", "bf16", "bf16", false);
        let us = found
            .launch_us(&key, 1, 1 << 22, (2u64 << 22) as f64)
            .unwrap();
        assert!((us / 5.0 - 1.0).abs() < 0.1, "{us}");
        // Keys the table has no samples of are not priced by it.
        assert!(found
            .launch_us(
                &CostKey::new("dtans", "pair", "bf16", false),
                1,
                1 << 22,
                1e6
            )
            .is_none());
        for other in [DeviceClass::gpu("NVIDIA H200"), DeviceClass::this_cpu(3)] {
            assert!(find_for(&tables, &other).unwrap().is_none(), "{other}");
        }
        // A damaged table is an error naming it, not a silent fallback.
        let bad = [("gpu-bad", "{\"format\": 1}")];
        let e = find_for(&bad, &DeviceClass::gpu("x")).err().unwrap();
        assert!(e.to_string().contains("gpu-bad"), "{e}");
    }

    #[test]
    fn a_device_without_data_finds_none() {
        let mut d = DeviceClass::this_cpu(2);
        d.threads = Some(1000);
        assert!(shipped_for(&d).unwrap().is_none());
        assert!(shipped_for(&DeviceClass::gpu("NVIDIA B300"))
            .unwrap()
            .is_none());
    }
}
