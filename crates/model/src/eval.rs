//! Perplexity over a token sequence with an HF-style sliding window.

use crate::engine::Engine;
use crate::error::{ModelError, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// `exp(mean_nll)`.
    pub ppl: f64,
    /// Mean negative log-likelihood per scored token, in nats.
    pub mean_nll: f64,
    pub tokens_scored: usize,
}

/// Perplexity of `tokens` as transformers' documented sliding-window recipe computes it: windows
/// of up to `window` tokens start every `stride` tokens, and each window scores only the tokens
/// the previous windows did not, with the rest of the window as context. The first token of the
/// sequence is never scored (nothing predicts it), nor is the first token of a window that no
/// earlier window overlaps (`stride == window`). The engine is reset before every window and
/// left holding the last one.
pub fn perplexity(
    engine: &mut Engine,
    tokens: &[u32],
    window: usize,
    stride: usize,
) -> Result<Perplexity> {
    if tokens.len() < 2 {
        return Err(ModelError::Config(format!(
            "perplexity: needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    if window < 2 || window > engine.max_seq_len() + 1 {
        return Err(ModelError::Config(format!(
            "perplexity window: {window} is out of range (2..={}, the engine's max_seq_len + 1)",
            engine.max_seq_len() + 1
        )));
    }
    if stride == 0 || stride > window {
        return Err(ModelError::Config(format!(
            "perplexity stride: {stride} is out of range (1..={window}, the window)"
        )));
    }
    let mut total_nll = 0f64;
    let mut scored = 0usize;
    // Tokens before this index have been scored.
    let mut scored_until = 1;
    let mut begin = 0;
    loop {
        let end = (begin + window).min(tokens.len());
        let first_target = scored_until.max(begin + 1);
        // The window's last token is only a target: it needs no forward pass. A one-token
        // window (the tail when `stride == window`) has nothing to score.
        if end - begin >= 2 {
            engine.reset();
            engine.forward(
                &tokens[begin..end - 1],
                first_target - 1 - begin,
                |i, logits| {
                    let target = tokens[begin + i + 1] as usize;
                    total_nll += log_sum_exp(logits) - logits[target] as f64;
                    scored += 1;
                },
            )?;
        }
        scored_until = end;
        if end == tokens.len() {
            break;
        }
        begin += stride;
    }
    let mean_nll = total_nll / scored as f64;
    Ok(Perplexity {
        ppl: mean_nll.exp(),
        mean_nll,
        tokens_scored: scored,
    })
}

fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sum_exp_is_stable_for_large_logits() {
        let lse = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert!((log_sum_exp(&[0.0; 8]) - 8f64.ln()).abs() < 1e-12);
    }
}
