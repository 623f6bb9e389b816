//! `entrollm run` and `entrollm chat`: text generation on the CPU reference engine.

use anyhow::{bail, Result};
use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::load::open_model;
use entrollm_model::sampler::{generate, Sampler, SamplingParams};
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::Engine;
use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ModelArgs {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    model: PathBuf,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of tokens with this much probability (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Context length to allocate (default: the model's, at most 4096).
    #[arg(long)]
    context: Option<usize>,
    /// cpu (the CUDA engine is not wired into the CLI yet).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// For containers: decode coded matrices once at load instead of running them through the
    /// fused decode-matvec at every product (faster on the CPU, uses the uncoded size in memory).
    #[arg(long)]
    decode_at_load: bool,
}

#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (raw text; use `chat` for the chat template).
    #[arg(short, long)]
    prompt: String,
}

struct Session {
    engine: Engine,
    tokenizer: Tokenizer,
    sampler: Sampler,
    max_tokens: usize,
}

fn open(a: &ModelArgs) -> Result<Session> {
    if a.device != "cpu" {
        bail!(
            "--device {}: only the CPU engine is available in this build (use --device cpu)",
            a.device
        );
    }
    let (weights, tokenizer) = open_model(&a.model, !a.decode_at_load)?;
    let ctx = a
        .context
        .unwrap_or(weights.config.max_position_embeddings.min(4096));
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        ..SamplingParams::greedy()
    };
    Ok(Session {
        engine: Engine::new(weights, ctx)?,
        tokenizer,
        sampler: Sampler::new(params)?,
        max_tokens: a.max_tokens,
    })
}

impl Session {
    /// Generates after `prompt` (token ids), streaming text to stdout; returns the generated ids.
    fn stream(&mut self, prompt: &[u32]) -> Result<Vec<u32>> {
        let stops = self.tokenizer.eos_ids().to_vec();
        let mut decoder = self.tokenizer.stream_decoder();
        let mut out = std::io::stdout().lock();
        let mut failed = None;
        let generation = generate(
            &mut self.engine,
            &mut self.sampler,
            prompt,
            self.max_tokens,
            &stops,
            |id| {
                if stops.contains(&id) {
                    return ControlFlow::Continue(());
                }
                match decoder.push(id) {
                    Ok(Some(text)) => {
                        let _ = out.write_all(text.as_bytes());
                        let _ = out.flush();
                    }
                    Ok(None) => {}
                    Err(e) => {
                        failed = Some(e);
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            },
        )?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        if let Some(rest) = decoder.flush()? {
            out.write_all(rest.as_bytes())?;
        }
        writeln!(out)?;
        Ok(generation.tokens)
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let mut s = open(&a.model)?;
    let ids = s.tokenizer.encode(&a.prompt, true)?;
    s.engine.reset();
    s.stream(&ids)?;
    Ok(())
}

/// Interactive chat with the model's chat template; reads one user turn per line from stdin (so it
/// also works piped). An empty line or end of input ends the session.
pub fn chat(a: ModelArgs) -> Result<()> {
    let mut s = open(&a)?;
    let template = ChatTemplate::for_tokenizer(&s.tokenizer)?;
    if template.is_fallback() {
        eprintln!("note: the model has no chat template; using ChatML");
    }
    let mut messages: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::user(line));
        let prompt = template.render(&messages, true)?;
        let ids = s.tokenizer.encode(&prompt, false)?;
        s.engine.reset();
        let reply = s.stream(&ids)?;
        messages.push(ChatMessage::assistant(
            s.tokenizer.decode(&reply)?.trim().to_string(),
        ));
        if interactive {
            eprint!("> ");
        }
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct PplArgs {
    /// A .gguf file, an entrollm container or a Hugging Face checkpoint directory.
    model: PathBuf,
    /// The text to score (UTF-8).
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Tokens between window starts; each window scores only the tokens the previous one did not.
    #[arg(long, default_value_t = 512)]
    stride: usize,
    /// Score at most this many tokens of the file (0: all).
    #[arg(long, default_value_t = 0)]
    max_tokens: usize,
}

/// `entrollm eval ppl`: perplexity of a text file, HF-style sliding window.
pub fn ppl(a: PplArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?;
    let (weights, tokenizer) = open_model(&a.model, false)?;
    let mut tokens = tokenizer.encode(&text, true)?;
    if a.max_tokens > 0 {
        tokens.truncate(a.max_tokens);
    }
    let mut engine = Engine::new(weights, a.window)?;
    let p = entrollm_model::perplexity(&mut engine, &tokens, a.window, a.stride)?;
    println!(
        "{}: perplexity {:.4} (mean NLL {:.6} nats over {} tokens; window {}, stride {})",
        a.file.display(),
        p.ppl,
        p.mean_nll,
        p.tokens_scored,
        a.window,
        a.stride
    );
    Ok(())
}
