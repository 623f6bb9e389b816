//! `entrollm`: compress LLM checkpoints close to their entropy and run them.

mod bench;
mod budget;
mod compress;
mod decompress;
mod generate;
mod inspect;
mod progress;
mod selftest;
mod serve;
mod synth;
mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "entrollm",
    version,
    about = "Entropy-coded LLM inference: compress checkpoints losslessly and run them"
)]
struct Cli {
    /// Worker threads, 1 to 1024 (default: all cores).
    #[arg(short = 't', long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic Hugging Face-style checkpoint with realistic weight statistics.
    Synth(synth::Args),
    /// Code a checkpoint into an entrollm container: losslessly, or lossily at --bits.
    Compress(compress::Args),
    /// Rebuild the original checkpoint from a container, bit for bit.
    Decompress(decompress::Args),
    /// Show per-tensor sizes, entropies and codings of a container or checkpoint.
    Inspect(inspect::Args),
    /// Generate text from a prompt (streams tokens).
    Run(generate::RunArgs),
    /// Chat with a model using its chat template (one user turn per line on stdin).
    Chat(generate::ChatArgs),
    /// Evaluate a model.
    #[command(subcommand)]
    Eval(Eval),
    /// Decode benchmark on the GPU or the CPU (docs/cli.md): tok/s, bandwidth, prefill, memory.
    Bench(bench::Args),
    /// Check every GPU kernel and the GPU forward pass against the CPU (`--gpu`).
    Selftest(selftest::Args),
    /// Measure every launch's weight forms on this device: size–latency fronts in a tune file.
    Tune(tune::TuneArgs),
    /// Choose a form per launch from a tune file under a memory budget.
    Plan(tune::PlanArgs),
    /// Serve a model over an OpenAI-compatible HTTP API, with a chat page (docs/server.md).
    Serve(serve::Args),
}

#[derive(Subcommand)]
enum Eval {
    /// Perplexity of a text file (sliding window).
    Ppl(generate::PplArgs),
}

fn main() {
    // llama.cpp spells the system prompt `-sys`, one dash and three letters.
    let args = std::env::args_os().map(|a| match a.to_str() {
        Some("-sys") => "--system".into(),
        _ => a,
    });
    let cli = Cli::parse_from(args);
    // Die quietly when stdout is a closed pipe (`entrollm inspect … | head`), like other CLI
    // tools, instead of panicking in println!. Not the server: a client that leaves must not end
    // it (a closed socket is an error on that connection only).
    // SAFETY: restores the default disposition of one signal before any thread starts.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // SIGINT/SIGTERM: the partial output of the command in flight is removed, then the process
    // exits as the signal would have ended it (SIGKILL's leftovers go on the next run beside the
    // same output). The server handles them itself: it finishes its answers first.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        if let Ok(mut signals) = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
        ]) {
            std::thread::spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    if entrollm_format::remove_live() > 0 {
                        eprintln!("\ninterrupted: the partial output was removed");
                    }
                    std::process::exit(128 + sig);
                }
            });
        }
    }
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = cli.threads {
        // Far past any core count a machine has; more only stalls the machine creating them.
        const MAX_THREADS: usize = 1024;
        if n == 0 || n > MAX_THREADS {
            eprintln!("error: --threads {n}: expected 1 to {MAX_THREADS} (default: all cores)");
            std::process::exit(1);
        }
        pool = pool.num_threads(n);
    }
    if let Err(e) = pool.build_global() {
        eprintln!("error: cannot start the worker threads (--threads): {e}");
        std::process::exit(1);
    }
    let result = match cli.command {
        Command::Synth(a) => synth::run(a),
        Command::Compress(a) => compress::run(a),
        Command::Decompress(a) => decompress::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Run(a) => on_pool(|| generate::run(a)),
        Command::Chat(a) => on_pool(|| generate::chat(a)),
        Command::Eval(Eval::Ppl(a)) => on_pool(|| generate::ppl(a)),
        Command::Bench(a) => on_pool(|| bench::run(a)),
        Command::Selftest(a) => selftest::run(a),
        Command::Tune(a) => tune::run_tune(a),
        Command::Plan(a) => tune::run_plan(a),
        Command::Serve(a) => serve::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The threads' stack: the main thread's usual size, for commands run on the pool ([`on_pool`]).
const WORKER_STACK: usize = 8 << 20;

/// `f` run on one of the global pool's threads: a decode loop's parallel products then share out
/// their tasks from inside the pool, instead of handing each one to the pool and sleeping until
/// it is done (two context switches a product, a fifth of a small model's CPU decode).
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
