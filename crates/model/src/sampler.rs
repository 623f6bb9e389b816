//! Token sampling (greedy, temperature, top-k, top-p, repetition penalty) with a seeded PRNG, and
//! a streaming generation loop.

use crate::engine::Engine;
use crate::error::{ModelError, Result};
use entrollm_codec::rng::SplitMix64;
use std::ops::ControlFlow;

/// How to pick the next token. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` turn
/// those filters off; `repetition_penalty == 1` turns the penalty off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    /// HF's CTRL-style penalty: logits of tokens already in the sequence (prompt included) are
    /// divided by it when positive and multiplied by it when negative.
    pub repetition_penalty: f32,
    /// Keep the tokens whose probability is at least this share of the most probable one's
    /// (llama.cpp's min-p; 0: all).
    pub min_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::Config(format!(
                "sampler temperature: {} is not a finite value ≥ 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Config(format!(
                "sampler top_p: {} is not in (0, 1]",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(ModelError::Config(format!(
                "sampler min_p: {} is not in [0, 1]",
                self.min_p
            )));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(ModelError::Config(format!(
                "sampler repetition_penalty: {} is not a finite value > 0",
                self.repetition_penalty
            )));
        }
        Ok(())
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

/// Picks tokens from logits; the same params and seed give the same tokens.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            rng: SplitMix64::new(params.seed),
            params,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token given the logits and the tokens of the sequence so far (for the
    /// repetition penalty). Filters apply in HF's order: penalty, temperature, top-k, top-p.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        let p = &self.params;
        let mut scores = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; scores.len()];
            for &t in history {
                if let Some(s) = scores.get_mut(t as usize) {
                    if !std::mem::replace(&mut seen[t as usize], true) {
                        *s = if *s > 0.0 {
                            *s / p.repetition_penalty
                        } else {
                            *s * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(&scores).ok_or_else(no_finite_logit);
        }
        let probs = self.candidates(&scores)?;
        let total: f64 = probs.iter().map(|&(_, p)| p).sum();
        let mut u = self.rng.unit() * total;
        for &(token, p) in &probs {
            if u < p {
                return Ok(token);
            }
            u -= p;
        }
        // Rounding left u just above the last cumulative sum.
        Ok(probs[probs.len() - 1].0)
    }

    /// The tokens that survive top-k and top-p with their unnormalised probabilities, most
    /// probable first.
    fn candidates(&self, scores: &[f32]) -> Result<Vec<(u32, f64)>> {
        let p = &self.params;
        let mut cands: Vec<(u32, f32)> = scores
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_finite())
            .map(|(i, &s)| (i as u32, s))
            .collect();
        if cands.is_empty() {
            return Err(no_finite_logit());
        }
        // Higher score first, lower id first among equals.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, order);
            cands.truncate(p.top_k);
        }
        cands.sort_unstable_by(order);
        let max = cands[0].1 as f64;
        let temperature = p.temperature as f64;
        let mut probs: Vec<(u32, f64)> = cands
            .iter()
            .map(|&(t, s)| (t, ((s as f64 - max) / temperature).exp()))
            .collect();
        if p.min_p > 0.0 {
            // probs[0] is the most probable, at exp(0) = 1.
            let floor = p.min_p as f64;
            probs.retain(|&(_, q)| q >= floor);
        }
        if p.top_p < 1.0 {
            let total: f64 = probs.iter().map(|&(_, p)| p).sum();
            let threshold = p.top_p as f64 * total;
            // Keep token j while the mass before it is below top_p (at least one survives).
            let mut before = 0.0;
            let keep = probs
                .iter()
                .take_while(|&&(_, p)| {
                    let keep = before < threshold;
                    before += p;
                    keep
                })
                .count();
            probs.truncate(keep.max(1));
        }
        Ok(probs)
    }
}

fn no_finite_logit() -> ModelError {
    ModelError::Config("sampler: the logits hold no finite value".into())
}

/// The index of the largest finite logit (the first of equals), or `None` if there is none.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_finite() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i as u32, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Why [`generate`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was sampled (it is not in [`Generation::tokens`]).
    StopToken(u32),
    /// `max_new_tokens` tokens were generated.
    MaxTokens,
    /// The engine's context is full.
    ContextFull,
    /// The token callback asked to stop.
    Callback,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// What an engine is given before the next token is sampled.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// Tokens appended to the sequence.
    Prefill(&'a [u32]),
    /// One decode step.
    Step(u32),
}

/// An engine [`generate`] runs on: the CPU [`Engine`] here, the GPU engine beside it.
pub trait Decoder {
    type Error: From<ModelError>;
    /// Empties the sequence.
    fn reset(&mut self);
    /// Appends `tokens`; the logits after the last one.
    fn prefill(&mut self, tokens: &[u32]) -> std::result::Result<Vec<f32>, Self::Error>;
    /// Appends `token`; the logits after it.
    fn step(&mut self, token: u32) -> std::result::Result<Vec<f32>, Self::Error>;
    /// Tokens in the sequence.
    fn position(&self) -> usize;
    /// The most tokens the sequence holds.
    fn max_seq_len(&self) -> usize;
    /// The greedy next token after `input`, where the engine takes the argmax without handing
    /// the logits over (the GPU); `None`: it does not, and [`generate`] samples the logits.
    fn greedy(&mut self, _input: Input<'_>) -> std::result::Result<Option<u32>, Self::Error> {
        Ok(None)
    }
}

impl Decoder for Engine {
    type Error = ModelError;
    fn reset(&mut self) {
        Engine::reset(self)
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Engine::prefill(self, tokens)
    }
    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        Engine::step(self, token)
    }
    fn position(&self) -> usize {
        Engine::position(self)
    }
    fn max_seq_len(&self) -> usize {
        Engine::max_seq_len(self)
    }
}

/// How [`generate`] goes on and when it stops.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenerateOptions<'a> {
    pub max_new_tokens: usize,
    pub stop_tokens: &'a [u32],
    /// When the context fills up, keep the sequence's first token and its newer half, prefill
    /// them anew and go on (llama.cpp's context shift); without it, stop
    /// ([`StopReason::ContextFull`]).
    pub context_shift: bool,
    /// Hand the callback the logits each token was sampled from (no device-side argmax then).
    pub logits: bool,
}

/// Appends `prompt` to the engine's sequence and samples up to `max_new_tokens` tokens, handing
/// each to `on_token` as it is produced (with its logits when [`GenerateOptions::logits`]). The
/// last sampled token (a stop token, or the final one) is not fed back into the engine, as in HF
/// `generate`. Greedy sampling without logits takes the engine's own argmax where it has one.
pub fn generate<D: Decoder + ?Sized>(
    engine: &mut D,
    sampler: &mut Sampler,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32, Option<&[f32]>) -> ControlFlow<()>,
) -> std::result::Result<Generation, D::Error> {
    let mut tokens = Vec::new();
    if opts.max_new_tokens == 0 {
        return Ok(Generation {
            tokens,
            stop: StopReason::MaxTokens,
        });
    }
    let p = sampler.params();
    let engine_greedy = !opts.logits && p.temperature == 0.0 && p.repetition_penalty == 1.0;
    let mut history = prompt.to_vec();
    let mut logits = Vec::new();
    let next = |engine: &mut D,
                sampler: &mut Sampler,
                input: Input,
                history: &[u32],
                logits: &mut Vec<f32>|
     -> std::result::Result<u32, D::Error> {
        if engine_greedy {
            if let Some(t) = engine.greedy(input)? {
                logits.clear();
                return Ok(t);
            }
        }
        *logits = match input {
            Input::Prefill(t) => engine.prefill(t)?,
            Input::Step(t) => engine.step(t)?,
        };
        Ok(sampler.sample(logits, history)?)
    };
    let mut token = next(
        engine,
        sampler,
        Input::Prefill(prompt),
        &history,
        &mut logits,
    )?;
    // The tokens in the engine's sequence once `token` is fed.
    let mut context: Vec<u32> = prompt.to_vec();
    let stop = loop {
        if opts.stop_tokens.contains(&token) {
            break StopReason::StopToken(token);
        }
        tokens.push(token);
        history.push(token);
        context.push(token);
        let shown = (opts.logits && !logits.is_empty()).then_some(&logits[..]);
        if on_token(token, shown).is_break() {
            break StopReason::Callback;
        }
        if tokens.len() == opts.max_new_tokens {
            break StopReason::MaxTokens;
        }
        if engine.position() == engine.max_seq_len() {
            if !opts.context_shift {
                break StopReason::ContextFull;
            }
            let half = (context.len() - 1) / 2;
            let kept: Vec<u32> = std::iter::once(context[0])
                .chain(context[context.len() - half..].iter().copied())
                .collect();
            engine.reset();
            token = next(
                engine,
                sampler,
                Input::Prefill(&kept),
                &history,
                &mut logits,
            )?;
            context = kept;
            continue;
        }
        token = next(engine, sampler, Input::Step(token), &history, &mut logits)?;
    };
    Ok(Generation { tokens, stop })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.0,
            min_p: 0.0,
            seed,
        })
        .unwrap()
    }

    /// Counts of each token over `draws` samples.
    fn histogram(s: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[s.sample(logits, &[]).unwrap() as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_is_the_first_largest_finite_logit() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.5, 2.0, -1.0, 2.0], &[]).unwrap(), 1);
        assert_eq!(
            s.sample(&[f32::NAN, -3.0, f32::NEG_INFINITY], &[]).unwrap(),
            1
        );
        assert!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]).is_err());
        assert!(s.sample(&[], &[]).is_err());
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let draw = |seed| {
            let mut s = sampler(1.0, 0, 1.0, seed);
            (0..64)
                .map(|_| s.sample(&logits, &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let temperature = 0.8f64;
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| (l as f64 / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let draws = 200_000;
        let counts = histogram(&mut sampler(0.8, 0, 1.0, 1), &logits, draws);
        for (c, w) in counts.iter().zip(&weights) {
            let expected = w / total;
            let sd = (expected * (1.0 - expected) / draws as f64).sqrt();
            let got = *c as f64 / draws as f64;
            assert!((got - expected).abs() < 5.0 * sd, "{got} vs {expected}");
        }
    }

    #[test]
    fn min_p_keeps_tokens_near_the_most_probable() {
        // At temperature 1, probabilities relative to the best: 1, e^-0.5, e^-1, e^-3.
        let logits = [3.0f32, 2.5, 2.0, 0.0];
        let params = |min_p| SamplingParams {
            temperature: 1.0,
            min_p,
            seed: 3,
            ..SamplingParams::greedy()
        };
        let kept = |min_p| {
            let counts = histogram(&mut Sampler::new(params(min_p)).unwrap(), &logits, 4000);
            counts.iter().map(|&c| c > 0).collect::<Vec<_>>()
        };
        assert_eq!(kept(0.0), [true, true, true, true]);
        assert_eq!(kept(0.3), [true, true, true, false]);
        assert_eq!(kept(0.5), [true, true, false, false]);
        assert_eq!(kept(1.0), [true, false, false, false]);
        for bad in [-0.1, 1.5, f32::NAN] {
            assert!(Sampler::new(params(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let logits = [1.0f32, 3.0, 2.9, 0.5, 2.95, -2.0];
        let counts = histogram(&mut sampler(5.0, 2, 1.0, 3), &logits, 20_000);
        assert_eq!(
            counts
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(i, _)| i)
                .collect::<Vec<_>>(),
            vec![1, 4]
        );
        // Within the two, the ratio follows exp((3 - 2.95) / 5).
        let ratio = counts[1] as f64 / counts[4] as f64;
        assert!((ratio - (0.05f64 / 5.0).exp()).abs() < 0.05, "{ratio}");
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
        let logits = [
            (0.5f32).ln(),
            (0.25f32).ln(),
            (0.125f32).ln(),
            (0.125f32).ln(),
        ];
        let kept = |top_p: f32| {
            let counts = histogram(&mut sampler(1.0, 0, top_p, 5), &logits, 20_000);
            counts.iter().filter(|&&c| c > 0).count()
        };
        // (Exact boundaries like 0.5 are left out: they hinge on the last bit of exp(ln 0.5).)
        assert_eq!(kept(0.3), 1);
        assert_eq!(kept(0.49), 1);
        assert_eq!(kept(0.51), 2);
        assert_eq!(kept(0.74), 2);
        assert_eq!(kept(0.76), 3);
        assert_eq!(kept(0.87), 3);
        assert_eq!(kept(0.9), 4);
        assert_eq!(kept(1.0), 4);
        // With 0.6: the two survivors keep their relative odds 2:1.
        let counts = histogram(&mut sampler(1.0, 0, 0.6, 9), &logits, 30_000);
        let ratio = counts[0] as f64 / counts[1] as f64;
        assert!((ratio - 2.0).abs() < 0.1, "{ratio}");
    }

    #[test]
    fn repetition_penalty_follows_hf() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        })
        .unwrap();
        // Token 0 (3.0 → 1.5) loses to token 1 (2.0); a repeated id is penalised once.
        assert_eq!(s.sample(&[3.0, 2.0, -1.0], &[0, 0, 0]).unwrap(), 1);
        // Negative logits are multiplied: token 2 (-0.5 → -1.0) loses to token 1 (-0.8).
        assert_eq!(s.sample(&[-5.0, -0.8, -0.5], &[2]).unwrap(), 1);
        // Ids outside the vocabulary are ignored.
        assert_eq!(s.sample(&[1.0, 0.0], &[99]).unwrap(), 0);
    }

    #[test]
    fn invalid_params_are_rejected() {
        for (t, p, r) in [
            (-1.0, 1.0, 1.0),
            (f32::NAN, 1.0, 1.0),
            (1.0, 0.0, 1.0),
            (1.0, 1.5, 1.0),
            (1.0, 1.0, 0.0),
        ] {
            let params = SamplingParams {
                temperature: t,
                top_k: 0,
                top_p: p,
                repetition_penalty: r,
                min_p: 0.0,
                seed: 0,
            };
            assert!(matches!(Sampler::new(params), Err(ModelError::Config(_))));
        }
    }
}
