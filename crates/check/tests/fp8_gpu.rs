//! Dense FP8 GEMV and coded-FP8 GPU tests, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test fp8_gpu -- --ignored --nocapture --test-threads=1`
//! (or the prebuilt test binary with the same arguments).

use std::time::Instant;

use entrollm_check::bench::{GemvBench, LLAMA8B_GEMV_SHAPES};
use entrollm_check::bench_fp8::{fp8_mvm_configs, fp8_mvm_variants, Fp8Bench, Fp8Matrix};
use entrollm_check::selftest::run_fp8_selftest;
use entrollm_check::selftest::GemvForm;
use entrollm_cuda::linear::gemv_config_for;

/// Code entropy of the synthetic FP8 checkpoint (the seed's EntQuant 2.1-bit one); FP8_BITS
/// overrides it.
fn bits() -> f64 {
    std::env::var("FP8_BITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.1)
}

/// The codings to compare: FP8_CODINGS, comma-separated `auto` (the coder's choice) or
/// MODE:LOG2M:SC[:T]; default `auto`; `none`: no dtANS launch (None; the matrix is still coded
/// with the coder's choice for the set-up).
fn codings() -> Vec<Option<Option<entrollm_codec::dtans::Coding>>> {
    std::env::var("FP8_CODINGS")
        .unwrap_or_else(|_| "auto".into())
        .split(',')
        .map(|c| match c.trim() {
            "none" => None,
            c => Some(entrollm_codec::dtans::Coding::parse(c).expect("a coding")),
        })
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

/// Per-launch table on the five Llama-3.1-8B shapes: the FP8 GEMV on the codes as stored and
/// palette-packed (each the best of the GEMV candidates) against the dtANS mvm on the same FP8
/// codes at FP8_BITS of entropy (codings FP8_CODINGS, default the coder's choice, `none` to skip;
/// the best of them and of 4/8/16 warps), with our dense BF16 GEMV for reference. Every launch is
/// checked against the CPU reference before it is timed. Then the per-token sums of the 32
/// decoder layers' launches.
#[test]
#[ignore = "needs a GPU"]
fn fp8_gpu_cold_timing() {
    use entrollm_check::bench_fp8::Fp8Timing;
    let dev = open();
    let bits = bits();
    let mut rows = Vec::new();
    let mut failures = 0usize;
    // Per-token sums over the 32 layers: BF16, FP8, palette, dtANS.
    let mut layer = [0f64; 4];
    let best = |b: &mut Option<Fp8Timing>, t: Fp8Timing| {
        if b.as_ref().is_none_or(|d| t.median_us < d.median_us) {
            *b = Some(t);
        }
    };
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let t0 = Instant::now();
        let bf16 = {
            let mut b = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("bf16 setup");
            b.time_ours(gemv_config_for(n, k)).expect("bf16 timing")
        };
        let mut gemv_best: [Option<Fp8Timing>; 2] = [None, None];
        let mut coded_best: Option<Fp8Timing> = None;
        let mut setup_s = 0.0;
        let mut entropy = (0.0, 0.0, 0.0, 0.0);
        for (ci, coding) in codings().into_iter().enumerate() {
            let mut b = Fp8Bench::new(&dev, n, k, bits, 77 + i as u64, coding).expect("fp8 setup");
            if ci == 0 {
                setup_s = t0.elapsed().as_secs_f64();
                entropy = (
                    b.m.entropy_bits(),
                    b.m.multiplier,
                    b.packed.bits_per_weight(),
                    b.packed.escape_fraction(),
                );
                for form in GemvForm::ALL {
                    for &cfg in form.configs() {
                        let rel = b.check_gemv(cfg, form).expect("fp8 gemv check");
                        if rel.is_nan() || rel >= form.tolerance() {
                            println!("FAIL fp8 gemv {cfg} {form:?} {name}: rel_l2 {rel:e}");
                            failures += 1;
                            continue;
                        }
                        let t = b.time_gemv(cfg, form).expect("fp8 gemv timing");
                        println!(
                            "  {name:<8} {:<32} {:8.2} us {:6.3} b/w {:6.2} Tw/s rel_l2 {rel:.1e}",
                            t.kernel, t.median_us, t.bits_per_weight, t.tweights_per_s
                        );
                        best(&mut gemv_best[usize::from(form != GemvForm::Dense)], t);
                    }
                }
            }
            let Some(tensor) = &b.tensor else { continue };
            for cfg in fp8_mvm_configs(tensor) {
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
                best(&mut coded_best, t);
            }
        }
        let [Some(d), Some(p)] = gemv_best else {
            println!("{name}: no passing FP8 GEMV");
            continue;
        };
        let coded = coded_best.as_ref().map_or_else(
            || "not run".to_string(),
            |c| {
                format!(
                    "{:.2} ({}, {:.3} b/w)",
                    c.median_us, c.kernel, c.bits_per_weight
                )
            },
        );
        println!(
            "{name:<8} {n}x{k}: entropy {:.3} bits (multiplier {:.2}), setup {setup_s:.1} s; bf16 {:.2} us, fp8 {} {:.2} us, palette {} {:.2} us ({:.3} b/w, {:.2e} escapes): palette vs fp8 x{:.3}; coded {coded}",
            entropy.0, entropy.1, bf16.median_us, d.kernel, d.median_us, p.kernel, p.median_us,
            entropy.2, entropy.3, d.median_us / p.median_us
        );
        if name == "lm_head" {
            // An FP8 checkpoint's LM head is BF16: dense, and palette-packed losslessly (what
            // `--fp8 palette` serves it as).
            let mut b = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("bf16 setup");
            let (t, rel) = b.time_pal_bf16().expect("bf16 palette timing");
            if rel.is_nan() || rel >= 5e-5 {
                println!("FAIL {} {name}: rel_l2 {rel:e}", t.kernel);
                failures += 1;
            }
            println!(
                "{name:<8} BF16 lm_head: dense {:.2} us, {} {:.2} us (x{:.3}, rel_l2 {rel:.1e}, {} copies)",
                bf16.median_us,
                t.kernel,
                t.median_us,
                bf16.median_us / t.median_us,
                t.copies
            );
        }
        if name != "lm_head" {
            layer[0] += 32.0 * bf16.median_us;
            layer[1] += 32.0 * d.median_us;
            layer[2] += 32.0 * p.median_us;
            layer[3] += 32.0 * coded_best.as_ref().map_or(f64::NAN, |c| c.median_us);
        }
        rows.push(format!(
            "| {name} | {n}×{k} | {:.2} | {:.2} ({}) | {:.2} ({}, {:.3} b/w) | x{:.3} | {coded} |",
            bf16.median_us,
            d.median_us,
            d.kernel,
            p.median_us,
            p.kernel,
            p.bits_per_weight,
            d.median_us / p.median_us
        ));
    }
    println!("| launch | shape | dense BF16 µs | dense FP8 µs | palette FP8 µs | palette vs FP8 | dtANS FP8 µs |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    println!(
        "32 decoder layers' matrices per token: dense BF16 {:.1} us, dense FP8 {:.1} us, palette FP8 {:.1} us (x{:.3} of dense FP8), dtANS FP8 {:.1} us (x{:.3})",
        layer[0],
        layer[1],
        layer[2],
        layer[1] / layer[2],
        layer[3],
        layer[1] / layer[3]
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
        for coding in codings().into_iter().flatten() {
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

/// Cubins of the variants this binary launches (every GEMV variant of `variants::all_variants`, the
/// timing's coded FP8 launches), for `ENTROLLM_CACHE` (`DTANS_PRECOMPILE_ARCH`, default sm_90): a
/// GPU run then skips the JIT.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn fp8_precompile_cubins() {
    let mut variants: Vec<_> = entrollm_check::variants::all_variants()
        .into_iter()
        .filter(|v| v.source.name == entrollm_cuda::jit::GEMV.name)
        .collect();
    for (i, &(_, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let m = Fp8Matrix::synth(n, k, bits(), 77 + i as u64).unwrap();
        for v in codings()
            .into_iter()
            .flatten()
            .flat_map(|c| fp8_mvm_variants(&m.coded(c).unwrap()))
        {
            if !variants.contains(&v) {
                variants.push(v);
            }
        }
    }
    common::precompile(&variants);
}

/// One launch of each FP8 GEMV form (on the codes as stored and palette-packed)
/// with GEMV configuration FP8_PROFILE_CFG (`w4r4u2` form, where the form has it; default the
/// engine's choice) on the
/// Llama-8B shapes named in DTANS_SHAPES (default: all), each checked against the reference: the
/// program to run under `ncu`.
#[test]
#[ignore = "needs a GPU"]
fn fp8_gpu_profile_launches() {
    let dev = open();
    let cfg_env = std::env::var("FP8_PROFILE_CFG").ok();
    let mut failures = 0;
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        if !common::shape_selected(name) {
            continue;
        }
        let mut b = Fp8Bench::new(&dev, n, k, bits(), 77 + i as u64, None).expect("fp8 setup");
        for form in GemvForm::ALL {
            let cfg = cfg_env.as_deref().map_or_else(
                || form.engine_config(n, k, dev.info().sm_count, false),
                |s| {
                    form.configs()
                        .iter()
                        .copied()
                        .find(|c| c.to_string() == s)
                        .unwrap_or_else(|| form.engine_config(n, k, dev.info().sm_count, false))
                },
            );
            let rel = b.check_gemv(cfg, form).expect("fp8 gemv check");
            println!("{name} {form:?} {cfg}: rel_l2 {rel:.1e}");
            if rel.is_nan() || rel >= form.tolerance() {
                failures += 1;
            }
        }
    }
    assert_eq!(failures, 0);
}
