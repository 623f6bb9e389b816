//! `entrollm`: compress LLM checkpoints close to their entropy and run them. The command line is
//! this library's [`Cli`]; the binary (`main.rs`) and the Python package (`crates/py`) both parse it
//! and call [`execute`], so a command does the same from either.

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
pub struct Cli {
    /// Worker threads, 1 to 1024 (default: all cores).
    #[arg(short = 't', long, global = true)]
    pub threads: Option<usize>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
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
pub enum Eval {
    /// Perplexity of a text file (sliding window).
    Ppl(generate::PplArgs),
}

impl Cli {
    /// Parses a command line (the program name first), spelling llama.cpp's `-sys` as `--system`.
    pub fn parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString>,
    {
        let args = args.into_iter().map(|a| {
            let a: std::ffi::OsString = a.into();
            match a.to_str() {
                Some("-sys") => "--system".into(),
                _ => a,
            }
        });
        Cli::try_parse_from(args)
    }

    /// Whether the command is the server (which handles SIGPIPE and SIGINT itself).
    pub fn is_server(&self) -> bool {
        matches!(self.command, Command::Serve(_))
    }
}

/// Runs a parsed command on the global thread pool (built by the caller).
pub fn execute(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Synth(a) => synth::run(a),
        Command::Compress(a) => compress::run(a),
        Command::Decompress(a) => decompress::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Run(a) => on_pool(|| generate::run(a)),
        Command::Chat(a) => on_pool(|| generate::chat(a)),
        Command::Eval(Eval::Ppl(a)) => on_pool(|| generate::ppl(a)),
        Command::Bench(a) => on_pool(|| bench::run(a)),
        Command::Selftest(a) => selftest::run(a),
        // On the pool as the serving commands: a CPU tune times its candidates inside decode
        // steps, which must run as theirs do (their products shared out by the crew).
        Command::Tune(a) => on_pool(|| tune::run_tune(a)),
        Command::Plan(a) => tune::run_plan(a),
        Command::Serve(a) => serve::run(a),
    }
}

/// The global thread pool: `threads` workers (all cores when `None`) with the main thread's stack.
pub fn build_pool(threads: Option<usize>) -> anyhow::Result<()> {
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = threads {
        // Far past any core count a machine has; more only stalls the machine creating them.
        const MAX_THREADS: usize = 1024;
        if n == 0 || n > MAX_THREADS {
            anyhow::bail!("--threads {n}: expected 1 to {MAX_THREADS} (default: all cores)");
        }
        pool = pool.num_threads(n);
    }
    pool.build_global()
        .map_err(|e| anyhow::anyhow!("cannot start the worker threads (--threads): {e}"))
}

/// The global pool's worker count.
pub fn pool_threads() -> usize {
    rayon::current_num_threads()
}

/// The threads' stack: the main thread's usual size, for commands run on the pool ([`on_pool`]).
const WORKER_STACK: usize = 8 << 20;

/// `f` run on one of the global pool's threads: a decode loop's parallel products then share out
/// their tasks from inside the pool, instead of handing each one to the pool and sleeping until
/// it is done (two context switches a product, a fifth of a small model's CPU decode).
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
