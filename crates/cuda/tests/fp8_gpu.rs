//! Dense FP8 GEMV and coded-FP8 GPU tests, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test fp8_gpu -- --ignored --nocapture --test-threads=1`
//! (or the prebuilt test binary with the same arguments).

use std::time::Instant;

use entrollm_cuda::bench::{GemvBench, LLAMA8B_GEMV_SHAPES};
use entrollm_cuda::bench_fp8::{fp8_mvm_configs, fp8_mvm_variants, Fp8Bench, Fp8Matrix};
use entrollm_cuda::linear::gemv_config_for;
use entrollm_cuda::ops::gemv::GemvConfig;
use entrollm_cuda::selftest::run_fp8_selftest;

/// Code entropy of the synthetic FP8 checkpoint (the seed's EntQuant 2.1-bit one); FP8_BITS
/// overrides it.
fn bits() -> f64 {
    std::env::var("FP8_BITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.1)
}

/// The codings to compare: FP8_CODINGS, comma-separated `auto` (the coder's choice) or
/// MODE:LOG2M:SC[:T]; default `auto`.
fn codings() -> Vec<Option<entrollm_codec::dtans::Coding>> {
    std::env::var("FP8_CODINGS")
        .unwrap_or_else(|_| "auto".into())
        .split(',')
        .map(|c| entrollm_codec::dtans::Coding::parse(c.trim()).expect("a coding"))
        .collect()
}

mod common;
use common::open;

#[test]
#[ignore = "needs a GPU"]
fn fp8_gpu_selftest() {
    let dev = open();
    match run_fp8_selftest(&dev, 0xF8F8) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("{e}"),
    }
}

/// Per-launch table on the five Llama-3.1-8B shapes: dense FP8 GEMV (best of the GEMV candidates)
/// against the dtANS mvm on the same FP8 codes at FP8_BITS of entropy (codings FP8_CODINGS, default
/// the coder's choice; the best of them and of 4/8/16 warps), with our dense BF16 GEMV for
/// reference. Every launch is checked against the CPU reference before it is timed. Then the
/// per-token sums of the 32 decoder layers' launches.
#[test]
#[ignore = "needs a GPU"]
fn fp8_gpu_cold_timing() {
    let dev = open();
    let bits = bits();
    let mut rows = Vec::new();
    let mut failures = 0usize;
    let (mut layer_bf16, mut layer_fp8, mut layer_coded) = (0f64, 0f64, 0f64);
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let t0 = Instant::now();
        let bf16 = {
            let mut b = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("bf16 setup");
            b.time_ours(gemv_config_for(n, k)).expect("bf16 timing")
        };
        let mut dense_best: Option<entrollm_cuda::bench_fp8::Fp8Timing> = None;
        let mut coded_best: Option<entrollm_cuda::bench_fp8::Fp8Timing> = None;
        let mut setup_s = 0.0;
        let mut entropy = (0.0, 0.0);
        for coding in codings() {
            let mut b = Fp8Bench::new(&dev, n, k, bits, 77 + i as u64, coding).expect("fp8 setup");
            if dense_best.is_none() {
                setup_s = t0.elapsed().as_secs_f64();
                entropy = (b.m.entropy_bits(), b.m.multiplier);
                for cfg in GemvConfig::CANDIDATES {
                    let rel = b.check_dense(cfg).expect("dense fp8 check");
                    let passed = rel < 1e-5; // NaN fails
                    if !passed {
                        println!("FAIL gemv_fp8 {cfg} {name}: rel_l2 {rel:e}");
                        failures += 1;
                        continue;
                    }
                    let t = b.time_dense(cfg).expect("dense fp8 timing");
                    println!(
                        "  {name:<8} {:<24} {:8.2} us {:6.3} b/w {:6.2} Tw/s rel_l2 {rel:.1e}",
                        t.kernel, t.median_us, t.bits_per_weight, t.tweights_per_s
                    );
                    if dense_best
                        .as_ref()
                        .is_none_or(|d| t.median_us < d.median_us)
                    {
                        dense_best = Some(t);
                    }
                }
            }
            for cfg in fp8_mvm_configs(&b.tensor) {
                let (rel, cpu_rel, err) = b.check_coded(cfg).expect("coded fp8 check");
                if !(rel < 1e-5 && cpu_rel < 1e-5 && err == 0) {
                    println!(
                        "FAIL coded fp8 {cfg} {name}: rel_l2 {rel:e} (cpu decoder {cpu_rel:e}) err {err}"
                    );
                    failures += 1;
                    continue;
                }
                let t = b.time_coded(cfg).expect("coded fp8 timing");
                println!(
                    "  {name:<8} {:<44} {:8.2} us {:6.3} b/w {:6.2} Tw/s rel_l2 {rel:.1e} (copies {})",
                    t.kernel, t.median_us, t.bits_per_weight, t.tweights_per_s, t.copies
                );
                if coded_best
                    .as_ref()
                    .is_none_or(|d| t.median_us < d.median_us)
                {
                    coded_best = Some(t);
                }
            }
        }
        let (Some(d), Some(c)) = (dense_best, coded_best) else {
            println!("{name}: no passing launch");
            continue;
        };
        println!(
            "{name:<8} {n}x{k}: entropy {:.3} bits (multiplier {:.2}), setup {setup_s:.1} s; bf16 {:.2} us, fp8 {} {:.2} us, coded {} {:.2} us ({:.3} b/w): coded vs fp8 x{:.3}",
            entropy.0,
            entropy.1,
            bf16.median_us,
            d.kernel,
            d.median_us,
            c.kernel,
            c.median_us,
            c.bits_per_weight,
            d.median_us / c.median_us
        );
        if name != "lm_head" {
            layer_bf16 += 32.0 * bf16.median_us;
            layer_fp8 += 32.0 * d.median_us;
            layer_coded += 32.0 * c.median_us;
        }
        rows.push(format!(
            "| {name} | {n}×{k} | {:.2} | {:.2} ({}) | {:.3} | {:.2} ({}) | x{:.3} |",
            bf16.median_us,
            d.median_us,
            d.kernel,
            c.bits_per_weight,
            c.median_us,
            c.kernel,
            d.median_us / c.median_us
        ));
    }
    println!("| launch | shape | dense BF16 µs | dense FP8 µs | coded b/w | coded FP8 µs | coded vs FP8 |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    println!(
        "32 decoder layers' matrices per token: dense BF16 {:.1} us, dense FP8 {:.1} us, coded FP8 {:.1} us: coded vs dense FP8 x{:.3}",
        layer_bf16,
        layer_fp8,
        layer_coded,
        layer_fp8 / layer_coded
    );
    assert_eq!(failures, 0, "{failures} launches gave wrong results");
}

/// The CPU side of the timing (synthesis, entropy fit, coding choice, encoding) on the five
/// shapes, with its cost and the chosen codings; no GPU needed.
#[test]
#[ignore = "slow: codes the five Llama-8B FP8 shapes"]
fn fp8_codings_of_the_llama8b_shapes() {
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let t = Instant::now();
        let m = Fp8Matrix::synth(n, k, bits(), 77 + i as u64).unwrap();
        let ts = t.elapsed().as_secs_f64();
        for coding in codings() {
            let tc = Instant::now();
            let c = m.coded(coding).unwrap();
            println!(
                "{name:<8} {n}x{k}: entropy {:.3}, multiplier {:.2}, {} {:.3} b/w, configs {:?}; synth {ts:.1} s, code {:.1} s",
                m.entropy_bits(),
                m.multiplier,
                c.coding,
                c.bits_per_weight(),
                fp8_mvm_configs(&c).iter().map(|c| c.to_string()).collect::<Vec<_>>(),
                tc.elapsed().as_secs_f64()
            );
        }
    }
}

/// Cubins of the variants this binary launches (every GEMV variant of `jit::all_variants`, the
/// timing's coded FP8 launches), for `ENTROLLM_CACHE` (`DTANS_PRECOMPILE_ARCH`, default sm_90): a
/// GPU run then skips the JIT.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn fp8_precompile_cubins() {
    let mut variants: Vec<_> = entrollm_cuda::jit::all_variants()
        .into_iter()
        .filter(|v| v.source.name == entrollm_cuda::jit::GEMV.name)
        .collect();
    for (i, &(_, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let m = Fp8Matrix::synth(n, k, bits(), 77 + i as u64).unwrap();
        for v in codings()
            .into_iter()
            .flat_map(|c| fp8_mvm_variants(&m.coded(c).unwrap()))
        {
            if !variants.contains(&v) {
                variants.push(v);
            }
        }
    }
    common::precompile(&variants);
}
