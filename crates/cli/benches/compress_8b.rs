//! Lossless coding of the synthetic Llama-3.1-8B BF16 decoder linears: dtANS-LLM (auto coding)
//! beside the DFloat11-layout coder, against the exponent entropy bound, with the size predictor's
//! error and encode/decode throughput on this machine.
//!
//! Run: cargo bench -p entrollm --bench compress_8b -- [--layers N] [--seed S]
//! (all 32 layers: 224 matrices, 6.98 G weights, 13.96 GB of BF16; one matrix in memory at a time).

use entrollm_codec::df11::Df11Tensor;
use entrollm_codec::dtans::{choose_coding, default_slice_width, DtansTensor};
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_codec::Payload;
use entrollm_model::synth::{fill_tensor_16, tensors, SynthDtype, SynthShape};
use std::time::Instant;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let layers = arg("--layers", 32) as usize;
    let seed = arg("--seed", 0);
    let config = SynthShape::Llama31_8B.config();
    let linears: Vec<_> = tensors(&config)
        .into_iter()
        .filter(|t| t.name.starts_with("model.layers.") && t.shape.len() == 2)
        .filter(|t| {
            t.name
                .split('.')
                .nth(2)
                .and_then(|l| l.parse::<usize>().ok())
                .is_some_and(|l| l < layers)
        })
        .collect();
    let threads = rayon::current_num_threads();
    println!("synthetic Llama-3.1-8B BF16, {} decoder linears of {layers} layers, seed {seed}, {threads} threads", linears.len());
    let (mut n, mut bound, mut dtans_bytes, mut df11_bytes) = (0f64, 0f64, 0f64, 0f64);
    let (mut t_enc, mut t_dec, mut t_df11) = (0f64, 0f64, 0f64);
    let mut worst_pred = 0f64;
    let mut codings = std::collections::BTreeMap::<String, usize>::new();
    for t in &linears {
        let mut bytes = vec![0u8; 2 * t.numel()];
        fill_tensor_16(t, seed, SynthDtype::Bf16, &mut bytes);
        let (rows, cols) = (t.shape[0], t.shape[1]);

        let start = Instant::now();
        let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
        let (coding, _) =
            choose_coding(Payload::Bf16, rows, cols, &codes, default_slice_width(cols)).unwrap();
        let coded = DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, coding).unwrap();
        t_enc += start.elapsed().as_secs_f64();

        let start = Instant::now();
        let back = coded.decode().unwrap();
        t_dec += start.elapsed().as_secs_f64();
        assert!(back == bytes, "{}: not bit-exact", t.name);

        let words: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let start = Instant::now();
        let df = Df11Tensor::encode(&words).unwrap();
        t_df11 += start.elapsed().as_secs_f64();

        let predicted =
            DtansTensor::predict_bytes(Payload::Bf16, rows, cols, &codes, coding).unwrap();
        let numel = t.numel() as f64;
        let h = entropy_bits(&byte_histogram(&codes));
        n += numel;
        bound += numel * (h + 8.0);
        dtans_bytes += coded.stored_bytes() as f64;
        df11_bytes += df.stored_bytes() as f64;
        let err = predicted / coded.stored_bytes() as f64 - 1.0;
        worst_pred = if err.abs() > worst_pred.abs() {
            err
        } else {
            worst_pred
        };
        *codings
            .entry(format!(
                "{:?} M=2^{} sc={} t={:?}",
                coding.mode, coding.log2_m, coding.sc, coding.t
            ))
            .or_default() += 1;
        eprintln!(
            "{:<40} H={h:.4} dtans {:.4} bpw  df11 {:.4} bpw  predictor {:+.3}%",
            t.name,
            coded.bits_per_weight(),
            df.bits_per_weight(),
            100.0 * err
        );
    }
    let gb = 2.0 * n / 1e9;
    println!(
        "weights                          {:.3} G ({gb:.2} GB BF16)",
        n / 1e9
    );
    println!(
        "exponent entropy + 8             {:.4} bits/weight",
        bound / n
    );
    println!(
        "dtANS-LLM (auto coding)          {:.4} bits/weight  ({:+.4} over the bound)",
        dtans_bytes * 8.0 / n,
        (dtans_bytes * 8.0 - bound) / n
    );
    println!(
        "DFloat11 layout                  {:.4} bits/weight  ({:+.4} over the bound)",
        df11_bytes * 8.0 / n,
        (df11_bytes * 8.0 - bound) / n
    );
    println!(
        "size predictor, worst error      {:+.3} %",
        100.0 * worst_pred
    );
    println!(
        "dtANS encode (choose+code)       {:.0} MB/s of BF16 input",
        gb * 1e3 / t_enc
    );
    println!(
        "dtANS decode (CPU reference)     {:.0} MB/s of BF16 output",
        gb * 1e3 / t_dec
    );
    println!(
        "DFloat11-layout encode           {:.0} MB/s of BF16 input",
        gb * 1e3 / t_df11
    );
    for (c, k) in codings {
        println!("coding chosen: {k:>4} × {c}");
    }
}
