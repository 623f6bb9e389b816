//! `GET /metrics`: counters in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds of the time-to-first-token histogram, seconds.
const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Default)]
struct Counts {
    /// (endpoint, status) → requests.
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    completion_tokens: u64,
    decode_seconds: f64,
    ttft: [u64; TTFT_BUCKETS.len()],
    ttft_count: u64,
    ttft_sum: f64,
    last_tok_s: f64,
}

#[derive(Default)]
pub struct Metrics(Mutex<Counts>);

impl Metrics {
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *self.lock().requests.entry((endpoint, status)).or_default() += 1;
    }

    /// A finished answer: its token counts, time to first token (from arrival, queue included)
    /// and decode time.
    pub fn answer(&self, prompt: usize, completion: usize, ttft_s: f64, decode_s: f64) {
        let mut c = self.lock();
        c.prompt_tokens += prompt as u64;
        c.completion_tokens += completion as u64;
        c.decode_seconds += decode_s;
        for (n, &b) in c.ttft.iter_mut().zip(&TTFT_BUCKETS) {
            if ttft_s <= b {
                *n += 1;
            }
        }
        c.ttft_count += 1;
        c.ttft_sum += ttft_s;
        if completion > 1 && decode_s > 0.0 {
            c.last_tok_s = (completion - 1) as f64 / decode_s;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The text `GET /metrics` answers; `waiting`/`running`: the queue now.
    pub fn render(&self, waiting: usize, running: bool) -> String {
        let c = self.lock();
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(
                s,
                "# HELP entrollm_{name} {help}\n# TYPE entrollm_{name} {kind}"
            );
        };
        metric(
            "requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
        );
        for ((e, code), n) in &c.requests {
            let _ = writeln!(
                s,
                "entrollm_requests_total{{endpoint=\"{e}\",code=\"{code}\"}} {n}"
            );
        }
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                s,
                "# HELP entrollm_{name} {help}\n# TYPE entrollm_{name} {kind}\nentrollm_{name} {v}"
            );
        };
        one(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished answers.",
            c.prompt_tokens.to_string(),
        );
        one(
            "completion_tokens_total",
            "counter",
            "Tokens generated in finished answers.",
            c.completion_tokens.to_string(),
        );
        one(
            "decode_seconds_total",
            "counter",
            "Time from first to last token of finished answers.",
            format!("{:.6}", c.decode_seconds),
        );
        one(
            "decode_tokens_per_second",
            "gauge",
            "Decode speed of the last answer of more than one token.",
            format!("{:.3}", c.last_tok_s),
        );
        one(
            "queue_depth",
            "gauge",
            "Requests waiting for the engine.",
            waiting.to_string(),
        );
        one(
            "requests_running",
            "gauge",
            "Requests the engine is answering.",
            (running as u8).to_string(),
        );
        let _ = writeln!(
            s,
            "# HELP entrollm_time_to_first_token_seconds From a request's arrival to its first token.\n\
             # TYPE entrollm_time_to_first_token_seconds histogram"
        );
        for (n, b) in c.ttft.iter().zip(TTFT_BUCKETS) {
            let _ = writeln!(
                s,
                "entrollm_time_to_first_token_seconds_bucket{{le=\"{b}\"}} {n}"
            );
        }
        let _ = writeln!(
            s,
            "entrollm_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {0}\n\
             entrollm_time_to_first_token_seconds_sum {1:.6}\n\
             entrollm_time_to_first_token_seconds_count {0}",
            c.ttft_count, c.ttft_sum
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_in_prometheus_text() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("completions", 400);
        m.answer(10, 5, 0.2, 0.4);
        let s = m.render(3, true);
        for line in [
            "entrollm_requests_total{endpoint=\"chat\",code=\"200\"} 2",
            "entrollm_requests_total{endpoint=\"completions\",code=\"400\"} 1",
            "entrollm_prompt_tokens_total 10",
            "entrollm_completion_tokens_total 5",
            "entrollm_decode_tokens_per_second 10.000",
            "entrollm_queue_depth 3",
            "entrollm_requests_running 1",
            "entrollm_time_to_first_token_seconds_bucket{le=\"0.1\"} 0",
            "entrollm_time_to_first_token_seconds_bucket{le=\"0.25\"} 1",
            "entrollm_time_to_first_token_seconds_count 1",
        ] {
            assert!(s.lines().any(|l| l == line), "{line} not in\n{s}");
        }
        // Every sample line is `name{labels} value` or `name value`.
        for l in s.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok(), "{l}");
        }
    }
}
