//! GGUF-block kernels on the GPU, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test ggml_gpu -- --ignored --nocapture`
//! (or `entrollm selftest --gpu --part ggml`).

use std::time::Instant;

use entrollm_check::ggml_selftest::selftest;

mod common;
use common::open;

#[test]
#[ignore = "needs a GPU"]
fn ggml_gpu_selftest() {
    let dev = open();
    let t0 = Instant::now();
    let r = selftest(&dev, 0x6611).expect("ggml selftest");
    for f in r.failures().take(20) {
        println!("  FAIL {f:?}");
    }
    let failed = r.failures().count();
    println!(
        "ggml kernels: {} cases, {} passed, {failed} failed ({:.1} s)",
        r.cases.len(),
        r.cases.len() - failed,
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(failed, 0);
}

/// Batch-1 product and dequantisation of every ggml type the kernels run, cold cache, on the
/// Llama-3.1-8B matrices (GGML_SHAPES, default 4096x4096,14336x4096,4096x14336; GGML_TYPES,
/// default all), beside our dense BF16 GEMV on the same shape.
#[test]
#[ignore = "needs a GPU"]
fn ggml_gpu_timing() {
    use entrollm_check::bench::GemvBench;
    use entrollm_check::bench_ggml::time_ggml;
    use entrollm_cuda::linear::gemv_config_for;
    use entrollm_cuda::ops::ggml::types;
    let dev = open();
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.into());
    let shapes: Vec<(usize, usize)> = env("GGML_SHAPES", "4096x4096,14336x4096,4096x14336")
        .split(',')
        .map(|s| {
            let (a, b) = s.split_once('x').expect("ROWSxCOLS");
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let wanted = env("GGML_TYPES", "all");
    println!("shape type | bits/weight | mv_us TB/s | vs BF16 | dequant_us | mv_relL2");
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        let mut dense = GemvBench::new(&dev, rows, cols, 77 + si as u64).expect("dense setup");
        let bf16 = dense
            .time_ours(gemv_config_for(rows, cols))
            .expect("dense timing");
        println!(
            "{rows}x{cols} BF16 | 16 | {:.2} {:.2} | 1.00x | - | -",
            bf16.median_us, bf16.weight_tb_per_s
        );
        drop(dense);
        for &ty in types() {
            if wanted != "all" && !wanted.split(',').any(|w| w.eq_ignore_ascii_case(ty.name())) {
                continue;
            }
            match time_ggml(&dev, ty, rows, cols, 9 + si as u64) {
                Ok(t) => {
                    println!(
                        "{rows}x{cols} {ty} | {:.3} | {:.2} {:.2} | {:.2}x | {:.2} | {:.1e}",
                        8.0 * t.bytes as f64 / (rows * cols) as f64,
                        t.mv_us,
                        t.mv_tb_s,
                        bf16.median_us / t.mv_us,
                        t.dequant_us,
                        t.mv_rel_l2
                    );
                    if let Some((both, alone)) = t.q8_us {
                        println!(
                            "{rows}x{cols} {ty}-q8 | {:.3} | {both:.2} {:.2} | {:.2}x | mv alone {alone:.2} | -",
                            8.0 * t.bytes as f64 / (rows * cols) as f64,
                            t.bytes as f64 / (both * 1e-6) / 1e12,
                            bf16.median_us / both,
                        );
                    }
                }
                Err(e) => println!("{rows}x{cols} {ty} | FAIL {e}"),
            }
        }
    }
}
