//! Integer-code kernels on the GPU, ignored by default (CI has no GPU). On a GPU machine:
//! `cargo test -p entrollm-cuda --release --test int_gpu -- --ignored --nocapture`
//! (or `entrollm selftest --gpu --part int`).

use std::time::Instant;

use entrollm_check::int_selftest::selftest;

mod common;
use common::open;

#[test]
#[ignore = "needs a GPU"]
fn int_gpu_selftest() {
    let dev = open();
    let t0 = Instant::now();
    let r = selftest(&dev, 0x1417).expect("int selftest");
    for f in r.failures().take(20) {
        println!("  FAIL {f:?}");
    }
    let failed = r.failures().count();
    println!(
        "int kernels: {} cases, {} passed, {failed} failed ({:.1} s)",
        r.cases.len(),
        r.cases.len() - failed,
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(failed, 0);
}

/// Batch-1 product and dequantisation of integer codes, cold cache, on the Llama-3.1-8B matrices
/// (INT_SHAPES, default 4096x4096,14336x4096,4096x14336), beside our dense BF16 GEMV on the same
/// shape: every width symmetric in groups of 128 (GPTQ's), 4-bit also asymmetric and in groups of
/// 32, and 4-bit at each number of rows a warp tried.
#[test]
#[ignore = "needs a GPU"]
fn int_gpu_timing() {
    use entrollm_check::bench::GemvBench;
    use entrollm_check::bench_int::{time_int, Zeros, ROWS_TRIED};
    use entrollm_cuda::linear::gemv_config_for;
    use entrollm_cuda::ops::int::{BITS, ROWS};
    let dev = open();
    let shapes: Vec<(usize, usize)> = std::env::var("INT_SHAPES")
        .unwrap_or_else(|_| "4096x4096,14336x4096,4096x14336".into())
        .split(',')
        .map(|s| {
            let (a, b) = s.split_once('x').expect("ROWSxCOLS");
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let mut cases: Vec<(u8, Zeros, usize, u32)> = BITS
        .iter()
        .map(|&b| (b, Zeros::Symmetric, 128, ROWS))
        .collect();
    cases.push((4, Zeros::PerGroup, 128, ROWS));
    cases.push((4, Zeros::Symmetric, 32, ROWS));
    cases.extend(
        ROWS_TRIED
            .iter()
            .filter(|&&r| r != ROWS)
            .map(|&r| (4, Zeros::Symmetric, 128, r)),
    );
    println!("shape case | bits/weight | mv_us TB/s | vs BF16 | dequant_us | mv_relL2");
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
        for &(bits, zeros, group, r) in &cases {
            let label = format!("int{bits} {zeros:?} g{group} rows/warp {r}");
            match time_int(&dev, bits, zeros, group, rows, cols, r, 9 + si as u64) {
                Ok(t) => println!(
                    "{rows}x{cols} {label} | {:.3} | {:.2} {:.2} | {:.2}x | {:.2} | {:.1e}",
                    8.0 * t.bytes as f64 / (rows * cols) as f64,
                    t.mv_us,
                    t.mv_tb_s,
                    bf16.median_us / t.mv_us,
                    t.dequant_us,
                    t.mv_rel_l2
                ),
                Err(e) => println!("{rows}x{cols} {label} | FAIL {e}"),
            }
        }
    }
}
