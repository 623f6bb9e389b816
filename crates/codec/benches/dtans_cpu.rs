//! The CPU products of `compress --quantizer int|fp8` matrices, per weight: kept coded (the fast
//! dtANS product, AVX-512 and portable, and the reference decode-matvec) beside the same codes
//! decoded to f32 (a dense f32 dot) and to one byte a code (an int8 unpack-and-dot, what the
//! `int` form does), on Gaussian matrices of SmolLM2's and an 8B's shapes at a rate:
//!   cargo bench -p entrollm-codec --bench dtans_cpu -- [BITS] [REPS]
use entrollm_codec::dtans::CpuProduct;
use entrollm_codec::lossy::scalar::{encode, Scalar};
use entrollm_codec::matvec::Dequant;
use rayon::prelude::*;
use std::time::Instant;

fn gauss(n: usize, seed: u64) -> Vec<f32> {
    let mut r = entrollm_codec::rng::SplitMix64::new(seed);
    (0..n).map(|_| (r.normal() * 0.02) as f32).collect()
}

/// Median ns a call of `f` over `reps` calls (after one warm-up).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[reps / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let bits: f64 = args.get(1).map_or(4.0, |b| b.parse().expect("BITS"));
    let reps: usize = args.get(2).map_or(21, |r| r.parse().expect("REPS"));
    println!(
        "threads {}, AVX-512 {}, {bits} bits; ns a weight (median of {reps})",
        rayon::current_num_threads(),
        entrollm_codec::dtans::avx512()
    );
    println!(
        "shape quantiser coding | fast-avx512 fast-portable reference | f32-dense int8-unpack"
    );
    for (rows, cols) in [(1536, 576), (576, 1536), (4096, 4096)] {
        let w = gauss(rows * cols, (rows * 7 + cols) as u64);
        let x = gauss(cols, 99);
        for q in [
            Scalar::Int {
                group: 128,
                dead_zone: 0.0,
            },
            Scalar::Fp8,
        ] {
            let (t, _) = encode(&w, rows, cols, q, bits, None).expect("encode");
            let c = t.to_codes().expect("codes");
            let scales = c.scales_f32();
            let dq = match q {
                Scalar::Int { .. } => Dequant::Groups {
                    group: c.group,
                    scales: &scales,
                    mins: None,
                    offset: 0.0,
                    signed: true,
                },
                Scalar::Fp8 => Dequant::None,
            };
            let fast = CpuProduct::new(&t.codes).expect("table").expect("no raw");
            let mut y = vec![0f32; rows];
            let n = (rows * cols) as f64;
            let f_simd = time(reps, || {
                fast.matvec(&t.codes, &x, &mut y, &dq, true).unwrap()
            }) / n;
            let f_port = time(reps, || {
                fast.matvec(&t.codes, &x, &mut y, &dq, false).unwrap()
            }) / n;
            let reference = time(3, || t.codes.matvec(&x, &mut y, &dq).unwrap()) / n;
            let dense = c.decode();
            let f32_dense = time(reps, || {
                y.par_chunks_mut(16).enumerate().for_each(|(i, ys)| {
                    for (j, y) in ys.iter_mut().enumerate() {
                        let r = &dense[(i * 16 + j) * cols..][..cols];
                        *y = r.iter().zip(&x).map(|(a, b)| a * b).sum();
                    }
                })
            }) / n;
            let codes: Vec<i8> = c.codes.iter().map(|&b| b as i8).collect();
            let int8 = time(reps, || {
                y.par_chunks_mut(16).enumerate().for_each(|(i, ys)| {
                    let mut q = vec![0f32; cols];
                    for (j, y) in ys.iter_mut().enumerate() {
                        let r = i * 16 + j;
                        for (q, &v) in q.iter_mut().zip(&codes[r * cols..][..cols]) {
                            *q = v as f32;
                        }
                        *y = q
                            .chunks(c.group)
                            .zip(x.chunks(c.group))
                            .enumerate()
                            .map(|(g, (a, b))| {
                                scales[(r * cols + g * c.group) / c.group]
                                    * a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>()
                            })
                            .sum();
                    }
                })
            }) / n;
            println!(
                "{rows}x{cols} {q} {} | {f_simd:.3} {f_port:.3} {reference:.2} | {f32_dense:.3} {int8:.3}",
                t.codes.coding
            );
        }
    }
}
