//! Lossy coding's rate–distortion, encode and decode speed on the matrices:
//! `cargo bench -p entrollm-codec --bench lossy_rd -- [--quick] [--shapes 4096x4096,…]
//! [--bits 2,3,4,6] [--quantizers e8,tcq8,int,int:G,fp8,…] [--sources gauss,heavy,file:PATH]
//! [--rate-weight R] [--prob-bits B] [--rdo K]` (K: the per-row RDO's candidates, off by default).
//!
//! Sources: i.i.d. N(0, 0.02²), heavy-tailed rows (Student-t, 5 degrees of freedom, × a
//! log-normal row scale with σ = 0.3, × 0.015), and real matrices: `file:PATH` reads PATH.json (a
//! list of [name, rows, cols]) and PATH.bin (their f32 values, in that order), coded one by one and
//! reported together (`--shapes` is then not used). Quantisers: the tile ones (`e8`, `tcqN`) and
//! the scalar ones (`int` in groups of 128, `int:G`, `fp8`). Rates count every stored byte. Prints
//! one line per case: achieved bits a weight, relative L2 error, the Gaussian bound 2^-R at the
//! achieved rate, the gap to it in bits, encode seconds, decode MB of BF16 a second; for a file, the
//! totals (Σ bits / Σ weights, √(Σ error² / Σ energy)) and the largest miss of a matrix's rate.

use std::time::Instant;

use entrollm_codec::lossy::scalar::{self, Scalar};
use entrollm_codec::lossy::{LossyTensor, Options, Quantizer};
use entrollm_codec::rng::SplitMix64;
use rayon::prelude::*;

/// Student-t with 5 degrees of freedom: N / sqrt(χ²₅ / 5).
fn t5(g: &mut SplitMix64) -> f64 {
    let chi: f64 = (0..5).map(|_| g.normal().powi(2)).sum();
    g.normal() / (chi / 5.0).sqrt()
}

fn matrix(source: &str, rows: usize, cols: usize) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    w.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let mut g = SplitMix64::new(r as u64 ^ ((cols as u64) << 32) ^ source.len() as u64);
        match source {
            "gauss" => row.iter_mut().for_each(|v| *v = (g.normal() * 0.02) as f32),
            _ => {
                let s = (0.3 * g.normal()).exp() * 0.015;
                row.iter_mut().for_each(|v| *v = (t5(&mut g) * s) as f32);
            }
        }
    });
    w
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (e, s) = a
        .par_iter()
        .zip(b)
        .map(|(&x, &y)| ((x as f64 - y as f64).powi(2), (x as f64).powi(2)))
        .reduce(|| (0.0, 0.0), |p, q| (p.0 + q.0, p.1 + q.1));
    (e / s).sqrt()
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// A quantiser of either kind.
#[derive(Clone, Copy)]
enum Q {
    Tiles(Quantizer),
    Scalar(Scalar),
}

impl std::fmt::Display for Q {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Q::Tiles(q) => q.fmt(f),
            Q::Scalar(q) => q.fmt(f),
        }
    }
}

fn parse_q(s: &str) -> Q {
    match s.split_once(':') {
        _ if s == "fp8" => Q::Scalar(Scalar::Fp8),
        _ if s == "int" => Q::Scalar(Scalar::Int {
            group: scalar::INT_GROUP,
            dead_zone: 0.0,
        }),
        Some(("int", g)) => Q::Scalar(Scalar::Int {
            group: g.parse().expect("group"),
            dead_zone: 0.0,
        }),
        _ => Q::Tiles(s.parse().expect("quantizer")),
    }
}

/// Codes `w` with `q` at `b`: (stored bits a weight, reconstruction).
fn code(w: &[f32], rows: usize, cols: usize, q: Q, b: f64, o: &Options) -> (f64, Vec<f32>) {
    let t = match q {
        Q::Tiles(q) => {
            let o = Options {
                bits: b,
                quantizer: q,
                ..o.clone()
            };
            Coded::Tiles(LossyTensor::encode(w, rows, cols, &o).expect("encode").0)
        }
        Q::Scalar(q) => Coded::Scalar(Box::new(
            scalar::encode(w, rows, cols, q, b, None).expect("encode").0,
        )),
    };
    (t.bits_per_weight(), t.decode())
}

/// The matrices of `file:PATH`: (name, rows, cols, values).
fn read_file(path: &str) -> Vec<(String, usize, usize, Vec<f32>)> {
    let list: Vec<(String, usize, usize)> =
        serde_json::from_str(&std::fs::read_to_string(format!("{path}.json")).expect("PATH.json"))
            .expect("a list of [name, rows, cols]");
    let bin = std::fs::read(format!("{path}.bin")).expect("PATH.bin");
    let mut at = 0;
    list.into_iter()
        .map(|(name, rows, cols)| {
            let n = rows * cols * 4;
            let v = bin[at..at + n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            at += n;
            (name, rows, cols, v)
        })
        .collect()
}

/// Real matrices coded one by one with `q` at each rate; one line of totals per rate.
fn file_source(path: &str, qs: &[Q], bits: &[f64], o: &Options) {
    let mats = read_file(path);
    let weights: usize = mats.iter().map(|m| m.1 * m.2).sum();
    println!("file {path}: {} matrices, {weights} weights", mats.len());
    for &q in qs {
        for &b in bits {
            let t0 = Instant::now();
            let (mut stored, mut err, mut energy, mut worst) = (0f64, 0f64, 0f64, 0f64);
            for (_, rows, cols, w) in &mats {
                let (r, d) = code(w, *rows, *cols, q, b, o);
                stored += r * (rows * cols) as f64;
                worst = f64::max(worst, (r / b - 1.0).abs());
                let (e, s) = w
                    .iter()
                    .zip(&d)
                    .map(|(&x, &y)| ((x as f64 - y as f64).powi(2), (x as f64).powi(2)))
                    .fold((0.0, 0.0), |p, q| (p.0 + q.0, p.1 + q.1));
                err += e;
                energy += s;
            }
            let r = stored / weights as f64;
            let e = (err / energy).sqrt();
            println!(
                "file {q} {b} | {r:.4} {:.3}% {:.3}% {:.3} | worst matrix rate miss {:.2}% | {:.1} s",
                100.0 * e,
                100.0 * (-r).exp2(),
                (e / (-r).exp2()).log2(),
                100.0 * worst,
                t0.elapsed().as_secs_f64()
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let shapes: Vec<(usize, usize)> = arg(&args, "--shapes")
        .unwrap_or(if quick {
            "1024x4096"
        } else {
            "4096x4096,14336x4096,4096x14336"
        })
        .split(',')
        .map(|s| {
            let (r, c) = s.split_once('x').expect("RxC");
            (r.parse().expect("rows"), c.parse().expect("cols"))
        })
        .collect();
    let bits: Vec<f64> = arg(&args, "--bits")
        .unwrap_or("2,3,4,6")
        .split(',')
        .map(|b| b.parse().expect("bits"))
        .collect();
    let quantizers: Vec<Q> = arg(&args, "--quantizers")
        .unwrap_or("e8,tcq8")
        .split(',')
        .map(parse_q)
        .collect();
    let rate_weight: Option<f32> =
        arg(&args, "--rate-weight").map(|v| v.parse().expect("rate weight"));
    let prob_bits: Option<u8> = arg(&args, "--prob-bits").map(|v| v.parse().expect("prob bits"));
    let rdo: usize = arg(&args, "--rdo").map_or(0, |v| v.parse().expect("rdo candidates"));
    let sources: Vec<&str> = arg(&args, "--sources")
        .unwrap_or("gauss,heavy")
        .split(',')
        .collect();
    println!(
        "threads {}; source shape quantizer target | bpp relL2 bound gap_bits | encode_s decode_MB/s",
        rayon::current_num_threads()
    );
    let mut base = Options::new(4.0, Quantizer::E8);
    base.prob_bits = prob_bits;
    base.rdo = rdo;
    if let Some(r) = rate_weight {
        base.rate_weight = r;
    }
    for &source in &sources {
        if let Some(path) = source.strip_prefix("file:") {
            file_source(path, &quantizers, &bits, &base);
            continue;
        }
        for &(rows, cols) in &shapes {
            let w = matrix(source, rows, cols);
            for &q in &quantizers {
                for &b in &bits {
                    let t0 = Instant::now();
                    let t = match q {
                        Q::Tiles(q) => {
                            let o = Options {
                                bits: b,
                                quantizer: q,
                                ..base.clone()
                            };
                            Coded::Tiles(LossyTensor::encode(&w, rows, cols, &o).expect("encode").0)
                        }
                        Q::Scalar(s) => Coded::Scalar(Box::new(
                            scalar::encode(&w, rows, cols, s, b, None)
                                .expect("encode")
                                .0,
                        )),
                    };
                    let enc = t0.elapsed().as_secs_f64();
                    let t1 = Instant::now();
                    let d = t.decode();
                    let dec = t1.elapsed().as_secs_f64();
                    let r = t.bits_per_weight();
                    let e = rel_l2(&w, &d);
                    let bound = (-r).exp2();
                    println!(
                        "{source} {rows}x{cols} {q} {b} | {r:.4} {:.3}% {:.3}% {:.3} | {enc:.2} {:.0}",
                        100.0 * e,
                        100.0 * bound,
                        (e / bound).log2(),
                        2.0 * (rows * cols) as f64 / 1e6 / dec
                    );
                }
            }
        }
    }
}

enum Coded {
    Tiles(LossyTensor),
    Scalar(Box<scalar::ScalarTensor>),
}

impl Coded {
    fn decode(&self) -> Vec<f32> {
        match self {
            Coded::Tiles(t) => t.decode().expect("decode"),
            Coded::Scalar(t) => t.decode().expect("decode"),
        }
    }
    fn bits_per_weight(&self) -> f64 {
        match self {
            Coded::Tiles(t) => t.bits_per_weight(),
            Coded::Scalar(t) => t.bits_per_weight(),
        }
    }
}
