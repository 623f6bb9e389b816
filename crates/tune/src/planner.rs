//! Plans for a loaded model: from a tune file (measured) or from the forms' predicted sizes and
//! default cost model; and the model re-formed by a plan.

use crate::file::{ModelId, PlanFile, TuneFile};
use crate::tuner::{forms_device, tune, LaunchTimer, Progress, TimedLaunch, Timing, TuneOptions};
use crate::DeviceKind;
use entrollm_model::forms::layout::{apply, launches, LaunchForm};
use entrollm_model::weights::{Linear, ModelWeights};
use std::collections::BTreeMap;
use std::sync::Arc;

pub type Result<T> = std::result::Result<T, crate::TuneError>;

/// The documented default cost model as a timer: no measurement, each form's
/// [`Form::default_cost_us`] of the launch's weights and predicted bytes.
pub struct DefaultCost {
    pub device: DeviceKind,
}

impl LaunchTimer for DefaultCost {
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
        "default cost model (docs/forms.md): predicted sizes, no measurement".into()
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
        let us = match l.products {
            true => l.form.default_cost_us(device, l.weights, l.predicted_bytes),
            // One row of the table.
            false => 1.0,
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

/// The tune file to plan with: `tune` (checked against the model) or, without one, the default
/// cost model's (`Err` names the mismatch).
pub fn tune_for(
    w: &ModelWeights,
    id: ModelId,
    tune_file: Option<TuneFile>,
    device: DeviceKind,
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
    tune(
        w,
        id,
        None,
        &DefaultCost { device },
        &opts,
        &mut |_: Progress| {},
    )
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
