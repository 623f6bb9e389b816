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

/// One window of [`windows`]: the engine is given `tokens[begin..end - 1]` and scores the
/// targets `tokens[first_target..end]` (each from the logits after the token before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
}

/// The windows of transformers' documented sliding-window recipe: windows of up to `window`
/// tokens start every `stride` tokens, and each window scores only the tokens the previous
/// windows did not, with the rest of the window as context. The first token of the sequence is
/// never scored (nothing predicts it), nor is the first token of a window that no earlier window
/// overlaps (`stride == window`); a window with nothing to score is left out. `max_window` is
/// the most tokens an engine holds plus one.
pub fn windows(len: usize, window: usize, stride: usize, max_window: usize) -> Result<Vec<Window>> {
    if len < 2 {
        return Err(ModelError::Config(format!(
            "perplexity: needs at least 2 tokens, got {len}"
        )));
    }
    if window < 2 || window > max_window {
        return Err(ModelError::Config(format!(
            "perplexity window: {window} is out of range (2..={max_window}, the engine's \
             max_seq_len + 1)"
        )));
    }
    if stride == 0 || stride > window {
        return Err(ModelError::Config(format!(
            "perplexity stride: {stride} is out of range (1..={window}, the window)"
        )));
    }
    let mut out = Vec::new();
    // Tokens before this index have been scored.
    let mut scored_until = 1;
    let mut begin = 0;
    loop {
        let end = (begin + window).min(len);
        let first_target = scored_until.max(begin + 1);
        // The window's last token is only a target: it needs no forward pass. A one-token
        // window (the tail when `stride == window`) has nothing to score.
        if end - begin >= 2 {
            out.push(Window {
                begin,
                end,
                first_target,
            });
        }
        scored_until = end;
        if end == len {
            return Ok(out);
        }
        begin += stride;
    }
}

/// Perplexity of `tokens` over the [`windows`] of `window` and `stride`. The engine is reset
/// before every window and left holding the last one.
pub fn perplexity(
    engine: &mut Engine,
    tokens: &[u32],
    window: usize,
    stride: usize,
) -> Result<Perplexity> {
    let mut nll = Nll::default();
    for w in windows(tokens.len(), window, stride, engine.max_seq_len() + 1)? {
        engine.reset();
        engine.forward(
            &tokens[w.begin..w.end - 1],
            w.first_target - 1 - w.begin,
            |i, logits| nll.add(logits, tokens[w.begin + i + 1] as usize),
        )?;
    }
    Ok(nll.perplexity())
}

/// A running sum of negative log-likelihoods.
#[derive(Clone, Copy, Debug, Default)]
pub struct Nll {
    total: f64,
    scored: usize,
}

impl Nll {
    /// Scores `target` under `logits`.
    pub fn add(&mut self, logits: &[f32], target: usize) {
        self.total += log_sum_exp(logits) - logits[target] as f64;
        self.scored += 1;
    }

    pub fn perplexity(&self) -> Perplexity {
        let mean_nll = self.total / self.scored.max(1) as f64;
        Perplexity {
            ppl: mean_nll.exp(),
            mean_nll,
            tokens_scored: self.scored,
        }
    }
}

/// How a model's next-token distributions differ from a reference model's on the same tokens
/// (what llama.cpp's `llama-perplexity --kl-divergence` reports).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Divergence {
    /// The model's perplexity and the reference's, on the same windows.
    pub model: Perplexity,
    pub reference: Perplexity,
    /// Mean and largest KL(reference ‖ model) per scored token, in nats.
    pub mean_kl: f64,
    pub max_kl: f64,
    /// Share of scored tokens whose most likely next token is the same in both.
    pub same_top: f64,
    /// Largest |logit − reference logit| over every scored token and vocabulary entry.
    pub max_logit_diff: f64,
}

/// [`Divergence`] of `engine` from `reference` over the [`windows`] of `window` and `stride`;
/// both are given each window in chunks of `chunk` tokens, so that only a chunk's logits are
/// held at once.
pub fn divergence(
    engine: &mut Engine,
    reference: &mut Engine,
    tokens: &[u32],
    window: usize,
    stride: usize,
) -> Result<Divergence> {
    const CHUNK: usize = 64;
    let vocab = engine.config().vocab_size;
    if reference.config().vocab_size != vocab {
        return Err(ModelError::Config(format!(
            "the reference model's vocabulary ({}) is not the model's ({vocab})",
            reference.config().vocab_size
        )));
    }
    let max = engine.max_seq_len().min(reference.max_seq_len()) + 1;
    let (mut nll, mut ref_nll) = (Nll::default(), Nll::default());
    let (mut kl_sum, mut max_kl, mut same, mut max_diff) = (0f64, 0f64, 0usize, 0f64);
    for w in windows(tokens.len(), window, stride, max)? {
        engine.reset();
        reference.reset();
        let input = &tokens[w.begin..w.end - 1];
        let mut at = 0;
        while at < input.len() {
            let chunk = &input[at..(at + CHUNK).min(input.len())];
            // Logits after input[k] for k ≥ from (window-relative), the ones that score targets.
            let from = (w.first_target - 1 - w.begin).max(at) - at;
            let logits_of = |e: &mut Engine| -> Result<Vec<f32>> {
                let mut out = Vec::new();
                if from < chunk.len() {
                    e.forward(chunk, from, |_, l| out.extend_from_slice(l))?;
                } else {
                    e.forward(chunk, chunk.len(), |_, _| {})?;
                }
                Ok(out)
            };
            let (ours, theirs) = (logits_of(engine)?, logits_of(reference)?);
            for (i, (l, r)) in ours.chunks(vocab).zip(theirs.chunks(vocab)).enumerate() {
                let target = tokens[w.begin + at + from + i + 1] as usize;
                nll.add(l, target);
                ref_nll.add(r, target);
                let kl = kl_divergence(r, l);
                kl_sum += kl;
                max_kl = max_kl.max(kl);
                same += (argmax(l) == argmax(r)) as usize;
                for (&a, &b) in l.iter().zip(r) {
                    max_diff = max_diff.max((a as f64 - b as f64).abs());
                }
            }
            at += chunk.len();
        }
    }
    let scored = nll.scored.max(1) as f64;
    Ok(Divergence {
        model: nll.perplexity(),
        reference: ref_nll.perplexity(),
        mean_kl: kl_sum / scored,
        max_kl,
        same_top: same as f64 / scored,
        max_logit_diff: max_diff,
    })
}

/// KL(p ‖ q) of the softmaxes of logits `p` and `q`, in nats.
fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum::<f64>()
        .max(0.0)
}

fn argmax(l: &[f32]) -> usize {
    l.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| match v > best.1 {
            true => (i, v),
            false => best,
        })
        .0
}

/// `ln Σ exp(logits)`, without overflow.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
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
    fn windows_score_every_token_but_the_first_once() {
        for (len, window, stride) in [(2, 2, 1), (10, 4, 2), (10, 4, 4), (17, 5, 3), (9, 16, 8)] {
            let ws = windows(len, window, stride, 64).unwrap();
            let scored: Vec<usize> = ws.iter().flat_map(|w| w.first_target..w.end).collect();
            let expected: Vec<usize> = match stride == window {
                // Window starts after the first are never targets then.
                true => (1..len).filter(|t| t % window != 0).collect(),
                false => (1..len).collect(),
            };
            assert_eq!(scored, expected, "{len} {window} {stride}");
            assert!(ws
                .iter()
                .all(|w| w.end - w.begin <= window && w.first_target > w.begin));
        }
        assert!(windows(1, 4, 2, 64).is_err());
        assert!(windows(10, 65, 2, 64).is_err());
        assert!(windows(10, 4, 5, 64).is_err());
    }

    #[test]
    fn kl_of_equal_distributions_is_zero_and_known_otherwise() {
        let p = [1.0f32, 2.0, 3.0];
        assert!(kl_divergence(&p, &p) < 1e-12);
        // Shifting every logit changes no probability.
        assert!(kl_divergence(&p, &[11.0, 12.0, 13.0]) < 1e-12);
        // KL([½, ½] ‖ [¾, ¼]) = ½ ln(2/3) + ½ ln 2.
        let q = [3f32.ln(), 0.0];
        let expected = 0.5 * (2.0f64 / 3.0).ln() + 0.5 * 2f64.ln();
        assert!((kl_divergence(&[0.0, 0.0], &q) - expected).abs() < 1e-7);
        assert_eq!(argmax(&[0.0, 3.0, 3.0, 1.0]), 1);
    }

    #[test]
    fn log_sum_exp_is_stable_for_large_logits() {
        let lse = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert!((log_sum_exp(&[0.0; 8]) - 8f64.ln()).abs() < 1e-12);
    }
}
