//! The tune file (each launch's measured size–latency points on one device) and the plan file
//! (the form chosen for each launch under a budget). Both are versioned JSON, read strictly and
//! written atomically; docs/tune.md describes every field.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::front::pareto_front;
use crate::knapsack::{self, Item};
use crate::{human_bytes, TuneError, ENTROLLM_VERSION};

pub const TUNE_FORMAT: &str = "entrollm-tune";
pub const PLAN_FORMAT: &str = "entrollm-plan";
/// The schema version this build reads and writes (both files).
pub const FILE_VERSION: u32 = 1;
/// Larger files are refused unread: a tune file of a large model is well under a megabyte.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// What a measurement is tied to: timings from another device or thread count do not transfer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceId {
    pub kind: DeviceKind,
    /// GPU name, or CPU model name.
    pub name: String,
    /// CPU threads the timings ran on.
    pub threads: Option<usize>,
    pub sm_count: Option<u32>,
    /// CUDA driver version.
    pub driver: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelId {
    pub path: String,
    /// Identifies the checkpoint's contents (config, tensor names, shapes, dtypes).
    pub fingerprint: String,
    pub layers: usize,
}

/// One stored form of a launch, measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub form: String,
    /// The form's tuned parameters, as the form spells them.
    pub variant: String,
    /// This launch's own stored size in this form.
    pub bytes: u64,
    pub latency_us: f64,
    /// The launch whose timing is reused (same shape); `None` when timed itself.
    pub timed_as: Option<String>,
    /// On this launch's size–latency Pareto front.
    pub pareto: bool,
    /// The fastest of the form's launch configurations on this device (warps per block, rows or
    /// tiles per warp, resident blocks), which `latency_us` was timed with, as the GPU form spells
    /// it; `None`: the form has one launch (CPU forms; the cost model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_config: Option<String>,
}

/// One launch of the forward pass and its measured forms.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchTune {
    /// `layers.3.qkv`, `lm_head`, `embed`.
    pub id: String,
    /// qkv | o | gate_up | down | lm_head | embed
    pub launch: String,
    /// The checkpoint tensors the launch reads.
    pub tensors: Vec<String>,
    pub rows: usize,
    pub cols: usize,
    /// Launches with equal keys share timings.
    pub shape_key: String,
    pub points: Vec<Point>,
}

impl LaunchTune {
    /// Set each point's `pareto` flag from the points' size–latency front.
    pub fn mark_pareto(&mut self) {
        let front: HashSet<usize> = pareto_front(&self.xy()).into_iter().collect();
        for (i, p) in self.points.iter_mut().enumerate() {
            p.pareto = front.contains(&i);
        }
    }

    fn xy(&self) -> Vec<(u64, f64)> {
        self.points
            .iter()
            .map(|p| (p.bytes, p.latency_us))
            .collect()
    }

    /// Indices of the Pareto points, bytes ascending (latency descending).
    pub fn front(&self) -> Vec<usize> {
        pareto_front(&self.xy())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuneFile {
    pub format: String,
    pub version: u32,
    pub entrollm_version: String,
    pub device: DeviceId,
    pub model: ModelId,
    /// How the timings were taken, for people.
    pub protocol: String,
    /// Measured non-weight cost of a decode step (attention, norms, sampling), µs.
    pub step_overhead_us: Option<f64>,
    pub launches: Vec<LaunchTune>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CostModel {
    /// Latencies measured by `entrollm tune` for this model.
    Measured,
    /// No tune file: predicted sizes and latencies from the tune data shipped for this device
    /// (`costs`), fitted to `entrollm tune` measurements of other models on it.
    TuneData,
    /// No tune file and no tune data for this device: predicted sizes and the forms' documented
    /// cost model.
    Default,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanChoice {
    pub id: String,
    pub launch: String,
    pub tensors: Vec<String>,
    pub form: String,
    pub variant: String,
    pub bytes: u64,
    pub latency_us: f64,
    /// The point's launch configuration ([`Point::launch_config`]), which serving applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_config: Option<String>,
}

/// The knapsack's optimality certificate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Certificate {
    /// LP-relaxation lower bound on the weight launches' total latency within the budget.
    pub lp_bound_us: f64,
    /// (chosen − bound) / bound.
    pub gap: f64,
    pub grid_bytes: u64,
    pub grid_loss_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    pub version: u32,
    pub entrollm_version: String,
    pub device: DeviceId,
    pub model: ModelId,
    /// The whole budget (reserved bytes included); `None`: every launch at its fastest.
    pub budget_bytes: Option<u64>,
    /// KV cache and workspace, reserved before the weights.
    pub reserved_bytes: u64,
    pub cost_model: CostModel,
    pub choices: Vec<PlanChoice>,
    /// Weight bytes of the choices.
    pub total_bytes: u64,
    pub predicted_step_us: f64,
    pub predicted_tok_s: f64,
    pub certificate: Option<Certificate>,
}

fn file_err(path: &Path, why: impl Into<String>) -> TuneError {
    TuneError::File {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// Read `path` as JSON of the given `format` and [`FILE_VERSION`], refusing anything else.
fn read_json<T: DeserializeOwned>(path: &Path, format: &str, what: &str) -> Result<T, TuneError> {
    let io = |source| TuneError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(file_err(
            path,
            format!("not a regular file; expected a {what}"),
        ));
    }
    let too_big = |len: u64| {
        file_err(
            path,
            format!("{len} bytes is more than a {what} may be ({MAX_FILE_BYTES} bytes)"),
        )
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    entrollm_format::input::open_regular(path)
        .map_err(io)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big(bytes.len() as u64));
    }
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| file_err(path, format!("not a {what}: invalid JSON: {e}")))?;
    let found = value.get("format").and_then(|f| f.as_str());
    if found != Some(format) {
        let other = match found {
            Some(TUNE_FORMAT) => " (it is a tune file)",
            Some(PLAN_FORMAT) => " (it is a plan file)",
            _ => "",
        };
        return Err(file_err(
            path,
            format!("not a {what}: \"format\" is {found:?}, expected {format:?}{other}"),
        ));
    }
    let version = value.get("version").and_then(|v| v.as_u64());
    if version != Some(FILE_VERSION as u64) {
        let remake = if format == TUNE_FORMAT {
            "re-run `entrollm tune`"
        } else {
            "re-run `entrollm plan`"
        };
        return Err(file_err(
            path,
            format!(
                "{what} version {} is not the version {FILE_VERSION} this entrollm \
                 ({ENTROLLM_VERSION}) reads; {remake} to make a current one",
                version.map_or_else(|| "missing".to_string(), |v| v.to_string())
            ),
        ));
    }
    serde_json::from_value(value).map_err(|e| file_err(path, format!("malformed {what}: {e}")))
}

/// Write `value` as pretty JSON to `path` atomically.
fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), TuneError> {
    let mut json = serde_json::to_vec_pretty(value)
        .map_err(|e| file_err(path, format!("cannot serialise: {e}")))?;
    json.push(b'\n');
    write_atomic(path, &json)
}

/// Write `bytes` to a temporary file beside `path`, then rename it over `path`, so readers see the
/// old file or the new one, never half of one.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TuneError> {
    let name = path
        .file_name()
        .ok_or_else(|| file_err(path, "not a file name to write"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    result.map_err(|source| {
        let _ = fs::remove_file(&tmp);
        TuneError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

fn finite(v: f64, min: f64) -> bool {
    v.is_finite() && v >= min
}

/// `major.minor` of a version string.
fn major_minor(v: &str) -> Option<(u64, u64)> {
    let mut it = v.split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

impl TuneFile {
    /// An empty tune file for `device` and `model`, stamped with this entrollm's version.
    pub fn new(device: DeviceId, model: ModelId, protocol: impl Into<String>) -> Self {
        TuneFile {
            format: TUNE_FORMAT.into(),
            version: FILE_VERSION,
            entrollm_version: ENTROLLM_VERSION.into(),
            device,
            model,
            protocol: protocol.into(),
            step_overhead_us: None,
            launches: Vec::new(),
        }
    }

    pub fn read(path: &Path) -> Result<Self, TuneError> {
        let tune: TuneFile = read_json(path, TUNE_FORMAT, "tune file")?;
        tune.validate().map_err(|why| file_err(path, why))?;
        Ok(tune)
    }

    pub fn write(&self, path: &Path) -> Result<(), TuneError> {
        self.validate().map_err(|why| {
            file_err(
                path,
                format!("refusing to write an invalid tune file: {why}"),
            )
        })?;
        write_json(path, self)
    }

    pub fn launch(&self, id: &str) -> Option<&LaunchTune> {
        self.launches.iter().find(|l| l.id == id)
    }

    /// Set every launch's `pareto` flags from its points.
    pub fn mark_pareto(&mut self) {
        self.launches.iter_mut().for_each(LaunchTune::mark_pareto);
    }

    /// What a reader relies on: unique launch ids, measured points with finite latencies, pareto
    /// flags that are the points' front, reused timings that name a launch of the same shape.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(o) = self.step_overhead_us.filter(|&o| !finite(o, 0.0)) {
            return Err(format!("step_overhead_us {o} is not a finite number ≥ 0"));
        }
        let mut shapes: HashMap<&str, &str> = HashMap::new();
        for l in &self.launches {
            if l.id.is_empty() {
                return Err("a launch has an empty id".into());
            }
            if shapes.insert(&l.id, &l.shape_key).is_some() {
                return Err(format!("launch {:?} appears twice", l.id));
            }
        }
        for l in &self.launches {
            if l.points.is_empty() {
                return Err(format!("launch {:?} has no measured points", l.id));
            }
            for p in &l.points {
                if !(p.latency_us.is_finite() && p.latency_us > 0.0) {
                    return Err(format!(
                        "launch {:?}, form {} {}: latency_us {} is not a positive number",
                        l.id, p.form, p.variant, p.latency_us
                    ));
                }
                if let Some(src) = &p.timed_as {
                    match shapes.get(src.as_str()) {
                        Some(key) if *key == l.shape_key && src != &l.id => {}
                        Some(_) => {
                            return Err(format!(
                                "launch {:?} reuses the timing of {src:?}, which is itself or of another shape",
                                l.id
                            ))
                        }
                        None => {
                            return Err(format!(
                                "launch {:?} reuses the timing of {src:?}, which is not in the file",
                                l.id
                            ))
                        }
                    }
                }
            }
            let front: HashSet<usize> = l.front().into_iter().collect();
            if let Some((i, p)) = l
                .points
                .iter()
                .enumerate()
                .find(|(i, p)| p.pareto != front.contains(i))
            {
                return Err(format!(
                    "launch {:?}, point {i} ({} {}): its pareto flag is {} but the points say {}",
                    l.id, p.form, p.variant, p.pareto, !p.pareto
                ));
            }
        }
        Ok(())
    }

    /// Refuse a tune file made on another device or by another entrollm major.minor version,
    /// naming each field that differs; with `force`, accept it and return those differences for a
    /// warning.
    pub fn check_device(&self, current: &DeviceId, force: bool) -> Result<Vec<String>, TuneError> {
        fn show<T: std::fmt::Debug>(v: &Option<T>) -> String {
            v.as_ref()
                .map_or_else(|| "none".to_string(), |v| format!("{v:?}"))
        }
        let t = &self.device;
        let mut device = Vec::new();
        if t.kind != current.kind {
            device.push(format!("kind {:?} here {:?}", t.kind, current.kind));
        }
        if t.name != current.name {
            device.push(format!("name {:?} here {:?}", t.name, current.name));
        }
        if t.threads != current.threads {
            device.push(format!(
                "threads {} here {}",
                show(&t.threads),
                show(&current.threads)
            ));
        }
        if t.sm_count != current.sm_count {
            device.push(format!(
                "sm_count {} here {}",
                show(&t.sm_count),
                show(&current.sm_count)
            ));
        }
        if t.driver != current.driver {
            device.push(format!(
                "driver {} here {}",
                show(&t.driver),
                show(&current.driver)
            ));
        }
        let version_differs = major_minor(&self.entrollm_version) != major_minor(ENTROLLM_VERSION);
        let mut diffs = device.clone();
        if version_differs {
            diffs.push(format!(
                "entrollm_version {:?} here {ENTROLLM_VERSION:?}",
                self.entrollm_version
            ));
        }
        if diffs.is_empty() || force {
            return Ok(diffs);
        }
        let what = match (device.is_empty(), version_differs) {
            (false, true) => "device and entrollm version",
            (false, false) => "device",
            _ => "entrollm version",
        };
        Err(TuneError::Mismatch {
            what,
            diffs: diffs.join(", "),
        })
    }
}

impl PlanFile {
    pub fn read(path: &Path) -> Result<Self, TuneError> {
        let plan: PlanFile = read_json(path, PLAN_FORMAT, "plan file")?;
        plan.validate().map_err(|why| file_err(path, why))?;
        Ok(plan)
    }

    pub fn write(&self, path: &Path) -> Result<(), TuneError> {
        self.validate().map_err(|why| {
            file_err(
                path,
                format!("refusing to write an invalid plan file: {why}"),
            )
        })?;
        write_json(path, self)
    }

    /// The choice for launch `id`.
    pub fn choice(&self, id: &str) -> Option<&PlanChoice> {
        self.choices.iter().find(|c| c.id == id)
    }

    /// Consistent totals, a budget that holds, finite predictions.
    pub fn validate(&self) -> Result<(), String> {
        let mut ids = HashSet::new();
        for c in &self.choices {
            if !ids.insert(c.id.as_str()) {
                return Err(format!("launch {:?} is chosen twice", c.id));
            }
            if !finite(c.latency_us, 0.0) {
                return Err(format!(
                    "launch {:?}: latency_us {} is not finite",
                    c.id, c.latency_us
                ));
            }
        }
        let total: u128 = self.choices.iter().map(|c| c.bytes as u128).sum();
        if total != self.total_bytes as u128 {
            return Err(format!(
                "total_bytes {} is not the sum of the choices' bytes ({total})",
                self.total_bytes
            ));
        }
        if let Some(b) = self.budget_bytes {
            if total + self.reserved_bytes as u128 > b as u128 {
                return Err(format!(
                    "the choices ({total} bytes) and the reserve ({} bytes) exceed the budget of {b} bytes",
                    self.reserved_bytes
                ));
            }
        }
        if !(self.predicted_step_us.is_finite() && self.predicted_step_us > 0.0) {
            return Err(format!(
                "predicted_step_us {} is not positive",
                self.predicted_step_us
            ));
        }
        let tok_s = 1e6 / self.predicted_step_us;
        if (self.predicted_tok_s - tok_s).abs() > 1e-9 * tok_s {
            return Err(format!(
                "predicted_tok_s {} is not 1e6 / predicted_step_us ({tok_s})",
                self.predicted_tok_s
            ));
        }
        if let Some(c) = &self.certificate {
            if !(finite(c.lp_bound_us, 0.0) && finite(c.gap, 0.0)) {
                return Err(format!(
                    "certificate {c:?} holds a non-finite or negative number"
                ));
            }
        }
        Ok(())
    }
}

/// The plan for `tune` under `budget` bytes in all, of which `reserved` (KV cache, workspace) are
/// taken first: per launch the Pareto point the knapsack picks, or with no budget each launch's
/// fastest point. The cost model is [`CostModel::Measured`]; a caller planning from predicted
/// latencies sets [`CostModel::Default`].
pub fn plan(tune: &TuneFile, budget: Option<u64>, reserved: u64) -> Result<PlanFile, TuneError> {
    plan_no_worse_than(tune, budget, reserved, None)
}

/// [`plan`], and never slower than `incumbent` (a point per launch: the forms the model is held
/// in) where that fits the budget: the knapsack's grid rounds sizes up, so a plan that fills the
/// budget exactly (the weights as stored, under the default budget) may be out of its reach.
pub fn plan_no_worse_than(
    tune: &TuneFile,
    budget: Option<u64>,
    reserved: u64,
    incumbent: Option<&[usize]>,
) -> Result<PlanFile, TuneError> {
    tune.validate()
        .map_err(|why| TuneError::Plan(format!("invalid tune file: {why}")))?;
    if tune.launches.is_empty() {
        return Err(TuneError::Plan("the tune file has no launches".into()));
    }
    if let Some(inc) = incumbent {
        let ok = inc.len() == tune.launches.len()
            && inc
                .iter()
                .zip(&tune.launches)
                .all(|(&i, l)| i < l.points.len());
        if !ok {
            return Err(TuneError::Plan(
                "the incumbent names no point of some launch".into(),
            ));
        }
    }
    let fronts: Vec<Vec<usize>> = tune.launches.iter().map(LaunchTune::front).collect();
    let (mut picks, certificate): (Vec<usize>, Option<Certificate>) = match budget {
        None => (fronts.iter().map(|f| *f.last().unwrap()).collect(), None),
        Some(b) => {
            let groups: Vec<Vec<Item>> = tune
                .launches
                .iter()
                .zip(&fronts)
                .map(|(l, f)| {
                    f.iter()
                        .map(|&i| Item {
                            bytes: l.points[i].bytes,
                            cost: l.points[i].latency_us,
                        })
                        .collect()
                })
                .collect();
            let infeasible = || TuneError::Infeasible {
                min_bytes: knapsack::min_bytes(&groups).saturating_add(reserved),
                budget: b,
                reserved,
            };
            let weights = b.checked_sub(reserved).ok_or_else(infeasible)?;
            let s = knapsack::solve(&groups, weights).map_err(|e| match e {
                TuneError::Infeasible { .. } => infeasible(),
                e => e,
            })?;
            let picks = s.picks.iter().zip(&fronts).map(|(&k, f)| f[k]).collect();
            let cert = Certificate {
                lp_bound_us: s.lp_bound,
                gap: s.gap,
                grid_bytes: s.grid_bytes,
                grid_loss_bytes: s.grid_loss_bytes,
            };
            (picks, Some(cert))
        }
    };
    if let Some(inc) = incumbent {
        let sum = |p: &[usize]| -> (u128, f64) {
            p.iter()
                .zip(&tune.launches)
                .fold((0, 0.0), |(b, us), (&i, l)| {
                    (b + l.points[i].bytes as u128, us + l.points[i].latency_us)
                })
        };
        let (inc_bytes, inc_us) = sum(inc);
        let fits = budget.is_none_or(|b| inc_bytes + reserved as u128 <= b as u128);
        if fits && inc_us < sum(&picks).1 {
            picks = inc.to_vec();
        }
    }
    let choices: Vec<PlanChoice> = tune
        .launches
        .iter()
        .zip(&picks)
        .map(|(l, &i)| {
            let p = &l.points[i];
            PlanChoice {
                id: l.id.clone(),
                launch: l.launch.clone(),
                tensors: l.tensors.clone(),
                form: p.form.clone(),
                variant: p.variant.clone(),
                bytes: p.bytes,
                latency_us: p.latency_us,
                launch_config: p.launch_config.clone(),
            }
        })
        .collect();
    let total_bytes = choices.iter().map(|c| c.bytes).sum();
    let step =
        choices.iter().map(|c| c.latency_us).sum::<f64>() + tune.step_overhead_us.unwrap_or(0.0);
    let plan = PlanFile {
        format: PLAN_FORMAT.into(),
        version: FILE_VERSION,
        entrollm_version: ENTROLLM_VERSION.into(),
        device: tune.device.clone(),
        model: tune.model.clone(),
        budget_bytes: budget,
        reserved_bytes: reserved,
        cost_model: CostModel::Measured,
        choices,
        total_bytes,
        predicted_step_us: step,
        predicted_tok_s: 1e6 / step,
        certificate,
    };
    plan.validate().map_err(|why| {
        TuneError::Plan(format!(
            "{why} (budget {})",
            budget.map_or("none".into(), human_bytes)
        ))
    })?;
    Ok(plan)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Instant;

    /// A Llama-8B-shaped tune file: realistic sizes per form (each layer's sizes a little
    /// different, its timing reused from layer 0) and bandwidth-bound latencies.
    pub(crate) fn synthetic_tune(layers: usize) -> TuneFile {
        let device = DeviceId {
            kind: DeviceKind::Cuda,
            name: "NVIDIA H200".into(),
            threads: None,
            sm_count: Some(132),
            driver: Some("570.86".into()),
        };
        let model = ModelId {
            path: "/models/llama-8b".into(),
            fingerprint: "xxh3:0123456789abcdef".into(),
            layers,
        };
        let mut tune = TuneFile::new(device, model, "synthetic: cold cache, median of 5 bursts");
        tune.step_overhead_us = Some(600.0);
        // (form, variant, bytes per weight, µs per MB, fixed µs)
        let forms: [(&str, &str, f64, f64, f64); 11] = [
            ("bf16", "", 2.0, 0.210, 3.0),
            ("palette-bf16", "w4", 1.62, 0.250, 4.0),
            ("palette-bf16", "w8", 1.62, 0.235, 4.5),
            ("dtans", "single M=2^8 t=256", 1.49, 0.300, 5.0),
            ("dtans", "single M=2^9 t=256", 1.43, 0.320, 5.0),
            ("dtans", "single M=2^10 t=384", 1.40, 0.345, 5.5),
            ("dtans", "single M=2^12 t=512", 1.385, 0.420, 6.0),
            ("dtans", "single M=2^10 t=256", 1.42, 0.350, 5.5),
            ("dtans", "pair M=2^12 t=64", 1.39, 0.390, 7.0),
            ("df11", "", 1.38, 0.600, 8.0),
            ("palette-bf16", "w2", 1.66, 0.240, 4.0),
        ];
        let shapes = [
            ("qkv", 6144usize, 4096usize),
            ("o", 4096, 4096),
            ("gate_up", 28672, 4096),
            ("down", 4096, 14336),
        ];
        let mut g = entrollm_codec::rng::SplitMix64::new(3);
        let mut noise = || g.unit();
        let launch = |id: String,
                      kind: &str,
                      rows: usize,
                      cols: usize,
                      timed: Option<String>,
                      noise: &mut dyn FnMut() -> f64| {
            let n = (rows * cols) as f64;
            let jitter = 1.0 + 0.02 * (noise() - 0.5);
            let points = forms
                .iter()
                .map(|&(form, variant, bpw, us_per_mb, fixed)| {
                    let bytes = if form == "bf16" {
                        n * 2.0
                    } else {
                        n * bpw * jitter
                    };
                    let base = n * bpw / 1e6 * us_per_mb + fixed;
                    Point {
                        form: form.into(),
                        variant: variant.into(),
                        bytes: bytes as u64,
                        latency_us: if kind == "embed" {
                            1.0 + 0.01 * bpw + fixed * 0.1
                        } else {
                            base
                        },
                        timed_as: timed.clone(),
                        pareto: false,
                        launch_config: None,
                    }
                })
                .collect();
            let layer = id.rsplit_once('.').map_or("", |(l, _)| l);
            let tensors = match kind {
                "qkv" => ["q_proj", "k_proj", "v_proj"]
                    .map(|t| format!("model.{layer}.self_attn.{t}.weight"))
                    .to_vec(),
                "o" => vec![format!("model.{layer}.self_attn.o_proj.weight")],
                "gate_up" => ["gate_proj", "up_proj"]
                    .map(|t| format!("model.{layer}.mlp.{t}.weight"))
                    .to_vec(),
                "down" => vec![format!("model.{layer}.mlp.down_proj.weight")],
                "embed" => vec!["model.embed_tokens.weight".to_string()],
                _ => vec!["lm_head.weight".to_string()],
            };
            LaunchTune {
                id,
                launch: kind.into(),
                tensors,
                rows,
                cols,
                shape_key: format!("{kind}:{rows}x{cols}"),
                points,
            }
        };
        tune.launches.push(launch(
            "embed".into(),
            "embed",
            128256,
            4096,
            None,
            &mut noise,
        ));
        for l in 0..layers {
            for &(kind, rows, cols) in &shapes {
                let timed = (l > 0).then(|| format!("layers.0.{kind}"));
                let mut lt = launch(
                    format!("layers.{l}.{kind}"),
                    kind,
                    rows,
                    cols,
                    timed,
                    &mut noise,
                );
                if l > 0 {
                    // Same shape, same timing: copy layer 0's latencies.
                    let first = tune.launch(&format!("layers.0.{kind}")).unwrap();
                    for (p, q) in lt.points.iter_mut().zip(&first.points) {
                        p.latency_us = q.latency_us;
                    }
                }
                tune.launches.push(lt);
            }
        }
        tune.launches.push(launch(
            "lm_head".into(),
            "lm_head",
            128256,
            4096,
            None,
            &mut noise,
        ));
        tune.mark_pareto();
        tune
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("entrollm-tune-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn tune_and_plan_files_round_trip() {
        let dir = tmpdir("roundtrip");
        let tune = synthetic_tune(4);
        let p = dir.join("tune.json");
        tune.write(&p).unwrap();
        assert!(
            TuneFile::read(&p).unwrap() == tune,
            "tune file changed in a round trip"
        );
        let budget = 10_000_000_000;
        let plan = plan(&tune, Some(budget), 1_000_000_000).unwrap();
        let q = dir.join("plan.json");
        plan.write(&q).unwrap();
        assert!(
            PlanFile::read(&q).unwrap() == plan,
            "plan file changed in a round trip"
        );
        // Overwriting leaves exactly the new file and no temporary.
        plan.write(&q).unwrap();
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let text = fs::read_to_string(&q).unwrap();
        assert!(
            text.contains("\"format\": \"entrollm-plan\"")
                && text.contains("\"cost_model\": \"measured\"")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn launch_configurations_go_from_tune_file_to_plan() {
        let dir = tmpdir("launch-config");
        let mut tune = synthetic_tune(2);
        for (i, l) in tune.launches.iter_mut().enumerate() {
            for (j, p) in l.points.iter_mut().enumerate() {
                p.launch_config = ((i + j) % 3 != 0).then(|| format!("w{}r1u8", 4 + j));
            }
        }
        let p = dir.join("tune.json");
        tune.write(&p).unwrap();
        assert!(TuneFile::read(&p).unwrap() == tune);
        // Written only where there is one; a file from before the field reads as none.
        let text = fs::read_to_string(&p).unwrap();
        let with = text.matches("\"launch_config\"").count();
        let points: usize = tune.launches.iter().map(|l| l.points.len()).sum();
        assert!(with > 0 && with < points, "{with} of {points}");
        let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
        for l in old["launches"].as_array_mut().unwrap() {
            for p in l["points"].as_array_mut().unwrap() {
                p.as_object_mut().unwrap().remove("launch_config");
            }
        }
        let q = dir.join("old.json");
        fs::write(&q, old.to_string()).unwrap();
        let back = TuneFile::read(&q).unwrap();
        assert!(back
            .launches
            .iter()
            .all(|l| l.points.iter().all(|p| p.launch_config.is_none())));
        for budget in [None, Some(3_000_000_000)] {
            let plan = plan(&tune, budget, 0).unwrap();
            for c in &plan.choices {
                let l = tune.launches.iter().find(|l| l.id == c.id).unwrap();
                let p = l
                    .points
                    .iter()
                    .find(|p| (&p.form, &p.variant) == (&c.form, &c.variant))
                    .unwrap();
                assert_eq!(c.launch_config, p.launch_config, "{}", c.id);
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn readers_refuse_other_files_naming_them() {
        let dir = tmpdir("refuse");
        let tune = synthetic_tune(1);
        let good = serde_json::to_value(&tune).unwrap();
        let case = |name: &str, text: String| {
            let p = dir.join(name);
            fs::write(&p, text).unwrap();
            let e = TuneFile::read(&p).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
            e
        };
        let mut v = good.clone();
        v["format"] = "entrollm-plan".into();
        assert!(case("plan-as-tune.json", v.to_string()).contains("it is a plan file"));
        let mut v = good.clone();
        v["version"] = 2.into();
        let e = case("v2.json", v.to_string());
        assert!(
            e.contains("version 2") && e.contains("entrollm tune"),
            "{e}"
        );
        let mut v = good.clone();
        v.as_object_mut().unwrap().remove("version");
        assert!(case("nov.json", v.to_string()).contains("version missing"));
        assert!(case("junk.json", "{not json".into()).contains("invalid JSON"));
        assert!(case("array.json", "[]".into()).contains("\"format\" is None"));
        let mut v = good.clone();
        v["surprise"] = 1.into();
        assert!(case("unknown.json", v.to_string()).contains("unknown field"));
        let mut v = good.clone();
        v["launches"][1]["points"][0]["pareto"] = (!tune.launches[1].points[0].pareto).into();
        assert!(case("flags.json", v.to_string()).contains("pareto flag"));
        let mut v = good.clone();
        v["launches"][1]["points"][0]["timed_as"] = "layers.9.qkv".into();
        assert!(case("timed.json", v.to_string()).contains("not in the file"));
        let mut v = good.clone();
        v["launches"][2]["id"] = "embed".into();
        assert!(case("dup.json", v.to_string()).contains("twice"));
        // A directory, and a file over the size limit (sparse, so cheap).
        let e = TuneFile::read(&dir).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let big = dir.join("big.json");
        fs::File::create(&big)
            .unwrap()
            .set_len(MAX_FILE_BYTES + 1)
            .unwrap();
        let e = TuneFile::read(&big).unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("more than"), "{e}");
        let e = PlanFile::read(&dir.join("missing.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.json"), "{e}");
        // A plan whose totals were edited.
        let mut plan = plan(&tune, None, 0).unwrap();
        plan.total_bytes += 1;
        let p = dir.join("edited-plan.json");
        fs::write(&p, serde_json::to_string(&plan).unwrap()).unwrap();
        let e = PlanFile::read(&p).unwrap_err().to_string();
        assert!(
            e.contains("edited-plan.json") && e.contains("total_bytes"),
            "{e}"
        );
        assert!(plan.write(&p).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_device_or_version_is_refused_unless_forced() {
        let tune = synthetic_tune(1);
        let here = tune.device.clone();
        assert_eq!(
            tune.check_device(&here, false).unwrap(),
            Vec::<String>::new()
        );
        let mut other = here.clone();
        other.sm_count = Some(108);
        other.name = "NVIDIA A100".into();
        let e = tune.check_device(&other, false).unwrap_err().to_string();
        assert!(
            e.contains("sm_count 132 here 108")
                && e.contains("NVIDIA A100")
                && e.contains("--force-tune"),
            "{e}"
        );
        assert_eq!(tune.check_device(&other, true).unwrap().len(), 2);
        let mut other = here.clone();
        other.driver = Some("580.1".into());
        assert!(tune
            .check_device(&other, false)
            .unwrap_err()
            .to_string()
            .contains("driver"));
        let cpu = DeviceId {
            kind: DeviceKind::Cpu,
            name: "AMD EPYC".into(),
            threads: Some(2),
            sm_count: None,
            driver: None,
        };
        let mut t = tune.clone();
        t.device = cpu.clone();
        let mut more = cpu.clone();
        more.threads = Some(16);
        let e = t.check_device(&more, false).unwrap_err().to_string();
        assert!(e.contains("threads 2 here 16"), "{e}");
        t.entrollm_version = "0.0.9".into();
        let e = t.check_device(&cpu, false).unwrap_err().to_string();
        assert!(e.contains("entrollm version") && e.contains("0.0.9"), "{e}");
        // A patch release reads the same tune files.
        let (maj, min) = major_minor(ENTROLLM_VERSION).unwrap();
        t.entrollm_version = format!("{maj}.{min}.99");
        assert!(t.check_device(&cpu, false).is_ok());
    }

    #[test]
    fn plans_fit_their_budget_and_follow_the_knapsack() {
        let tune = synthetic_tune(32);
        let fastest = plan(&tune, None, 0).unwrap();
        assert!(fastest.certificate.is_none());
        for (c, l) in fastest.choices.iter().zip(&tune.launches) {
            let best = l
                .points
                .iter()
                .map(|p| p.latency_us)
                .fold(f64::INFINITY, f64::min);
            assert_eq!(c.latency_us, best, "{}", c.id);
        }
        let sum: f64 = fastest.choices.iter().map(|c| c.latency_us).sum();
        assert_eq!(fastest.predicted_step_us, sum + 600.0);
        let smallest: u64 = tune
            .launches
            .iter()
            .map(|l| l.points.iter().map(|p| p.bytes).min().unwrap())
            .sum();
        let reserved = 2_000_000_000;
        let mut last = f64::INFINITY;
        for t in [0.0, 0.25, 0.5, 0.75, 1.0] {
            let budget = reserved + smallest + ((fastest.total_bytes - smallest) as f64 * t) as u64;
            let started = Instant::now();
            let p = plan(&tune, Some(budget), reserved).unwrap();
            eprintln!(
                "8B-shaped, {} launches, budget {}: {:?}, {:.1} tok/s, gap {:.2e}",
                tune.launches.len(),
                human_bytes(budget),
                started.elapsed(),
                p.predicted_tok_s,
                p.certificate.unwrap().gap
            );
            assert!(p.total_bytes + reserved <= budget);
            assert!(
                p.predicted_step_us <= last,
                "a larger budget is never slower"
            );
            last = p.predicted_step_us;
            assert!(p.certificate.unwrap().gap < 1e-3);
            for (c, l) in p.choices.iter().zip(&tune.launches) {
                let pt = l
                    .points
                    .iter()
                    .find(|q| q.form == c.form && q.variant == c.variant)
                    .unwrap();
                assert!(pt.pareto && pt.bytes == c.bytes);
            }
        }
        assert_eq!(last, fastest.predicted_step_us);
        let e = plan(&tune, Some(reserved + smallest - 1), reserved).unwrap_err();
        assert!(
            matches!(e, TuneError::Infeasible { min_bytes, .. } if min_bytes == reserved + smallest)
        );
        assert!(e.to_string().contains("KV cache"), "{e}");
        let e = plan(&tune, Some(reserved - 1), reserved).unwrap_err();
        assert!(
            matches!(e, TuneError::Infeasible { min_bytes, .. } if min_bytes == reserved + smallest)
        );
    }
}
