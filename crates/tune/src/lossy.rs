//! Plans that may code matrices lossily (`compress --budget SIZE --allow-lossy`): lossless forms
//! where they fit; otherwise the launches a lossy coder can take are planned `lossy` at the
//! highest average rate at which the whole plan fits, and the rest of the budget goes to the
//! other launches' speed as in any plan.
//!
//! The knapsack prices latency only, and a lossy form is smaller and (on a GPU) faster than any
//! lossless one, so it cannot be one more point of a launch's front: it would always win and
//! spend quality the budget did not ask for. Quality comes first instead: one rate for all the
//! lossy launches (the matrices' own rates are allocated around it by rate and distortion when
//! they are coded), the highest that fits.

use crate::file::{plan, PlanFile, Point, TuneFile};
use crate::TuneError;
use entrollm_model::forms::lossy::LOSSY;
use entrollm_model::forms::Form;
use std::collections::BTreeMap;

/// The rates a lossy plan may choose, bits a weight: below the lower the models this is for no
/// longer answer; above the upper the bytes buy little (the error is a fraction of a percent).
pub const RATES: (f64, f64) = (1.5, 8.0);
/// The rate grid, bits a weight.
const STEP: f64 = 0.01;
/// The coder's achieved size may exceed the rate asked by a little (bench/RESULTS.md: within
/// 0.1 %); a lossy launch is planned this much larger.
const SIZE_MARGIN: f64 = 0.005;

/// The launches a lossy coder can take: id → weights, and the form variant they would be coded in
/// (the quantiser).
pub struct LossyOffer {
    pub launches: BTreeMap<String, usize>,
    pub variant: String,
}

/// A plan, and the average rate of its lossy launches (`None`: every launch lossless).
pub struct LossyPlan {
    pub plan: PlanFile,
    pub rate: Option<f64>,
}

/// Planned bytes of `weights` coded at `rate`.
pub fn lossy_bytes(weights: usize, rate: f64) -> u64 {
    (weights as f64 * rate / 8.0 * (1.0 + SIZE_MARGIN)).ceil() as u64
}

/// `tune` with each offered launch's points replaced by one: `lossy` at `rate`, priced by the
/// form's default cost model (a tune file has no points for matrices not yet coded).
fn at_rate(tune: &TuneFile, offer: &LossyOffer, rate: f64) -> TuneFile {
    let device = crate::tuner::forms_device(tune.device.kind);
    let mut t = tune.clone();
    for l in &mut t.launches {
        if let Some(&w) = offer.launches.get(&l.id) {
            let bytes = lossy_bytes(w, rate);
            l.points = vec![Point {
                form: LOSSY.name().into(),
                variant: offer.variant.clone(),
                bytes,
                latency_us: LOSSY.default_cost_us(device, w, bytes as f64).max(1e-3),
                timed_as: None,
                pareto: true,
                launch_config: None,
            }];
            l.mark_pareto();
        }
    }
    t
}

/// The plan for `budget` (reserved bytes included) allowing lossy launches: lossless if that
/// fits; else the highest rate in [`RATES`] on a 0.01-bit grid at which it does. An error names
/// the smallest budget that fits at the lowest rate.
pub fn plan_allowing_lossy(
    tune: &TuneFile,
    budget: u64,
    reserved: u64,
    offer: &LossyOffer,
) -> Result<LossyPlan, TuneError> {
    match plan(tune, Some(budget), reserved) {
        Ok(plan) => return Ok(LossyPlan { plan, rate: None }),
        Err(TuneError::Infeasible { .. }) if !offer.launches.is_empty() => {}
        Err(TuneError::Infeasible {
            min_bytes,
            budget,
            reserved,
        }) => {
            return Err(TuneError::Plan(format!(
                "{}; no launch can be coded lossily (float matrices only, the embedding and output \
                 projection excepted)",
                TuneError::Infeasible {
                    min_bytes,
                    budget,
                    reserved
                }
            )))
        }
        Err(e) => return Err(e),
    }
    let steps = ((RATES.1 - RATES.0) / STEP).round() as i64;
    let rate = |k: i64| RATES.0 + k as f64 * STEP;
    let fits = |k: i64| plan(&at_rate(tune, offer, rate(k)), Some(budget), reserved);
    let mut best = match fits(0) {
        Ok(p) => (0, p),
        Err(TuneError::Infeasible { min_bytes, .. }) => {
            return Err(TuneError::Plan(format!(
                "--budget {}: too small even with the {} lossy launches at {} bits a weight, \
                 which needs {}; pass --budget {min_bytes} or more",
                crate::human_bytes(budget),
                offer.launches.len(),
                RATES.0,
                crate::human_bytes(min_bytes)
            )))
        }
        Err(e) => return Err(e),
    };
    // Fitting is monotone in the rate: bisect for the last grid rate that fits.
    let (mut lo, mut hi) = (0i64, steps + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match fits(mid) {
            Ok(p) => {
                lo = mid;
                best = (mid, p);
            }
            Err(TuneError::Infeasible { .. }) => hi = mid,
            Err(e) => return Err(e),
        }
    }
    let (k, plan) = best;
    Ok(LossyPlan {
        plan,
        rate: Some((rate(k) * 100.0).round() / 100.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::tests::synthetic_tune;

    fn offer(t: &TuneFile) -> LossyOffer {
        LossyOffer {
            launches: t
                .launches
                .iter()
                .filter(|l| l.id.starts_with("layers."))
                .map(|l| (l.id.clone(), l.rows * l.cols))
                .collect(),
            variant: "tcq32".into(),
        }
    }

    fn smallest(t: &TuneFile) -> u64 {
        t.launches
            .iter()
            .map(|l| l.points.iter().map(|p| p.bytes).min().unwrap())
            .sum()
    }

    /// Lossless where the budget allows; below, the highest grid rate that fits (one step more
    /// does not), every offered launch lossy, the rest lossless and within the budget; below the
    /// lowest rate an error naming the smallest budget, which then fits.
    #[test]
    fn lossy_launches_take_the_highest_rate_that_fits_and_only_when_needed() {
        let t = synthetic_tune(4);
        let o = offer(&t);
        let reserved = 1_000_000;
        let least = smallest(&t) + reserved;
        let p = plan_allowing_lossy(&t, least, reserved, &o).unwrap();
        assert!(p.rate.is_none());
        assert!(p.plan.choices.iter().all(|c| c.form != "lossy"));

        // Too small at the lowest rate: the error names the smallest budget, which fits there.
        let tiny = reserved + 1000;
        let err = plan_allowing_lossy(&t, tiny, reserved, &o)
            .err()
            .unwrap()
            .to_string();
        let min: u64 = err
            .split("pass --budget ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{err}"));
        let p = plan_allowing_lossy(&t, min, reserved, &o).unwrap();
        assert_eq!(p.rate, Some(RATES.0));

        let budget = (min + least) / 2;
        let p = plan_allowing_lossy(&t, budget, reserved, &o).unwrap();
        let r = p.rate.unwrap();
        assert!(RATES.0 < r && r <= RATES.1, "{r}");
        assert!(p.plan.total_bytes + reserved <= budget);
        for c in &p.plan.choices {
            assert_eq!(
                c.form == "lossy",
                o.launches.contains_key(&c.id),
                "{}",
                c.id
            );
        }
        assert!(plan(&at_rate(&t, &o, r + STEP), Some(budget), reserved).is_err());

        // Nothing to code lossily: the lossless error, saying so.
        let none = LossyOffer {
            launches: BTreeMap::new(),
            variant: "tcq32".into(),
        };
        let err = plan_allowing_lossy(&t, budget, reserved, &none)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no launch can be coded lossily"), "{err}");
    }
}
