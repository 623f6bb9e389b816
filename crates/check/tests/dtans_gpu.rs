//! dtANS-LLM GPU tests, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test dtans_gpu -- --ignored --nocapture --test-threads=1`
//! (or the prebuilt test binary with the same arguments).

use entrollm_check::bench::{GemvBench, LLAMA8B_GEMV_SHAPES};
use entrollm_check::bench_coded::{bench_codings, bench_configs, entry_timing_configs, CodedBench};
use entrollm_check::dtans_selftest::selftest;
use entrollm_cuda::ops::dtans::{DtansConfig, DtansKind};
use entrollm_cuda::ops::gemv::GemvConfig;

mod common;
use common::{env_list, open, shape_selected};

#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_selftest() {
    let dev = open();
    let seed = std::env::var("SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xD7A5);
    match selftest(&dev, seed) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("{e}"),
    }
}

/// Per-launch table on the five Llama-3.1-8B shapes: coded mvm (BF16 lossless, Pair and Single,
/// slice widths DTANS_SC, warps DTANS_WARPS) against our dense GEMV (best of its candidates) and
/// cuBLAS, cold cache. DTANS_SHAPES limits the shapes (comma-separated names).
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_cold_timing() {
    let dev = open();
    let scs = env_list("DTANS_SC", &entrollm_check::bench_coded::BENCH_SLICE_WIDTHS);
    let cfg_idx = env_list(
        "DTANS_CFGS",
        &(0..bench_configs().len() as u32).collect::<Vec<_>>(),
    );
    let log2ms = env_list("DTANS_LOG2M", &[8, 9]);
    let single = std::env::var("DTANS_SINGLE").is_ok();
    let dense_cfgs: Vec<GemvConfig> = match std::env::var("DTANS_DENSE_ALL") {
        Ok(_) => GemvConfig::CANDIDATES.to_vec(),
        Err(_) => GemvConfig::CANDIDATES[..4].to_vec(),
    };
    let mut summary = Vec::new();
    let mut failures = 0usize;
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        if !shape_selected(name) {
            continue;
        }
        let mut dense = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("dense setup");
        let cublas = dense.time_cublas().expect("cublas timing");
        let ours = dense_cfgs
            .iter()
            .map(|&c| dense.time_ours(c).expect("gemv timing"))
            .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
            .unwrap();
        drop(dense);
        println!(
            "{name:<8} {n:>6}x{k:<6} cublas {:8.2} us ({:.2} TB/s) | dense {} {:8.2} us ({:.2} TB/s)",
            cublas.median_us,
            cublas.weight_tb_per_s,
            ours.kernel,
            ours.median_us,
            ours.weight_tb_per_s
        );
        let mut best: Option<entrollm_check::bench_coded::CodedTiming> = None;
        for &sc in &scs {
            for coding in bench_codings(sc) {
                if !log2ms.contains(&(coding.log2_m as u32))
                    || (coding.mode == entrollm_codec::dtans::Mode::Single && !single)
                {
                    continue;
                }
                let mut b = match CodedBench::new(&dev, n, k, coding, 7 + i as u64) {
                    Ok(b) => b,
                    Err(e) => {
                        println!("  {coding:?}: setup failed: {e}");
                        continue;
                    }
                };
                let kind = entrollm_cuda::ops::dtans::DtansKind::of(
                    entrollm_codec::Payload::Bf16,
                    &coding,
                    k,
                    None,
                );
                for &ci in &cfg_idx {
                    let Some(&cfg) = bench_configs().get(ci as usize) else {
                        continue;
                    };
                    if !cfg.fits(&kind) {
                        continue;
                    }
                    let (rel, err) = b.check(cfg).expect("coded check");
                    let t = b.time(cfg).expect("coded timing");
                    println!(
                        "  {:<28} {:6.3} b/w {:8.2} us  dense-eq {:.2} TB/s  coded {:.2} TB/s  \
                         vs dense x{:.3}  vs cublas x{:.3}  rel_l2 {rel:.1e} err {err} (copies {})",
                        t.kernel,
                        t.bits_per_weight,
                        t.median_us,
                        t.dense_equiv_tb_per_s,
                        t.coded_tb_per_s,
                        ours.median_us / t.median_us,
                        cublas.median_us / t.median_us,
                        t.copies
                    );
                    if !(rel < 1e-5 && err == 0) {
                        println!("FAIL {} {name}: rel {rel} err {err}", t.kernel);
                        failures += 1;
                        continue;
                    }
                    if best.as_ref().is_none_or(|b| t.median_us < b.median_us) {
                        best = Some(t);
                    }
                }
            }
        }
        if let Some(b) = &best {
            // Materialising the layer for prefill, with the best mvm's coding.
            let coding = entrollm_codec::dtans::Coding {
                mode: entrollm_codec::dtans::Mode::Pair,
                log2_m: b.log2_m,
                sc: b.sc,
                t: Some(b.t),
            };
            if let Ok(mut cb) = CodedBench::new(&dev, n, k, coding, 7 + i as u64) {
                for cfg in [DtansConfig::warps(4), DtansConfig::warps(8)] {
                    match cb.time_dequant(cfg) {
                        Ok((us, exact)) => println!(
                            "  dequant {coding:?} {cfg}: {us:.2} us ({:.2} TB/s written+read), bit-exact {exact}",
                            (2 * n * k + cb.tensor.stored_bytes()) as f64 / (us * 1e-6) / 1e12
                        ),
                        Err(e) => println!("  dequant {cfg}: {e}"),
                    }
                }
            }
        }
        if let Some(b) = best {
            summary.push(format!(
                "| {name} | {n}×{k} | {:.2} | {:.2} | {} | {:.3} | {:.2} | {:.2} / {:.2} | x{:.3} | x{:.3} |",
                cublas.median_us,
                ours.median_us,
                b.kernel,
                b.bits_per_weight,
                b.median_us,
                b.dense_equiv_tb_per_s,
                b.coded_tb_per_s,
                ours.median_us / b.median_us,
                cublas.median_us / b.median_us
            ));
        }
    }
    println!("| launch | shape | cuBLAS µs | dense µs | best coded | b/w | coded µs | TB/s dense-eq / coded | vs dense | vs cuBLAS |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for s in summary {
        println!("{s}");
    }
    assert_eq!(failures, 0, "{failures} coded launches gave wrong results");
}

/// The launches (name, coding, engine configuration) `dtans_gpu_entry_timing` compares on the
/// Llama-3.1-8B shapes: the compact plan's Single coding and the tuned Pair coding.
fn entry_timing_launches() -> Vec<(usize, entrollm_codec::dtans::Coding, DtansConfig)> {
    use entrollm_cuda::engine_coded::COMPACT_PLAN_JSON;
    use entrollm_cuda::linear::dtans_config_for;
    use entrollm_cuda::ops::dtans::DtansOut;
    use entrollm_model::coding_plan::{CodingPlan, Launch};
    let plan = CodingPlan::from_json(COMPACT_PLAN_JSON, None).expect("the compact plan");
    let mut v = Vec::new();
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        let launch = Launch::from_name(name).expect("a plan launch name");
        let single = plan
            .launches
            .get(&launch)
            .copied()
            .flatten()
            .or(plan.default)
            .expect("the plan codes every launch");
        let (pair, pair_cfg) = entrollm_cuda::tuned::bf16_coding_for(n, k);
        let single_cfg = dtans_config_for(
            entrollm_codec::Payload::Bf16,
            &single,
            n,
            k,
            None,
            DtansOut::Mvm,
        )
        .expect("an mvm launch");
        v.push((i, single, single_cfg));
        v.push((i, pair, pair_cfg));
    }
    v
}

fn entry_timing_kind(coding: &entrollm_codec::dtans::Coding, k: usize) -> DtansKind {
    DtansKind::of(entrollm_codec::Payload::Bf16, coding, k, None)
}

/// Shared-table entry sizes on the five Llama-3.1-8B launches, cold cache, against our dense GEMV
/// (the engine's configuration) in the same run: the compact plan's Single coding and the tuned
/// Pair coding, each with `entry_timing_configs` of its engine launch (16-byte entries plain and
/// `fast`, 4/8-byte entries, the default entries at other warp counts). Every launch is checked
/// against the codec's matvec before it is timed. DTANS_SHAPES limits the shapes.
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_entry_timing() {
    let dev = open();
    let mut failures = 0usize;
    let mut summary = Vec::new();
    let mut dense_us = Vec::new();
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        if !shape_selected(name) {
            dense_us.push(f64::NAN);
            continue;
        }
        let mut dense = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("dense setup");
        let cfg = entrollm_cuda::linear::gemv_config_for(n, k);
        let t = dense.time_ours(cfg).expect("gemv timing");
        println!(
            "{name:<8} {n:>6}x{k:<6} dense {} {:8.2} us",
            t.kernel, t.median_us
        );
        dense_us.push(t.median_us);
    }
    for (i, coding, base) in entry_timing_launches() {
        let (name, n, k) = LLAMA8B_GEMV_SHAPES[i];
        if dense_us[i].is_nan() {
            continue;
        }
        let mut b = CodedBench::new(&dev, n, k, coding, 7 + i as u64).expect("coded setup");
        let kind = entry_timing_kind(&coding, k);
        let mut best: Option<(f64, DtansConfig)> = None;
        let mut line = format!(
            "| {name} | {coding} {:.3} b/w |",
            b.tensor.bits_per_weight()
        );
        for cfg in entry_timing_configs(&kind, base) {
            let (rel, err) = b.check(cfg).expect("coded check");
            if !(rel < 1e-5 && err == 0) {
                println!("FAIL {name} {coding} {cfg}: rel {rel:.2e} err {err}");
                line.push_str(&format!(" {cfg} FAIL |"));
                failures += 1;
                continue;
            }
            let t = b.time(cfg).expect("coded timing");
            println!(
                "  {name:<8} {coding} {cfg:<14} {:8.2} us  vs dense x{:.3}  rel {rel:.1e}",
                t.median_us,
                dense_us[i] / t.median_us
            );
            line.push_str(&format!(" {cfg} {:.2} |", t.median_us));
            if best.is_none_or(|(us, _)| t.median_us < us) {
                best = Some((t.median_us, cfg));
            }
        }
        if let Some((us, cfg)) = best {
            line.push_str(&format!(
                " best {cfg} {us:.2} (dense {:.2}, x{:.3}) |",
                dense_us[i],
                dense_us[i] / us
            ));
        }
        summary.push(line);
    }
    for s in summary {
        println!("{s}");
    }
    assert_eq!(failures, 0, "{failures} coded launches gave wrong results");
}

/// Cubins of everything `dtans_gpu_selftest`, `dtans_gpu_entry_timing` and the coded synthetic
/// models' serving (`entrollm bench --coded`) launch, for `ENTROLLM_CACHE`.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn dtans_precompile_entry_cubins() {
    use entrollm_cuda::ops::dtans::DtansOut;
    let mut variants = entrollm_check::variants::all_variants();
    variants.extend(entrollm_cuda::engine_coded::serve_variants());
    for (_, coding, base) in entry_timing_launches() {
        let kind = entry_timing_kind(&coding, 4096);
        for cfg in entry_timing_configs(&kind, base) {
            variants.push(kind.variant(cfg, DtansOut::Mvm));
        }
    }
    common::precompile(&variants);
}

/// Per-launch `dequant` (BF16 materialisation for prefill GEMMs) on the five Llama-3.1-8B shapes,
/// cold cache, with the engine's launch configuration: the compact plan's Single coding
/// (crates/cuda/data/single-m8.json) and the tuned Pair coding of each shape. TB/s counts the coded
/// bytes read and the BF16 bytes written; each result is checked bit-exact against the CPU
/// decoder. DTANS_SHAPES limits the shapes (comma-separated names).
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_dequant_timing() {
    use entrollm_cuda::engine_coded::COMPACT_PLAN_JSON;
    use entrollm_cuda::linear::dtans_config_for;
    use entrollm_cuda::ops::dtans::DtansOut;
    use entrollm_model::coding_plan::{CodingPlan, Launch};
    let dev = open();
    let plan = CodingPlan::from_json(COMPACT_PLAN_JSON, None).expect("the compact plan");
    let mut failures = 0usize;
    println!("| launch | shape | coding | launch cfg | b/w | µs | TB/s read+written | bit-exact |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        if !shape_selected(name) {
            continue;
        }
        let launch = Launch::from_name(name).expect("a plan launch name");
        let single = plan
            .launches
            .get(&launch)
            .copied()
            .flatten()
            .or(plan.default)
            .expect("the plan codes every launch");
        let pair = entrollm_cuda::tuned::bf16_coding_for(n, k).0;
        for coding in [single, pair] {
            let cfg = dtans_config_for(
                entrollm_codec::Payload::Bf16,
                &coding,
                n,
                k,
                None,
                DtansOut::Dequant,
            )
            .expect("a dequant launch");
            let mut cb = CodedBench::new(&dev, n, k, coding, 7 + i as u64).expect("coded setup");
            let (us, exact) = cb.time_dequant(cfg).expect("dequant timing");
            println!(
                "| {name} | {n}×{k} | {coding} | {cfg} | {:.3} | {us:.2} | {:.2} | {exact} |",
                cb.tensor.bits_per_weight(),
                (2 * n * k + cb.tensor.stored_bytes()) as f64 / (us * 1e-6) / 1e12
            );
            if !exact {
                failures += 1;
            }
        }
    }
    assert_eq!(
        failures, 0,
        "{failures} dequant launches were not bit-exact"
    );
}

/// Fills a cubin cache with every built-in kernel variant for `DTANS_PRECOMPILE_ARCH` (default
/// sm_90), with NVRTC alone, in parallel: `ENTROLLM_CACHE=DIR` then lets a GPU run skip the JIT.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn dtans_precompile_cubins() {
    let mut variants = entrollm_check::variants::all_variants();
    variants.extend(entrollm_check::bench_coded::sweep_variants());
    variants.extend(entrollm_cuda::engine_coded::serve_variants());
    common::precompile(&variants);
}

/// Cubins of every runtime variant (`variants::all_variants`) and of the coded synthetic models'
/// launches (`engine_coded::serve_variants`), for `ENTROLLM_CACHE`: a GPU run then skips the JIT.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn serve_precompile_cubins() {
    let mut variants = entrollm_check::variants::all_variants();
    variants.extend(entrollm_cuda::engine_coded::serve_variants());
    common::precompile(&variants);
}

/// GPU encoder against the CPU encoder, byte for byte, and the CPU decoder on its output
/// (`dtans_selftest::encode_selftest`); prints one line per coding group and any failure.
#[test]
#[ignore = "needs a GPU"]
fn dtans_encode_gpu_selftest() {
    let dev = open();
    let seed = std::env::var("SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xE2C0);
    let t = std::time::Instant::now();
    match entrollm_check::dtans_selftest::encode_selftest(&dev, seed) {
        Ok(r) => {
            let both = r
                .cases
                .iter()
                .filter(|c| c.shape.contains("rejected"))
                .count();
            println!(
                "dtans_encode selftest: {} cases byte-identical to the CPU encoder and decoded \
                 exactly ({both} of them codings both encoders reject), {:.1} s",
                r.cases.len(),
                t.elapsed().as_secs_f64()
            );
            for c in r.cases.iter().step_by(37) {
                println!("  ok {}", c.shape);
            }
        }
        Err(e) => {
            let s = e.to_string();
            let fails: Vec<&str> = s.lines().filter(|l| l.contains("FAIL")).collect();
            panic!(
                "{} failing cases, first:\n{}",
                fails.len(),
                fails[..fails.len().min(40)].join("\n")
            );
        }
    }
}

/// Encode time of one decoder layer of the synthetic `ENC_MODELS` (default llama-3.1-8b,
/// llama-3.3-70b) with the codings of `ENC_PLAN` (default crates/cuda/data/single-m8.json): host plan,
/// GPU encode and, unless `ENC_CPU=0`, the host encoder on the same plan, byte-compared.
#[test]
#[ignore = "needs a GPU"]
fn dtans_encode_gpu_timing() {
    use entrollm_cuda::engine_coded::time_layer_encode;
    use entrollm_model::coding_plan::CodingPlan;
    use entrollm_model::synth::SynthShape;
    let dev = open();
    let plan_file = std::env::var("ENC_PLAN").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../cuda/data/single-m8.json").into()
    });
    let plan = CodingPlan::from_file(std::path::Path::new(&plan_file), None).expect("plan file");
    let cpu = std::env::var("ENC_CPU").map_or(true, |v| v != "0");
    let models =
        std::env::var("ENC_MODELS").unwrap_or_else(|_| "llama-3.1-8b,llama-3.3-70b".into());
    let mut bad = 0;
    for name in models.split(',') {
        let c = SynthShape::parse(name)
            .expect("a synthetic shape name")
            .config();
        let rows = time_layer_encode(&dev, &c, 0, &plan, cpu).expect("layer encode");
        let (mut plan_s, mut up_s, mut gpu_s, mut dl_s, mut cpu_s) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for r in &rows {
            let g = r.gpu.lanes_s + r.gpu.streams_s;
            println!(
                "{name} {:<17} {:>6}x{:<6} {:<16} {:.3} b/w  plan {:.3} s  upload {:.3} s  gpu {:.3} s (lanes+measure {:.3}, write {:.3})  download {:.3} s  cpu {}  {}",
                r.name,
                r.rows,
                r.cols,
                r.coding.to_string(),
                r.bits_per_weight,
                r.plan_s,
                r.upload_s,
                g,
                r.gpu.lanes_s,
                r.gpu.streams_s,
                r.gpu.download_s,
                r.cpu_s.map_or("-".into(), |s| format!("{s:.3} s")),
                match r.identical {
                    Some(true) => "IDENTICAL",
                    Some(false) => "DIFFERS",
                    None => "",
                }
            );
            bad += (r.identical == Some(false)) as usize;
            plan_s += r.plan_s;
            up_s += r.upload_s;
            gpu_s += g;
            dl_s += r.gpu.download_s;
            cpu_s += r.cpu_s.unwrap_or(0.0);
        }
        let layers = c.num_layers as f64;
        println!(
            "{name} per layer: plan {plan_s:.3} s + upload {up_s:.3} s + gpu {gpu_s:.3} s + download {dl_s:.3} s = {:.3} s (gpu path) vs plan + cpu {:.3} s; whole model ({} layers, lm_head excluded): gpu path {:.1} s, cpu {:.1} s",
            plan_s + up_s + gpu_s + dl_s,
            plan_s + cpu_s,
            c.num_layers,
            layers * (plan_s + up_s + gpu_s + dl_s),
            layers * (plan_s + cpu_s)
        );
    }
    assert_eq!(bad, 0, "GPU-encoded tensors differ from the CPU encoder's");
}

/// One launch each of our dense GEMV and the tuned Pair and Single mvm launches
/// (`tuned::tuned_launches`) on the launch shapes named in DTANS_SHAPES (default: all), each
/// checked against its reference: the program to run under `ncu` (few launches, no timing loops).
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_profile_launches() {
    let dev = open();
    let mut failures = 0usize;
    let mut dense_done = std::collections::HashSet::new();
    let mut launches: Vec<_> = entrollm_cuda::tuned::tuned_launches().to_vec();
    // DTANS_PROFILE="shape,pair|single,sc,warps,min_warps,unroll,entry;…": these launches instead.
    if let Ok(spec) = std::env::var("DTANS_PROFILE") {
        launches = spec
            .split(';')
            .map(|l| {
                let f: Vec<&str> = l.split(',').map(str::trim).collect();
                let num = |i: usize| f[i].parse::<u32>().expect("a number");
                let &(name, n, k) = LLAMA8B_GEMV_SHAPES
                    .iter()
                    .find(|s| s.0 == f[0])
                    .expect("a Llama-8B shape name");
                let pair = f[1] == "pair";
                let coding = entrollm_codec::dtans::Coding {
                    mode: if pair {
                        entrollm_codec::dtans::Mode::Pair
                    } else {
                        entrollm_codec::dtans::Mode::Single
                    },
                    log2_m: 8,
                    sc: num(2),
                    t: pair.then_some(16),
                };
                let cfg = DtansConfig {
                    warps: num(3),
                    min_warps: num(4),
                    rep: 0,
                    unroll: num(5),
                    fast: num(6) == 16,
                    entry: num(6),
                };
                (name, n, k, coding, cfg, 0.0)
            })
            .collect();
    }
    for (i, (name, n, k, coding, cfg, _)) in launches.into_iter().enumerate() {
        if !shape_selected(name) {
            continue;
        }
        if dense_done.insert((n, k)) {
            let mut dense = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("dense setup");
            let rel = dense
                .check_ours(entrollm_cuda::linear::gemv_config_for(n, k))
                .expect("dense check");
            println!("{name:<8} dense rel {rel:.1e}");
        }
        let mut b = CodedBench::new(&dev, n, k, coding, 7 + i as u64).expect("coded setup");
        let (rel, err) = b.check(cfg).expect("coded check");
        println!(
            "{name:<8} {coding} {cfg} {:.3} b/w rel {rel:.1e} err {err}",
            b.tensor.bits_per_weight()
        );
        failures += usize::from(!(rel < 1e-5 && err == 0));
    }
    assert_eq!(failures, 0, "{failures} launches gave wrong results");
}

/// The codings and launch configurations `dtans_gpu_occupancy_sweep` compares: lossless BF16 Pair
/// (M 2^8, t 16) and Single (M 2^8) at slice widths 512–2048, with 8/16/32 warps per block,
/// registers capped for 0/32/40/48 resident warps per SM, unroll 4/8, 16-byte `fast` and 4-byte
/// entries.
fn occupancy_sweep_launches() -> Vec<(entrollm_codec::dtans::Coding, Vec<DtansConfig>)> {
    use entrollm_codec::dtans::{Coding, Mode};
    // DTANS_SWEEP=2: blocks of 7/14/28 warps (28 resident per SM: 73 registers), 16/8/4-byte
    // entries.
    let second = std::env::var("DTANS_SWEEP").is_ok_and(|v| v == "2");
    let (warp_set, min_set, entry_set): (&[u32], &[u32], &[u32]) = if second {
        (&[7, 14, 28], &[0, 28], &[16, 8, 4])
    } else {
        (&[8, 16, 32], &[0, 32, 40, 48], &[16, 4])
    };
    let codings = [(Mode::Pair, 8u8, Some(16u16)), (Mode::Single, 8, None)];
    let mut v = Vec::new();
    for sc in [512u32, 1024, 2048] {
        for &(mode, log2_m, t) in &codings {
            let coding = Coding {
                mode,
                log2_m,
                sc,
                t,
            };
            let kind = entry_timing_kind(&coding, 4096);
            let mut cfgs = Vec::new();
            for &warps in warp_set {
                for &min_warps in min_set {
                    for unroll in [4u32, 8] {
                        for &entry in entry_set {
                            let cfg = DtansConfig {
                                warps,
                                min_warps,
                                rep: 0,
                                unroll,
                                fast: entry == 16,
                                entry,
                            };
                            if cfg.fits(&kind) {
                                cfgs.push(cfg);
                            }
                        }
                    }
                }
            }
            v.push((coding, cfgs));
        }
    }
    v
}

/// Occupancy sweep of the mvm on the five Llama-3.1-8B launches (DTANS_SHAPES limits them,
/// DTANS_SC the slice widths): every configuration of `occupancy_sweep_launches` checked against the
/// codec's matvec and timed cold beside our dense GEMV; the best per launch and mode at the end.
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_occupancy_sweep() {
    let dev = open();
    let scs = env_list("DTANS_SC", &[512, 1024, 2048]);
    let mut failures = 0usize;
    let mut summary = Vec::new();
    for (i, &(name, n, k)) in LLAMA8B_GEMV_SHAPES.iter().enumerate() {
        if !shape_selected(name) {
            continue;
        }
        let mut dense = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("dense setup");
        let dense_us = dense
            .time_ours(entrollm_cuda::linear::gemv_config_for(n, k))
            .expect("gemv timing")
            .median_us;
        drop(dense);
        println!("{name:<8} {n:>6}x{k:<6} dense {dense_us:8.2} us");
        let mut best: std::collections::BTreeMap<String, (f64, String)> = Default::default();
        for (coding, cfgs) in occupancy_sweep_launches() {
            if !scs.contains(&coding.sc) {
                continue;
            }
            let mut b = CodedBench::new(&dev, n, k, coding, 7 + i as u64).expect("coded setup");
            let bw = b.tensor.bits_per_weight();
            for cfg in cfgs {
                let (rel, err) = b.check(cfg).expect("coded check");
                if !(rel < 1e-5 && err == 0) {
                    println!("FAIL {name} {coding} {cfg}: rel {rel:.2e} err {err}");
                    failures += 1;
                    continue;
                }
                let us = b.time(cfg).expect("coded timing").median_us;
                println!(
                    "  {name:<8} {coding} {cfg:<14} {bw:.3} b/w {us:8.2} us  vs dense x{:.3}",
                    dense_us / us
                );
                let key = format!("{name} {:?}", coding.mode);
                if best.get(&key).is_none_or(|&(b, _)| us < b) {
                    best.insert(key, (us, format!("{coding} {cfg} {bw:.3} b/w")));
                }
            }
        }
        for (key, (us, what)) in best {
            summary.push(format!(
                "| {key} | {what} | {us:.2} | dense {dense_us:.2} | x{:.3} |",
                dense_us / us
            ));
        }
    }
    for s in summary {
        println!("{s}");
    }
    assert_eq!(failures, 0, "{failures} coded launches gave wrong results");
}

/// The launch configurations `dtans_gpu_plan_sweep` compares: blocks of 8–32 warps (one block of
/// 28 or 32 warps fills an SM), 16-byte `fast` and 4-byte entries, unroll 8.
fn plan_sweep_configs() -> Vec<DtansConfig> {
    let mut v = Vec::new();
    for warps in [8u32, 14, 16, 28, 32] {
        for entry in [16u32, 4] {
            v.push(DtansConfig {
                warps,
                min_warps: 0,
                rep: 0,
                unroll: 8,
                fast: entry == 16,
                entry,
            });
        }
    }
    v
}

/// The compact plan's codings (crates/cuda/data/single-m8.json) on the Llama-3.1-8B launches, or with
/// DTANS_MODEL=70b on Llama-3.3-70B's, with each of `plan_sweep_configs`: checked against the
/// codec's matvec, timed cold beside our dense GEMV; the fastest per launch at the end (the sweep
/// behind the Single rows of `tuned::tuned_launches`).
#[test]
#[ignore = "needs a GPU"]
fn dtans_gpu_plan_sweep() {
    use entrollm_cuda::engine_coded::COMPACT_PLAN_JSON;
    use entrollm_model::coding_plan::{CodingPlan, Launch};
    let dev = open();
    let plan = CodingPlan::from_json(COMPACT_PLAN_JSON, None).expect("the compact plan");
    let shapes = match std::env::var("DTANS_MODEL").as_deref() {
        Ok("70b") => entrollm_check::bench::LLAMA70B_GEMV_SHAPES,
        _ => LLAMA8B_GEMV_SHAPES,
    };
    let mut failures = 0usize;
    let mut summary = Vec::new();
    for (i, &(name, n, k)) in shapes.iter().enumerate() {
        let mut dense = GemvBench::new(&dev, n, k, 1000 + i as u64).expect("dense setup");
        let dense_us = dense
            .time_ours(entrollm_cuda::linear::gemv_config_for(n, k))
            .expect("gemv timing")
            .median_us;
        drop(dense);
        let launch = Launch::from_name(name).expect("a plan launch name");
        let coding = plan
            .launches
            .get(&launch)
            .copied()
            .flatten()
            .or(plan.default)
            .expect("the plan codes every launch");
        let mut b = CodedBench::new(&dev, n, k, coding, 7 + i as u64).expect("coded setup");
        let bw = b.tensor.bits_per_weight();
        println!("{name:<8} {n:>6}x{k:<6} dense {dense_us:8.2} us, {coding} {bw:.3} b/w");
        let mut best: Option<(f64, DtansConfig)> = None;
        for cfg in plan_sweep_configs() {
            let (rel, err) = b.check(cfg).expect("coded check");
            if !(rel < 1e-5 && err == 0) {
                println!("FAIL {name} {coding} {cfg}: rel {rel:.2e} err {err}");
                failures += 1;
                continue;
            }
            let us = b.time(cfg).expect("coded timing").median_us;
            println!("  {cfg:<10} {us:8.2} us  vs dense x{:.3}", dense_us / us);
            if best.is_none_or(|(b, _)| us < b) {
                best = Some((us, cfg));
            }
        }
        if let Some((us, cfg)) = best {
            summary.push(format!(
                "| {name} | {n}×{k} | {coding} | {bw:.3} | {cfg} | {us:.2} | {dense_us:.2} | x{:.3} |",
                dense_us / us
            ));
        }
    }
    println!("| launch | shape | coding | b/w | best launch | µs | dense µs | vs dense |");
    println!("|---|---|---|---|---|---|---|---|");
    for s in summary {
        println!("{s}");
    }
    assert_eq!(failures, 0, "{failures} coded launches gave wrong results");
}

/// Cubins of everything `dtans_gpu_occupancy_sweep`, `dtans_gpu_plan_sweep` and
/// `dtans_gpu_profile_launches` launch, for `ENTROLLM_CACHE`.
#[test]
#[ignore = "needs libnvrtc; fills the kernel cache"]
fn dtans_precompile_sweep_cubins() {
    use entrollm_cuda::ops::dtans::DtansOut;
    let mut variants = entrollm_check::variants::all_variants();
    for (coding, cfgs) in occupancy_sweep_launches() {
        let kind = entry_timing_kind(&coding, 4096);
        for cfg in cfgs {
            variants.push(kind.variant(cfg, DtansOut::Mvm));
        }
    }
    for (_, _, k, coding, cfg, _) in entrollm_cuda::tuned::tuned_launches() {
        variants.push(entry_timing_kind(&coding, k).variant(cfg, DtansOut::Mvm));
    }
    for (_, coding, _) in entry_timing_launches() {
        for cfg in plan_sweep_configs() {
            variants.push(entry_timing_kind(&coding, 4096).variant(cfg, DtansOut::Mvm));
        }
    }
    common::precompile(&variants);
}
