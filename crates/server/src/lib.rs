//! `entrollm serve`: an OpenAI-compatible HTTP server over one engine (docs/server.md).
//!
//! The HTTP side (axum on tokio) reads and checks requests ([`api`]), tokenizes them, and queues
//! them FIFO for the engine thread ([`worker`]), which streams tokens back. A full queue is a 503
//! at once; a client that leaves frees the engine at its next token; SIGINT/SIGTERM stop taking
//! requests, let the running answer finish for a grace period, then end it.

pub mod api;
pub mod metrics;
pub mod text;
pub mod worker;

use api::{ApiError, Prompt, Request};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::sampler::SamplingParams;
use entrollm_model::tokenizer::Tokenizer;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use worker::{Event, Job, Shared, TokenLogprob};

/// The largest request body, bytes: a context's worth of text many times over.
pub const MAX_BODY: usize = 4 << 20;
/// How long a client may take to send its headers, and its body.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more are closed as they arrive.
pub const MAX_CONNECTIONS: usize = 1024;
/// After SIGINT/SIGTERM, how long the running answer may go on before it is ended.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How the server listens and queues.
#[derive(Clone, Debug)]
pub struct Options {
    pub host: String,
    pub port: u16,
    /// Requests must send `Authorization: Bearer KEY` (all but `/`, `/health`).
    pub api_key: Option<String>,
    /// Requests waiting beyond the one the engine runs; one more is a 503.
    pub max_queue: usize,
    /// A request's limit from arrival to its last token.
    pub timeout: Duration,
}

/// What `GET /v1/models` and the chat page say of the model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The model's name in the API (`model` of every answer).
    pub id: String,
    /// Context length, tokens (a prompt and its answer together).
    pub context: usize,
    /// Shown as is: size, coding, device.
    pub meta: Value,
    /// Sampling when a request names none of a field (the command line's).
    pub defaults: SamplingParams,
    /// Tokens an answer may have when the request names none (`None`: up to the context).
    pub default_max_tokens: Option<usize>,
}

/// A loaded model: the engine (run on the engine thread only) and what the HTTP side needs.
pub struct Loaded {
    pub engine: worker::Engine,
    pub tokenizer: Tokenizer,
    pub info: ModelInfo,
}

struct Model {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    info: ModelInfo,
    created: u64,
}

struct App {
    opts: Options,
    model: OnceLock<Model>,
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
    metrics: metrics::Metrics,
    ids: AtomicU64,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn error(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.body())).into_response();
    if e.status == 401 {
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if e.status == 503 || e.status == 429 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The endpoints a request may reach (metrics' label).
fn endpoint(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        "/" => "page",
        _ => "other",
    }
}

/// Counts every answer; checks the API key where one is set.
async fn gate(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_string();
    let open = path == "/" || path == "/health";
    let r = match (&app.opts.api_key, open) {
        (Some(key), false) if !authorized(req.headers(), key) => error(
            &ApiError::new(
                401,
                "authentication_error",
                "a missing or wrong API key: send `Authorization: Bearer KEY` with the server's \
                 --api-key",
            )
            .with_code("invalid_api_key"),
        ),
        _ => next.run(req).await,
    };
    app.metrics.request(endpoint(&path), r.status().as_u16());
    r
}

fn authorized(h: &HeaderMap, key: &str) -> bool {
    use subtle::ConstantTimeEq;
    let Some(given) = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    given.trim().as_bytes().ct_eq(key.as_bytes()).into()
}

/// The body, at most [`MAX_BODY`] bytes, within [`BODY_TIMEOUT`].
async fn body(req: axum::extract::Request) -> Result<Vec<u8>, ApiError> {
    let too_big = || {
        ApiError::new(
            413,
            "invalid_request_error",
            format!("the request body is larger than {} MiB", MAX_BODY >> 20),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_big());
    }
    let read = async {
        let mut stream = req.into_body().into_data_stream();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::new(
                    400,
                    "invalid_request_error",
                    format!("reading the body: {e}"),
                )
            })?;
            if out.len() + chunk.len() > MAX_BODY {
                return Err(too_big());
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    };
    tokio::time::timeout(BODY_TIMEOUT, read)
        .await
        .map_err(|_| {
            ApiError::new(
                408,
                "invalid_request_error",
                format!(
                    "the request body took longer than {} s",
                    BODY_TIMEOUT.as_secs()
                ),
            )
        })?
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// The prompt's tokens, checked against the context.
fn tokens(m: &Model, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let ids = match prompt {
        Prompt::Chat(messages) => {
            let messages: Vec<ChatMessage> = messages
                .iter()
                .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                .collect();
            let text = m.template.render(&messages, true).map_err(|e| {
                ApiError::invalid("messages", format!("the model's chat template: {e}"))
            })?;
            m.tokenizer.encode(&text, false)
        }
        Prompt::Text(t) => m.tokenizer.encode(t, true),
        Prompt::Tokens(t) => {
            let vocab = m.tokenizer.vocab_size();
            if let Some(bad) = t.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is not in the vocabulary of {vocab}"),
                ));
            }
            Ok(t.clone())
        }
    }
    .map_err(|e| ApiError::new(500, "server_error", format!("tokenizing the prompt: {e}")))?;
    let param = match prompt {
        Prompt::Chat(_) => "messages",
        _ => "prompt",
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    let ctx = m.info.context;
    if ids.len() >= ctx {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is {} tokens; this server's context is {ctx} (a prompt and its answer \
                 together): shorten it, or start the server with a larger --ctx-size",
                ids.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(ids)
}

fn params(defaults: &SamplingParams, r: &Request, app: &App) -> Result<SamplingParams, ApiError> {
    let p = SamplingParams {
        temperature: r.temperature.unwrap_or(defaults.temperature),
        top_k: r.top_k.unwrap_or(defaults.top_k),
        top_p: r.top_p.unwrap_or(defaults.top_p),
        min_p: r.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: r.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        // Unseeded requests differ from each other, as OpenAI's do.
        seed: r.seed.unwrap_or_else(|| {
            let n = app.ids.fetch_add(1, Ordering::Relaxed);
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ entrollm_codec::rng::splitmix64(n)
        }),
    };
    p.validate()
        .map_err(|e| ApiError::new(400, "invalid_request_error", e.to_string()))?;
    Ok(p)
}

/// Queues `job`: a 503 at once when [`Options::max_queue`] requests already wait, or the server
/// is shutting down.
fn enqueue(app: &App, job: Job) -> Result<(), ApiError> {
    let busy = || {
        ApiError::new(
            503,
            "server_error",
            format!(
                "the server is busy: {} requests are waiting (--max-queue); retry shortly",
                app.opts.max_queue
            ),
        )
        .with_code("server_busy")
    };
    if app.shared.shutdown.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "server_error",
            "the server is shutting down",
        ));
    }
    let max = app.opts.max_queue;
    app.shared
        .waiting
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            (w < max).then_some(w + 1)
        })
        .map_err(|_| busy())?;
    let sent = app
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|tx| tx.send(job).is_ok());
    if sent != Some(true) {
        app.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::new(
            503,
            "server_error",
            "the engine is not running",
        ));
    }
    Ok(())
}

fn logprob_value(lp: f64) -> f64 {
    // JSON has no -inf; OpenAI reports tokens that cannot be drawn as -9999.
    lp.max(-9999.0)
}

fn chat_logprob(l: &TokenLogprob) -> Value {
    let entry =
        |t: &str, lp: f64| json!({"token": t, "logprob": logprob_value(lp), "bytes": t.as_bytes()});
    let mut e = entry(&l.token, l.logprob);
    e["top_logprobs"] = l.top.iter().map(|(t, lp)| entry(t, *lp)).collect();
    e
}

/// The legacy completions' `logprobs` object for `items` (token and its offset in the text).
fn completion_logprobs(items: &[(usize, TokenLogprob)]) -> Value {
    json!({
        "tokens": items.iter().map(|(_, l)| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": items.iter().map(|(_, l)| logprob_value(l.logprob)).collect::<Vec<_>>(),
        "top_logprobs": items.iter().map(|(_, l)| {
            l.top.iter().map(|(t, lp)| (t.clone(), json!(logprob_value(*lp)))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": items.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
    })
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// `POST /v1/chat/completions` and `/v1/completions`.
async fn complete(app: Arc<App>, kind: Kind, req: axum::extract::Request) -> Response {
    match answer(app, kind, req).await {
        Ok(r) => r,
        Err(e) => error(&e),
    }
}

async fn answer(
    app: Arc<App>,
    kind: Kind,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let bytes = body(req).await?;
    let r = match kind {
        Kind::Chat => api::chat_request(&bytes)?,
        Kind::Completion => api::completion_request(&bytes)?,
    };
    let Some(m) = app.model.get() else {
        return Err(ApiError::new(
            503,
            "server_error",
            "the model is still loading",
        ));
    };
    let prompt = tokens(m, &r.prompt)?;
    let room = m.info.context - prompt.len();
    let max_tokens = r
        .max_tokens
        .or(m.info.default_max_tokens)
        .map_or(room, |n| n.min(room));
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        prompt,
        params: params(&m.info.defaults, &r, &app)?,
        max_tokens,
        stop: r.stop.clone(),
        logprobs: r.logprobs,
        deadline: arrived + app.opts.timeout,
        events: tx,
    };
    enqueue(&app, job)?;
    // Wait for the engine to take it: a failure before the answer starts is a status code.
    match rx.recv().await {
        Some(Event::Started) => {}
        Some(Event::Failed { status, message }) => {
            return Err(ApiError::new(status, "server_error", message))
        }
        _ => return Err(ApiError::new(500, "server_error", "the engine stopped")),
    }
    let id = format!(
        "{}-{:x}{:04x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        now_s(),
        app.ids.fetch_add(1, Ordering::Relaxed) & 0xffff
    );
    let ans = Answer {
        app: app.clone(),
        kind,
        id,
        created: now_s(),
        model: m.info.id.clone(),
        arrived,
    };
    Ok(match r.stream {
        true => ans.stream(rx, r.include_usage).into_response(),
        false => ans.whole(rx).await?,
    })
}

struct Answer {
    app: Arc<App>,
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    arrived: Instant,
}

impl Answer {
    fn record(&self, prompt: usize, completion: usize, first_s: f64, decode_s: f64) {
        let queued = self.arrived.elapsed().as_secs_f64() - first_s - decode_s;
        self.app
            .metrics
            .answer(prompt, completion, queued.max(0.0) + first_s, decode_s);
    }

    async fn whole(self, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut lps: Vec<(usize, TokenLogprob)> = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Started => {}
                Event::Text { text: t, logprob } => {
                    if let Some(l) = logprob {
                        lps.push((text.len(), l));
                    }
                    text.push_str(&t);
                }
                Event::Failed { status, message } => {
                    return Err(ApiError::new(status, "server_error", message))
                }
                Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    decode_s,
                    first_token_s,
                } => {
                    self.record(prompt_tokens, completion_tokens, first_token_s, decode_s);
                    let u = usage(prompt_tokens, completion_tokens);
                    let body = match self.kind {
                        Kind::Chat => json!({
                            "id": self.id, "object": "chat.completion", "created": self.created,
                            "model": self.model,
                            "choices": [{
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "logprobs": (!lps.is_empty()).then(|| json!({
                                    "content": lps.iter().map(|(_, l)| chat_logprob(l)).collect::<Vec<_>>()
                                })),
                                "finish_reason": finish.as_str(),
                            }],
                            "usage": u,
                        }),
                        Kind::Completion => json!({
                            "id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model,
                            "choices": [{
                                "index": 0, "text": text,
                                "logprobs": (!lps.is_empty()).then(|| completion_logprobs(&lps)),
                                "finish_reason": finish.as_str(),
                            }],
                            "usage": u,
                        }),
                    };
                    return Ok(axum::Json(body).into_response());
                }
            }
        }
        Err(ApiError::new(
            500,
            "server_error",
            "the engine stopped mid-answer",
        ))
    }

    fn chunk(&self, choice: Value, include_usage: bool) -> SseEvent {
        let mut c = json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        SseEvent::default().data(c.to_string())
    }

    /// Server-sent events: a chunk a text piece, the finish reason, usage if asked, `[DONE]`.
    fn stream(
        self,
        rx: UnboundedReceiver<Event>,
        include_usage: bool,
    ) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
        let first = match self.kind {
            Kind::Chat => Some(self.chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
                include_usage,
            )),
            Kind::Completion => None,
        };
        let state = (self, rx, first, false, 0usize);
        let events = futures_util::stream::unfold(state, move |(ans, mut rx, mut pending, done, mut offset)| async move {
            if let Some(e) = pending.take() {
                return Some((vec![e], (ans, rx, None, done, offset)));
            }
            if done {
                return None;
            }
            loop {
                let (out, end) = match rx.recv().await {
                    None => (vec![SseEvent::default().data(
                        ApiError::new(500, "server_error", "the engine stopped mid-answer").body().to_string(),
                    )], true),
                    Some(Event::Started) => continue,
                    Some(Event::Text { text, logprob }) => {
                        let choice = match ans.kind {
                            Kind::Chat => json!({
                                "index": 0, "delta": {"content": text},
                                "logprobs": logprob.as_ref().map(|l| json!({"content": [chat_logprob(l)]})),
                                "finish_reason": null,
                            }),
                            Kind::Completion => json!({
                                "index": 0, "text": text,
                                "logprobs": logprob.map(|l| completion_logprobs(&[(offset, l)])),
                                "finish_reason": null,
                            }),
                        };
                        offset += text.len();
                        (vec![ans.chunk(choice, include_usage)], false)
                    }
                    // An error ends the stream (its status went out with the first chunk).
                    Some(Event::Failed { status, message }) => {
                        (vec![SseEvent::default().data(ApiError::new(status, "server_error", message).body().to_string())], true)
                    }
                    Some(Event::Done { finish, prompt_tokens, completion_tokens, decode_s, first_token_s }) => {
                        ans.record(prompt_tokens, completion_tokens, first_token_s, decode_s);
                        let end = match ans.kind {
                            Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.as_str()}),
                            Kind::Completion => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish.as_str()}),
                        };
                        let mut out = vec![ans.chunk(end, include_usage)];
                        if include_usage {
                            let u = json!({
                                "id": ans.id,
                                "object": if ans.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                                "created": ans.created, "model": ans.model, "choices": [],
                                "usage": usage(prompt_tokens, completion_tokens),
                            });
                            out.push(SseEvent::default().data(u.to_string()));
                        }
                        out.push(SseEvent::default().data("[DONE]"));
                        (out, true)
                    }
                };
                return Some((out, (ans, rx, None, end, offset)));
            }
        })
        .flat_map(|evs| futures_util::stream::iter(evs.into_iter().map(Ok)));
        Sse::new(events).keep_alive(KeepAlive::default())
    }
}

async fn chat(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    complete(app, Kind::Chat, req).await
}

async fn completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    complete(app, Kind::Completion, req).await
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let data: Vec<Value> = app
        .model
        .get()
        .map(|m| {
            json!({
                "id": m.info.id, "object": "model", "created": m.created, "owned_by": "entrollm",
                "context_length": m.info.context, "meta": m.info.meta,
            })
        })
        .into_iter()
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.model.get() {
        Some(_) => axum::Json(json!({"status": "ok"})).into_response(),
        None => error(&ApiError::new(
            503,
            "server_error",
            "the model is still loading",
        )),
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let s = app.shared.waiting.load(Ordering::SeqCst);
    let r = app.shared.running.load(Ordering::SeqCst);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(s, r),
    )
        .into_response()
}

/// The chat page: one file, no build step, nothing fetched from elsewhere.
const PAGE: &str = include_str!("page.html");

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

fn router(app: Arc<App>) -> Router {
    let not_found = |uri: axum::http::Uri| async move {
        error(&ApiError::new(
            404,
            "invalid_request_error",
            format!("no endpoint {}: see docs/server.md", uri.path()),
        ))
    };
    let not_allowed = |m: axum::http::Method, uri: axum::http::Uri| async move {
        error(&ApiError::new(
            405,
            "invalid_request_error",
            format!("{} is not an endpoint's method for {}", m, uri.path()),
        ))
    };
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(axum::middleware::from_fn_with_state(app.clone(), gate))
        .with_state(app)
}

/// Listens on `opts.host:opts.port` (at once, so a taken port fails before the model loads),
/// loads the model on the engine thread with `load`, and serves until SIGINT/SIGTERM; `ready`
/// is told the address once the model answers.
pub fn serve(
    opts: Options,
    load: impl FnOnce() -> anyhow::Result<Loaded> + Send + 'static,
    ready: impl FnOnce(SocketAddr, &ModelInfo) + Send + 'static,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(opts, load, ready))
}

async fn run(
    opts: Options,
    load: impl FnOnce() -> anyhow::Result<Loaded> + Send + 'static,
    ready: impl FnOnce(SocketAddr, &ModelInfo) + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {}:{}: {e} (--host, --port; port 0 takes a free one)",
                opts.host,
                opts.port
            )
        })?;
    let addr = listener.local_addr()?;
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let app = Arc::new(App {
        opts,
        model: OnceLock::new(),
        jobs: Mutex::new(Some(jobs_tx)),
        shared: Arc::new(Shared::default()),
        metrics: metrics::Metrics::default(),
        ids: AtomicU64::new(0),
    });
    let (loaded_tx, mut loaded_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    let engine = {
        let app = app.clone();
        // The engine's body runs on the global pool, as `run`'s does: the CPU engine's crew of
        // awake workers shares out each step's products only for steps stepped on the pool.
        let body = move || {
            let l = match load() {
                Ok(l) => l,
                Err(e) => {
                    let _ = loaded_tx.send(Err(e));
                    return;
                }
            };
            let template = match ChatTemplate::for_tokenizer(&l.tokenizer) {
                Ok(t) => t,
                Err(e) => {
                    let _ = loaded_tx.send(Err(e.into()));
                    return;
                }
            };
            let tokenizer = Arc::new(l.tokenizer);
            ready(addr, &l.info);
            let _ = app.model.set(Model {
                tokenizer: tokenizer.clone(),
                template,
                info: l.info,
                created: now_s(),
            });
            let _ = loaded_tx.send(Ok(()));
            worker::serve(l.engine, tokenizer, jobs_rx, app.shared.clone());
        };
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || rayon::scope(|_| body()))?
    };
    let service = hyper_util::service::TowerToHyperService::new(router(app.clone()));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut load_pending = true;
    let result = loop {
        tokio::select! {
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else { continue };
                let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
                let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service.clone());
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(slot);
                });
            }
            loaded = &mut loaded_rx, if load_pending => {
                load_pending = false;
                match loaded {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => break Err(e),
                    Err(_) => break Err(anyhow::anyhow!("the engine thread ended while loading")),
                }
            }
            _ = tokio::signal::ctrl_c() => break Ok("SIGINT"),
            _ = term.recv() => break Ok("SIGTERM"),
        }
    };
    drop(listener);
    let sig = match result {
        Ok(sig) => sig,
        Err(e) => return Err(e),
    };
    eprintln!(
        "{sig}: no new requests; the running answer has {} s to finish",
        SHUTDOWN_GRACE.as_secs()
    );
    app.shared.shutdown.store(true, Ordering::SeqCst);
    let grace = Instant::now() + SHUTDOWN_GRACE;
    while Instant::now() < grace
        && (app.shared.running.load(Ordering::SeqCst)
            || app.shared.waiting.load(Ordering::SeqCst) > 0)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.shared.cancel.store(true, Ordering::SeqCst);
    // The engine thread ends once the queue's sender is gone and the running job ends.
    app.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    if app.model.get().is_some() {
        let _ = tokio::task::spawn_blocking(move || engine.join()).await;
    }
    Ok(())
}
