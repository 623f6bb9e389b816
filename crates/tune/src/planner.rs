//! Plans for a loaded model: from a tune file (measured) or from the forms' predicted sizes and
//! default cost model; and the model re-formed by a plan.

use crate::costs::{CostKey, Costs};
use crate::file::{ModelId, PlanFile, TuneFile};
use crate::tuner::{forms_device, tune, LaunchTimer, Progress, TimedLaunch, Timing, TuneOptions};
use crate::DeviceKind;
use entrollm_model::forms::layout::{apply, launches, source_launch_bytes, LaunchForm};
use entrollm_model::weights::{Linear, ModelWeights};
use std::collections::BTreeMap;
use std::sync::Arc;

pub type Result<T> = std::result::Result<T, crate::TuneError>;

/// Latencies without a tune file of the model as a timer: the device's tune data (`table`) where
/// it covers the launch's form and values, else the form's documented cost model
/// ([`Form::default_cost_us`]) of the launch's weights and predicted bytes.
pub struct DefaultCost<'a> {
    pub device: DeviceKind,
    pub table: Option<&'a Costs>,
}

impl LaunchTimer for DefaultCost<'_> {
    fn device(&self) -> crate::file::DeviceId {
        crate::file::DeviceId {
            kind: self.device,
            name: "default cost model".into(),
            threads: None,
            sm_count: None,
            driver: None,
        }
    }
    fn protocol(&self) -> String {
        match self.table {
            Some(t) => format!(
                "tune data {} ({}, measured on {}): predicted sizes, latencies fitted to `entrollm \
                 tune` measurements of other models; the forms' cost model where it has none",
                t.name, t.table.device, t.table.measured_on
            ),
            None => "default cost model (docs/forms.md): predicted sizes, no measurement".into(),
        }
    }
    fn is_measured(&self) -> bool {
        false
    }
    fn time(
        &self,
        l: &TimedLaunch,
        _make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>>,
    ) -> Result<Option<Timing>> {
        let device = forms_device(self.device);
        if !l.form.runs_on(device) {
            return Ok(None);
        }
        let key = CostKey::new(l.form.name(), l.variant, &l.values, !l.products);
        let table = self
            .table
            .and_then(|t| t.launch_us(&key, l.matrices, l.weights, l.predicted_bytes));
        let us = match (table, l.products) {
            (Some(us), _) => us,
            (None, true) => l.form.default_cost_us(device, l.weights, l.predicted_bytes),
            // One row of the table.
            (None, false) => 1.0,
        };
        Ok(Some(us.into()))
    }
}

/// A stable fingerprint of a model's structure: config, and per launch its tensors' names,
/// shapes and value kinds (what a tune file's launches must match).
pub fn model_id(w: &ModelWeights, path: &str) -> Result<ModelId> {
    use std::hash::Hasher;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.write(format!("{:?}", w.config).as_bytes());
    for l in launches(w) {
        h.write(l.id.as_bytes());
        h.write(l.shape_key().as_bytes());
    }
    Ok(ModelId {
        path: path.to_string(),
        fingerprint: format!("{:016x}", h.finish()),
        layers: w.layers.len(),
    })
}

/// Bytes of `w` outside its launches (norms, biases): served as they are.
pub fn fixed_bytes(w: &ModelWeights) -> u64 {
    let launch: usize = launches(w).iter().map(|l| l.stored_bytes()).sum();
    (w.stored_bytes() - launch) as u64
}

/// The tune file to plan with: `tune` (checked against the model) or, without one, the one
/// [`DefaultCost`] gives with `table` (`Err` names the mismatch).
pub fn tune_for(
    w: &ModelWeights,
    id: ModelId,
    tune_file: Option<TuneFile>,
    device: DeviceKind,
    table: Option<&Costs>,
) -> Result<TuneFile> {
    if let Some(t) = tune_file {
        if t.model.fingerprint != id.fingerprint {
            return Err(crate::TuneError::Tune(format!(
                "the tune file was made for another model ({}, fingerprint {}; this one: {}) — \
                 run `entrollm tune` on this model",
                t.model.path, t.model.fingerprint, id.fingerprint
            )));
        }
        return Ok(t);
    }
    let opts = TuneOptions {
        step_overhead: false,
        ..TuneOptions::default()
    };
    let mut t = tune(
        w,
        id,
        None,
        &DefaultCost { device, table },
        &opts,
        &mut |_: Progress| {},
    )?;
    t.step_overhead_us =
        table.and_then(|c| c.step_us(w.layers.len(), crate::costs::step_width(&t.launches)));
    Ok(t)
}

/// Bytes the default budget gives the whole model: its launches as the source stores them
/// ([`source_launch_bytes`]), its norms and biases, and `reserved` (KV cache, workspace), capped
/// at `free` bytes.
pub fn default_budget(w: &ModelWeights, reserved: u64, free: u64) -> Result<u64> {
    let source = source_launch_bytes(w).map_err(crate::tuner::err)?;
    Ok((source + fixed_bytes(w) + reserved).min(free))
}

/// Per launch of `tune`, the point of the form `w` holds it in (`None` where a launch's form is
/// not among its points: a form the device has no kernel for).
pub fn held_points(w: &ModelWeights, tune: &TuneFile) -> Option<Vec<usize>> {
    let held: BTreeMap<String, (&'static str, String)> = launches(w)
        .into_iter()
        .map(|l| {
            let f = l.matrices[0].form();
            (l.id, (f.form, f.variant))
        })
        .collect();
    tune.launches
        .iter()
        .map(|l| {
            let (form, variant) = held.get(&l.id)?;
            l.points
                .iter()
                .position(|p| p.form == *form && p.variant == *variant)
        })
        .collect()
}

/// The plan for `w` from `tune` under `budget` (of which `reserved` first), never slower than
/// `w` as it is held where that fits ([`file::plan_no_worse_than`]).
pub fn plan_model(
    w: &ModelWeights,
    tune: &TuneFile,
    budget: Option<u64>,
    reserved: u64,
) -> Result<PlanFile> {
    let held = held_points(w, tune);
    crate::file::plan_no_worse_than(tune, budget, reserved + fixed_bytes(w), held.as_deref())
}

/// `w` re-formed as `plan` says (launches it does not name keep their form).
pub fn apply_plan(
    w: &ModelWeights,
    plan: &PlanFile,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<ModelWeights> {
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
    apply(w, &choices, progress).map_err(crate::tuner::err)
}
