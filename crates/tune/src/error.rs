use std::path::PathBuf;

use crate::human_bytes;

/// Everything the planner can refuse, each message naming what to change.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(
        "budget of {} is too small: the smallest plan (every launch in its smallest form{}) needs {}; \
         pass --budget {min_bytes} or more",
        human_bytes(*budget),
        if *reserved > 0 { ", plus the KV cache and workspace reserved first" } else { "" },
        human_bytes(*min_bytes)
    )]
    Infeasible {
        /// The smallest total (reserved bytes included) that would fit.
        min_bytes: u64,
        budget: u64,
        reserved: u64,
    },
    #[error("knapsack group {group} has no choices; every launch needs at least one form")]
    EmptyGroup { group: usize },
    #[error("knapsack group {group}, choice {choice}: cost {cost} is not a finite number ≥ 0")]
    BadCost {
        group: usize,
        choice: usize,
        cost: f64,
    },
    #[error("knapsack group {group} has {count} choices left after pruning; at most 65535 are supported")]
    TooManyChoices { group: usize, count: usize },
    #[error("invalid budget {text:?}: {why}; accepted forms: 12GB, 11.5GiB, 500MB, 500MiB, 64kB, 64KiB, 1TB, 1TiB, plain bytes (123456), or a share of free device memory (80%)")]
    BudgetSyntax { text: String, why: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {why}", path.display())]
    File { path: PathBuf, why: String },
    #[error(
        "the tune file was made for another {what}: {diffs}; re-run `entrollm tune` here, \
         or pass --force-tune to use it anyway"
    )]
    Mismatch { what: &'static str, diffs: String },
    #[error("plan: {0}")]
    Plan(String),
    #[error("plot {}: {why}", path.display())]
    Plot { path: PathBuf, why: String },
    /// Tuning or re-forming a model failed (the message names the launch and form).
    #[error("{0}")]
    Tune(String),
}
