//! DFloat11-layout coder speed and size on 4M BF16 weights ~ N(0, 0.02^2):
//! `cargo bench -p entrollm-codec --bench df11`.

#[path = "../tests/df11_support/mod.rs"]
mod df11_support;

use std::time::Instant;

use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::histogram::{byte_histogram, entropy_bits};

/// Best wall time of `runs` calls, in seconds.
fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let out = f();
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(out);
    }
    (best, last.expect("runs > 0"))
}

fn main() {
    let n = 4 << 20;
    let w = df11_support::normal_bf16(7, n, 0.02);
    let exps: Vec<u8> = w.iter().map(|&x| (x >> 7) as u8).collect();
    let entropy = entropy_bits(&byte_histogram(&exps));
    let mb = (2 * n) as f64 / 1e6;

    let (t_enc, t) = best_of(5, || Df11Tensor::encode(&w).expect("encode"));
    let mut out = vec![0u16; n];
    let (t_dec, ()) = best_of(5, || t.decode_into(&mut out).expect("decode"));
    assert!(out == w, "round trip");
    let (rows, cols) = (1024, n / 1024);
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let mut y = vec![0f32; rows];
    let (t_mv, ()) = best_of(5, || t.matvec(rows, cols, &x, &mut y).expect("matvec"));

    println!(
        "df11: {n} weights N(0, 0.02^2), exponent entropy {entropy:.3} bits, {:.3} bits/weight \
         ({} LUT rows, {} blocks)",
        t.bits_per_weight(),
        t.luts.len() / 256,
        t.blocks()
    );
    println!(
        "df11: encode {:.1} MB/s, decode {:.1} MB/s, matvec {:.1} MB/s (BF16 bytes), {} threads",
        mb / t_enc,
        mb / t_dec,
        mb / t_mv,
        rayon::current_num_threads()
    );
}
