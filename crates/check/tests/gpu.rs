//! GPU tests, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test gpu -- --ignored --nocapture --test-threads=1`
//! (or the prebuilt test binary with the same arguments). Needs libcuda, libnvrtc and, for the
//! timing peer, libcublas on the library path.

use entrollm_check::bench::{GemvBench, LLAMA8B_GEMV_SHAPES};
use entrollm_check::selftest::run_selftest;
use entrollm_cuda::ops::gemv::GemvConfig;

mod common;
use common::open;

#[test]
#[ignore = "needs a GPU"]
fn gpu_selftest() {
    let dev = open();
    let seed = std::env::var("SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED);
    match run_selftest(&dev, seed) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_gemv_cold_timing() {
    let dev = open();
    println!(
        "{:<8} {:>6} {:>6} {:<18} {:>9} {:>7} {:>7}",
        "shape", "n", "k", "kernel", "median_us", "TB/s", "vs_cublas"
    );
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let mut bench = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("bench setup");
        let peer = bench.time_cublas().expect("cublas timing");
        let mut rows = vec![peer.clone()];
        for cfg in GemvConfig::CANDIDATES {
            rows.push(bench.time_ours(cfg).expect("gemv timing"));
        }
        for t in &rows {
            println!(
                "{:<8} {:>6} {:>6} {:<18} {:>9.2} {:>7.2} {:>7.3}  (copies {}, {} launches/burst)",
                name,
                n,
                k,
                t.kernel,
                t.median_us,
                t.weight_tb_per_s,
                peer.median_us / t.median_us,
                t.copies,
                t.launches_per_burst
            );
        }
        for cfg in GemvConfig::CANDIDATES {
            let err = bench.check_ours(cfg).expect("gemv check");
            assert!(
                err < 1e-5,
                "{name} {cfg}: rel L2 error {err:.3e} on the timed weights"
            );
        }
        let best = rows[1..]
            .iter()
            .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
            .unwrap();
        println!(
            "BEST {name}: {} {:.2} us vs cublas {:.2} us (x{:.3})",
            best.kernel,
            best.median_us,
            peer.median_us,
            peer.median_us / best.median_us
        );
    }
}

/// SmolLM2-135M on the GPU gives the CPU engine's greedy tokens (both on the same BF16-rounded
/// weights) on the selftest's prompts; a divergence passes only as a near-tie (CPU top-two logits
/// within 0.5). Needs the GGUF where `scripts/fetch-smollm2` puts it.
#[test]
#[ignore = "needs a GPU"]
fn gpu_smollm2_greedy_tokens_match_the_cpu() {
    let dev = std::sync::Arc::new(open());
    let path = entrollm_model::load::smollm2_gguf_path();
    assert!(
        path.is_file(),
        "run scripts/fetch-smollm2 first ({})",
        path.display()
    );
    let (mut cases, mut notes) = (Vec::new(), Vec::new());
    entrollm_check::engine_selftest::smollm2_greedy(&dev, &path, 32, &mut cases, &mut notes)
        .expect("GPU and CPU engines run");
    for n in &notes {
        println!("{n}");
    }
    assert!(cases.iter().all(|c| c.passed()), "{notes:#?}");
}
