//! What integrity costs at load: a container opened with every tensor checked against its
//! checksum (as every command opens it) against the same load unchecked, decoded at load (the
//! CPU default) and kept coded (as the GPU serves what does not fit dense, and `--keep-coded`).
//!
//! Run: cargo bench -p entrollm --bench load_8b -- CONTAINER [--repeats N]
//! (e.g. the synthetic Llama-3.1-8B BF16: `entrollm synth --shape llama-3.1-8b -o S`,
//! `entrollm compress S -o CONTAINER`). Loads alternate; the page cache is warm after the first.

use entrollm_model::load::{open_weights_with, LoadOptions};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let Some(path) = args.first().map(std::path::PathBuf::from) else {
        eprintln!("usage: load_8b CONTAINER [--repeats N]");
        std::process::exit(2);
    };
    let repeats = args
        .iter()
        .position(|a| a == "--repeats")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(3);
    let threads = rayon::current_num_threads();
    println!(
        "{}: {repeats} loads each, alternating, {threads} threads",
        path.display()
    );
    let warm = Instant::now();
    drop(
        open_weights_with(
            &path,
            LoadOptions {
                fused: true,
                ..LoadOptions::default()
            },
        )
        .unwrap(),
    );
    println!(
        "warm-up (kept coded, checked): {:.2} s",
        warm.elapsed().as_secs_f64()
    );
    for fused in [false, true] {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..repeats {
            for verify in [true, false] {
                let t = Instant::now();
                let w = open_weights_with(
                    &path,
                    LoadOptions {
                        fused,
                        verify,
                        ..LoadOptions::default()
                    },
                )
                .unwrap();
                times[verify as usize].push(t.elapsed().as_secs_f64());
                drop(w);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (checked, unchecked) = (median(&mut times[1]), median(&mut times[0]));
        println!(
            "{}: checked {checked:.2} s, unchecked {unchecked:.2} s (median of {repeats}), ratio {:.3}; all: {:?} / {:?}",
            if fused { "kept coded" } else { "decoded at load" },
            checked / unchecked,
            times[1],
            times[0]
        );
    }
}
