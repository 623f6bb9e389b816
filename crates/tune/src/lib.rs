//! The budget planner: which form each launch of the forward pass is stored in.
//!
//! The tuner ([`tuner`]) asks the weight forms (`entrollm_model::forms`) for each launch's
//! variants, times them on the device and keeps their size–latency points in a [`TuneFile`]; the
//! planner turns those points and a memory [`Budget`] into a [`PlanFile`] by a multiple-choice
//! knapsack ([`knapsack::solve`]), certified by its LP-relaxation bound, draws the fronts
//! ([`plot::plot`]) and re-forms a model by a plan ([`planner`]). The knapsack, files and plots
//! know nothing of the forms themselves: a form is a name, a variant, a size and a latency.

pub mod budget;
pub mod costs;
mod error;
pub mod file;
pub mod front;
pub mod knapsack;
pub mod lossy;
pub mod planner;
pub mod plot;
pub mod tuner;

pub use budget::Budget;
pub use error::TuneError;
pub use file::{
    plan, Certificate, CostModel, DeviceId, DeviceKind, LaunchTune, ModelId, PlanChoice, PlanFile,
    Point, TuneFile,
};
pub use knapsack::{solve, Item, Solution};

/// The entrollm version that tune and plan files are stamped with and checked against.
pub const ENTROLLM_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `bytes` for messages: exact bytes plus a readable size, e.g. `12000000000 bytes (12.00 GB)`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    let (v, unit) = if b >= 1e9 {
        (b / 1e9, "GB")
    } else if b >= 1e6 {
        (b / 1e6, "MB")
    } else if b >= 1e3 {
        (b / 1e3, "kB")
    } else {
        return format!("{bytes} bytes");
    };
    format!("{bytes} bytes ({v:.2} {unit})")
}
