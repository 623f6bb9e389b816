//! `entrollm serve`: the model behind an OpenAI-compatible HTTP API and a chat page
//! (`entrollm_server`, docs/server.md).

use crate::generate::{open, Backend, ModelArgs};
use anyhow::Result;
use entrollm_server::{Loaded, ModelInfo, Options};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free one, printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on the API and /metrics.
    #[arg(long, value_name = "KEY", conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// As --api-key, the key read from a file (its first line), kept out of the process list.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Requests that may wait beyond the one being answered; one more is answered 503 at once.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Seconds a request may take from its arrival (queue included) to its last token.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// The model's name in the API (default: the file or directory name).
    #[arg(long)]
    alias: Option<String>,
}

/// Bytes the model takes on disk: the file, or the directory's files.
fn stored_bytes(p: &Path) -> u64 {
    match std::fs::read_dir(p) {
        Ok(d) => d
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum(),
        Err(_) => std::fs::metadata(p).map_or(0, |m| m.len()),
    }
}

fn format_of(p: &Path) -> &'static str {
    if p.join("entrollm.json").is_file() {
        "entrollm container (lossless)"
    } else if p.is_dir() {
        "safetensors"
    } else {
        "GGUF"
    }
}

pub fn run(a: Args) -> Result<()> {
    let api_key = match (&a.api_key, &a.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(f)) => {
            let text = entrollm_format::input::read_text_limited(f, 1 << 16)
                .map_err(|e| anyhow::anyhow!("--api-key-file {}: {e}", f.display()))?;
            let key = text.lines().next().unwrap_or("").trim().to_string();
            anyhow::ensure!(
                !key.is_empty(),
                "--api-key-file {}: the file holds no key",
                f.display()
            );
            Some(key)
        }
        (None, None) => None,
    };
    if let Some(k) = &api_key {
        anyhow::ensure!(!k.trim().is_empty(), "--api-key: the key is empty");
    }
    anyhow::ensure!(a.timeout > 0, "--timeout: must be at least 1 second");
    let opts = Options {
        host: a.host.clone(),
        port: a.port,
        api_key,
        max_queue: a.max_queue,
        timeout: Duration::from_secs(a.timeout),
    };
    let path = a.model.model.clone();
    let id = a.alias.clone().unwrap_or_else(|| {
        path.file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let model = a.model;
    let load = move || -> Result<Loaded> {
        let s = open(&model)?;
        let (bytes, n) = s.weights;
        let stored = stored_bytes(&model.model);
        let device = match &s.engine {
            Backend::Cpu(_) => match rayon::current_num_threads() {
                1 => "cpu, 1 thread".to_string(),
                n => format!("cpu, {n} threads"),
            },
            Backend::Gpu(_) => "cuda".to_string(),
        };
        let info = ModelInfo {
            id,
            context: s.engine.max_seq_len(),
            meta: json!({
                "format": format_of(&model.model),
                "stored_bytes": stored,
                "stored_bits_per_weight": stored as f64 * 8.0 / n.max(1) as f64,
                "memory_bytes": bytes,
                "memory_bits_per_weight": bytes as f64 * 8.0 / n.max(1) as f64,
                "device": device,
            }),
            defaults: s.sampler.params().clone(),
            default_max_tokens: model.max_tokens,
        };
        let (engine, tokenizer) = (s.engine, s.tokenizer);
        Ok(Loaded {
            engine: Box::new(engine),
            tokenizer,
            info,
        })
    };
    entrollm_server::serve(opts, load, |addr, info| {
        eprintln!(
            "serving {} on http://{addr}/ (chat page), OpenAI API at http://{addr}/v1 — Ctrl-C stops",
            info.id
        );
    })
}
