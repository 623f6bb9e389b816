//! Lossy-coded matrices on the GPU, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test lossy_gpu -- --ignored --nocapture --test-threads=1`
//! (or the prebuilt test binary with the same arguments). `lossy_precompile` (NVRTC alone, no
//! GPU) fills the kernel cache a device run carries.

use std::time::Instant;

use entrollm_check::bench::GemvBench;
use entrollm_check::bench_lossy::time_lossy;
use entrollm_check::lossy_selftest::selftest;
use entrollm_codec::lossy::{LossyTensor, Options, Quantizer};
use entrollm_cuda::linear::gemv_config_for;
use rayon::prelude::*;

mod common;
use common::open;

#[test]
#[ignore = "needs a GPU"]
fn lossy_gpu_selftest() {
    let dev = open();
    let t0 = Instant::now();
    let r = selftest(&dev, 0x1055).expect("lossy selftest");
    for f in r.failures().take(20) {
        println!("  FAIL {f:?}");
    }
    let failed = r.failures().count();
    println!(
        "lossy kernels: {} cases, {} passed, {failed} failed ({:.1} s)",
        r.cases.len(),
        r.cases.len() - failed,
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(failed, 0);
}

/// Cubins of every runtime variant (the lossy kernels among them) and of the served models'
/// launches, for `ENTROLLM_CACHE` (`DTANS_PRECOMPILE_ARCH`, default sm_90): a GPU run then skips
/// the JIT.
#[test]
#[ignore = "needs libnvrtc; fills ENTROLLM_CACHE"]
fn lossy_precompile() {
    let mut variants = entrollm_check::variants::all_variants();
    variants.extend(entrollm_cuda::engine_coded::serve_variants());
    variants.extend(entrollm_check::bench_int::bench_variants());
    common::precompile(&variants);
}

/// N(0, 0.02²) weights, generated in parallel.
fn gauss(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    w.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let mut g =
            entrollm_check::selftest::Rng::new(entrollm_codec::rng::splitmix64(seed ^ r as u64));
        for v in row {
            *v = g.normal() * 0.02;
        }
    });
    w
}

/// Decode (BF16 written) and batch-1 product, cold cache, on the Llama-3.1-8B matrices
/// (LOSSY_SHAPES, default 4096x4096,14336x4096,4096x14336) at LOSSY_BITS (default 2,3,4,6) with
/// LOSSY_QUANTIZERS (default e8,tcq32) and tiles of LOSSY_TILES weights (default 32768,8192),
/// beside our dense BF16 GEMV and cuBLAS on the same shape.
#[test]
#[ignore = "needs a GPU"]
fn lossy_gpu_timing() {
    let dev = open();
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.into());
    let shapes: Vec<(usize, usize)> = env("LOSSY_SHAPES", "4096x4096,14336x4096,4096x14336")
        .split(',')
        .map(|s| {
            let (a, b) = s.split_once('x').expect("ROWSxCOLS");
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let bits: Vec<f64> = env("LOSSY_BITS", "2,3,4,6")
        .split(',')
        .map(|b| b.parse().unwrap())
        .collect();
    let quantizers: Vec<Quantizer> = env("LOSSY_QUANTIZERS", "e8,tcq32")
        .split(',')
        .map(|q| q.parse().unwrap())
        .collect();
    let tiles: Vec<usize> = env("LOSSY_TILES", "32768,8192")
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    println!(
        "shape quantizer target tile | bpp relL2 | encode_s | decode_us decode_GB/s | mv_us | mv_relL2"
    );
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        let mut dense = GemvBench::new(&dev, rows, cols, 77 + si as u64).expect("dense setup");
        let ours = dense
            .time_ours(gemv_config_for(rows, cols))
            .expect("dense timing");
        let cublas = dense.time_cublas().expect("cublas timing");
        println!(
            "{rows}x{cols} dense BF16 GEMV {:.2} us ({:.2} TB/s), cuBLAS {:.2} us",
            ours.median_us, ours.weight_tb_per_s, cublas.median_us
        );
        drop(dense);
        let w = gauss(rows, cols, 5 + si as u64);
        for (&q, &b, &tw) in quantizers
            .iter()
            .flat_map(|q| bits.iter().map(move |b| (q, b)))
            .flat_map(|(q, b)| tiles.iter().map(move |t| (q, b, t)))
        {
            {
                let t0 = Instant::now();
                let opts = Options {
                    tile_weights: tw,
                    ..Options::new(b, q)
                };
                let (t, _) = LossyTensor::encode(&w, rows, cols, &opts).expect("encode");
                let enc = t0.elapsed().as_secs_f64();
                let r = t.decode().expect("decode");
                let (e, s) = w
                    .par_iter()
                    .zip(&r)
                    .map(|(&a, &b)| (((a - b) as f64).powi(2), (a as f64).powi(2)))
                    .reduce(|| (0.0, 0.0), |p, q| (p.0 + q.0, p.1 + q.1));
                match time_lossy(&dev, &t, 9) {
                    Ok(m) => println!(
                        "{rows}x{cols} {q} {b} {tw} | {:.4} {:.3}% | {enc:.2} | {:.2} {:.1} | {:.2} | {:.1e}",
                        t.bits_per_weight(),
                        100.0 * (e / s).sqrt(),
                        m.decode_us,
                        m.decode_gb_s,
                        m.mv_us,
                        m.mv_rel_l2
                    ),
                    Err(err) => println!("{rows}x{cols} {q} {b} {tw} | FAIL {err}"),
                }
            }
        }
    }
}

/// Greedy tokens of a lossy container (LOSSY_MODEL) served coded on the GPU against the CPU
/// engine on the same container (decoded at load: the same served values), from a random
/// 16-token prompt, LOSSY_TOKENS (default 8) new tokens.
#[test]
#[ignore = "needs a GPU and LOSSY_MODEL"]
fn lossy_e2e_greedy() {
    use entrollm_cuda::engine::{GpuEngine, GpuModel};
    use entrollm_cuda::linear::Serving;
    use entrollm_model::load::{open_weights_with, LoadOptions};
    use std::sync::Arc;
    let path = std::path::PathBuf::from(std::env::var("LOSSY_MODEL").expect("LOSSY_MODEL"));
    let n_new: usize = std::env::var("LOSSY_TOKENS").map_or(8, |s| s.parse().unwrap());
    let dev = Arc::new(open());
    let t0 = Instant::now();
    let w = open_weights_with(&path, LoadOptions::default()).expect("open (coded)");
    let vocab = w.config.vocab_size as u64;
    let mut r = entrollm_check::selftest::Rng::new(3);
    let ids: Vec<u32> = (0..16).map(|_| r.below(vocab) as u32).collect();
    let (gm, served) = GpuModel::upload_served(&dev, &w, Serving::AS_HELD).expect("upload");
    drop(w);
    let mut ge = GpuEngine::new(Arc::clone(&dev), gm, 256).expect("gpu engine");
    let gpu = ge.generate_greedy(&ids, n_new).expect("gpu greedy");
    println!(
        "gpu: launches served as stored: {}, {:.1} s: {gpu:?}",
        served.summary(),
        t0.elapsed().as_secs_f64()
    );
    drop(ge);
    let t1 = Instant::now();
    let opts = LoadOptions {
        fused: false,
        ..LoadOptions::default()
    };
    let w = open_weights_with(&path, opts).expect("open (decoded)");
    let mut ce = entrollm_model::Engine::new(w, 256).expect("cpu engine");
    let mut logits = ce.prefill(&ids).expect("cpu prefill");
    let mut cpu = Vec::new();
    let mut gaps = Vec::new();
    for i in 0..n_new {
        let t = entrollm_model::sampler::argmax(&logits).unwrap_or(0);
        cpu.push(t);
        if let Some(&g) = gpu.get(i) {
            gaps.push(logits[t as usize] - logits[g as usize]);
        }
        logits = ce.step(t).expect("cpu step");
    }
    println!("cpu: {:.1} s: {cpu:?}", t1.elapsed().as_secs_f64());
    let first = cpu.iter().zip(&gpu).position(|(a, b)| a != b);
    match first {
        None => println!("greedy tokens identical ({n_new})"),
        Some(j) => println!(
            "diverge at token {j}: cpu {} gpu {} (cpu logit gap {:.3})",
            cpu[j], gpu[j], gaps[j]
        ),
    }
    assert!(
        first.is_none_or(|j| gaps[j].abs() < 0.5),
        "GPU and CPU disagree beyond a near-tie"
    );
}
