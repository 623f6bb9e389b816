//! The engine's side of the server: one thread owns the model and runs the queued requests one at
//! a time (batch 1), streaming each token's text to its request as it is made. The queue hands
//! the engine whole requests, so a continuously batching scheduler can take its place.

use crate::text::{logprobs, Release, StopMatcher};
use entrollm_model::sampler::{generate, GenerateOptions, Sampler, SamplingParams, StopReason};
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::Decoder;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// The engine the server runs on.
pub type Engine = Box<dyn Decoder<Error = anyhow::Error>>;

/// A request as the engine runs it.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Log-probabilities of each token, with this many alternatives.
    pub logprobs: Option<usize>,
    pub deadline: Instant,
    pub events: UnboundedSender<Event>,
}

/// A token's log-probability and the most likely alternatives (token text, log-probability).
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    pub top: Vec<(String, f64)>,
}

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End of turn or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine tells a request, in order: its start, text pieces, then one `Done` or `Failed`.
#[derive(Clone, Debug)]
pub enum Event {
    /// The engine took the request (the queue wait is over).
    Started,
    /// Text to append (may be empty when only `logprob` is news), and the log-probability of the
    /// token that made it, when asked for.
    Text {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// From the first token to the last.
        decode_s: f64,
        /// From the engine taking the request to its first token.
        first_token_s: f64,
    },
    /// The request ended without an answer: timed out, or the server is shutting down (HTTP
    /// status and message).
    Failed { status: u16, message: String },
}

/// What the HTTP side and the engine thread share.
#[derive(Default)]
pub struct Shared {
    /// Requests waiting for the engine (not the one it runs).
    pub waiting: AtomicUsize,
    /// Whether the engine is running a request.
    pub running: AtomicBool,
    /// Set on SIGINT/SIGTERM: queued requests are answered 503, the running one is ended at its
    /// next token once `cancel` is set too.
    pub shutdown: AtomicBool,
    pub cancel: AtomicBool,
}

/// Runs jobs from `jobs` until every sender is gone.
pub fn serve(
    mut engine: Engine,
    tokenizer: Arc<Tokenizer>,
    jobs: std::sync::mpsc::Receiver<Job>,
    shared: Arc<Shared>,
) {
    while let Ok(job) = jobs.recv() {
        shared.waiting.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() {
            continue; // the client left while it waited
        }
        if shared.shutdown.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Failed {
                status: 503,
                message: "the server is shutting down".into(),
            });
            continue;
        }
        if Instant::now() >= job.deadline {
            let _ = job.events.send(Event::Failed {
                status: 503,
                message: "the request timed out waiting for the engine (--timeout; --max-queue \
                          bounds the wait)"
                    .into(),
            });
            continue;
        }
        shared.running.store(true, Ordering::SeqCst);
        let result = run(&mut *engine, &tokenizer, &job, &shared);
        // Cleared before the answer's last event goes out, so a client that has its answer
        // never sees the engine still busy with it.
        shared.running.store(false, Ordering::SeqCst);
        let last = match result {
            Ok(last) => last,
            Err(e) => Some(Event::Failed {
                status: 500,
                message: format!("the engine failed: {e:#}"),
            }),
        };
        if let Some(event) = last {
            let _ = job.events.send(event);
        }
    }
}

/// One request on the engine; what it returns is the answer's last event (none when the client
/// left), which the caller sends once the engine is free.
fn run(
    engine: &mut dyn Decoder<Error = anyhow::Error>,
    tok: &Tokenizer,
    job: &Job,
    shared: &Shared,
) -> anyhow::Result<Option<Event>> {
    let _ = job.events.send(Event::Started);
    let t0 = Instant::now();
    let mut sampler = Sampler::new(job.params.clone())?;
    let mut decoder = tok.stream_decoder();
    let mut stops = StopMatcher::new(&job.stop);
    let eos = tok.eos_ids().to_vec();
    let (mut first, mut last) = (None, t0);
    let mut ended: Option<Result<Finish, (u16, String)>> = None;
    let mut failed = None;
    let text_of = |t: u32| tok.decode(&[t]).unwrap_or_default();
    engine.reset();
    let opts = GenerateOptions {
        max_new_tokens: job.max_tokens,
        stop_tokens: &eos,
        context_shift: false,
        logits: job.logprobs.is_some(),
    };
    let generation = generate(engine, &mut sampler, &job.prompt, &opts, |id, logits| {
        let now = Instant::now();
        first.get_or_insert(now);
        last = now;
        let logprob = match (job.logprobs, logits) {
            (Some(top), Some(l)) => {
                let (lp, best) = logprobs(l, id, top);
                Some(TokenLogprob {
                    token: text_of(id),
                    logprob: lp,
                    top: best.into_iter().map(|(t, p)| (text_of(t), p)).collect(),
                })
            }
            _ => None,
        };
        let piece = match decoder.push(id) {
            Ok(p) => p.unwrap_or_default(),
            Err(e) => {
                failed = Some(e);
                return ControlFlow::Break(());
            }
        };
        let (text, stopped) = match stops.push(&piece) {
            Release::Text(t) => (t, false),
            Release::Stopped(t) => (t, true),
        };
        if (!text.is_empty() || logprob.is_some())
            && job.events.send(Event::Text { text, logprob }).is_err()
        {
            return ControlFlow::Break(()); // the client left
        }
        if stopped {
            ended = Some(Ok(Finish::Stop));
            return ControlFlow::Break(());
        }
        if job.events.is_closed() {
            return ControlFlow::Break(());
        }
        if shared.cancel.load(Ordering::SeqCst) {
            ended = Some(Err((
                503,
                "the server shut down before the answer ended".into(),
            )));
            return ControlFlow::Break(());
        }
        if Instant::now() >= job.deadline {
            ended = Some(Err((
                504,
                "the request ran past its time limit (--timeout)".into(),
            )));
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    let finish = match (ended, generation.stop) {
        (Some(Err((status, message))), _) => return Ok(Some(Event::Failed { status, message })),
        (Some(Ok(f)), _) => f,
        (None, StopReason::Callback) => return Ok(None), // the client left
        (None, StopReason::StopToken(_)) => Finish::Stop,
        (None, StopReason::MaxTokens | StopReason::ContextFull) => Finish::Length,
    };
    if finish == Finish::Length || matches!(generation.stop, StopReason::StopToken(_)) {
        // The text the decoder and the stop matcher still hold ends the answer.
        let mut rest = decoder.flush()?.unwrap_or_default();
        rest = match stops.push(&rest) {
            Release::Text(t) => t + &stops.finish(),
            Release::Stopped(t) => t,
        };
        if !rest.is_empty() {
            let _ = job.events.send(Event::Text {
                text: rest,
                logprob: None,
            });
        }
    }
    let first_token_s = first.map_or(0.0, |f| (f - t0).as_secs_f64());
    Ok(Some(Event::Done {
        finish,
        prompt_tokens: job.prompt.len(),
        completion_tokens: generation.tokens.len(),
        decode_s: first.map_or(0.0, |f| (last - f).as_secs_f64()),
        first_token_s,
    }))
}
