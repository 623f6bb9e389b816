//! Code at load on the GPU (`GpuModel::upload_coded`), ignored by default (CI has no GPU). On a GPU
//! machine: `cargo test -p entrollm-cuda --release --test code_at_load_gpu -- --ignored --nocapture`.

use entrollm_check::engine_selftest::coded_e2e_selftest;
use entrollm_cuda::engine_coded::{dense_weights, e2e_config, load_variants};
use entrollm_cuda::GpuDevice;
use entrollm_model::coding_plan::CodingPlan;
use std::sync::Arc;

mod common;

fn seed() -> u64 {
    std::env::var("SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED)
}

/// The coded end-to-end selftest (synthetic coded models, a container's layout, and code at load:
/// GPU-coded against host-coded arrays and logits, and against the dense model).
#[test]
#[ignore = "needs a GPU"]
fn code_at_load_selftest() {
    let dev = Arc::new(GpuDevice::open(0).expect("a CUDA device"));
    let t = std::time::Instant::now();
    match coded_e2e_selftest(&dev, seed()) {
        Ok(r) => println!(
            "{r}\ncoded e2e selftest passed in {:.1} s",
            t.elapsed().as_secs_f64()
        ),
        Err(e) => panic!("{e}"),
    }
}

/// Cubins for the selftest above and for `entrollm run --code-at-load auto|tuned` on `entrollm
/// synth --shape tiny --seed 0`: every runtime variant, the coded synthetic models' launches and
/// the coder's choices at load, for `DTANS_PRECOMPILE_ARCH` (default sm_90) into `ENTROLLM_CACHE`.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn code_at_load_precompile_cubins() {
    use entrollm_model::synth::SynthShape;
    let mut variants = entrollm_check::variants::all_variants();
    variants.extend(entrollm_cuda::engine_coded::serve_variants());
    for (c, seed) in [(e2e_config(), seed()), (SynthShape::Tiny.config(), 0)] {
        let w = dense_weights(&c, seed).unwrap();
        let tuned = entrollm_cuda::engine_coded::tuned_plan(&c);
        for plan in [CodingPlan::uniform(None), tuned] {
            for v in load_variants(&w, &plan).unwrap() {
                if !variants.contains(&v) {
                    variants.push(v);
                }
            }
        }
    }
    common::precompile(&variants);
}
