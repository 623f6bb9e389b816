//! Fuzzes the API's request parsers (`entrollm_server::api`) and the stop-string matcher on the
//! input: a body for each endpoint, and the same bytes as generated text pieces against stop
//! strings. Must never panic; an accepted request's fields stay in their documented ranges.
//!
//! Run (from crates/server/fuzz; cargo-fuzz on a stable toolchain needs RUSTC_BOOTSTRAP):
//!   RUSTC_BOOTSTRAP=1 cargo fuzz run request_parser -- -dict=request_parser.dict -max_len=4096
#![no_main]

use entrollm_server::api::{chat_request, completion_request, Request, MAX_STOPS, MAX_TOP_LOGPROBS};
use entrollm_server::text::{Release, StopMatcher};
use libfuzzer_sys::fuzz_target;

fn check(r: &Request) {
    assert!(r.stop.len() <= MAX_STOPS && r.stop.iter().all(|s| !s.is_empty()));
    assert!(r.logprobs.is_none_or(|n| n <= MAX_TOP_LOGPROBS));
    assert!(r.max_tokens.is_none_or(|n| n >= 1));
    assert!(r.temperature.is_none_or(|t| (0.0..=100.0).contains(&t)));
    assert!(r.top_p.is_none_or(|p| p > 0.0 && p <= 1.0));
}

fuzz_target!(|data: &[u8]| {
    for r in [chat_request(data), completion_request(data)] {
        match r {
            Ok(r) => check(&r),
            Err(e) => assert!((400..500).contains(&e.status) && !e.message.is_empty()),
        }
    }
    // The text as pieces split at every 0xff byte, the stops taken from its first line.
    let text = String::from_utf8_lossy(data);
    let (head, body) = text.split_once('\n').unwrap_or(("", &text));
    let stops: Vec<String> = head.split('|').map(str::to_string).collect();
    let mut m = StopMatcher::new(&stops);
    let mut out = String::new();
    let mut stopped = false;
    for piece in body.split('\u{FFFD}') {
        match m.push(piece) {
            Release::Text(t) => out.push_str(&t),
            Release::Stopped(t) => {
                out.push_str(&t);
                stopped = true;
                break;
            }
        }
    }
    if !stopped {
        out.push_str(&m.finish());
        assert_eq!(out, body.replace('\u{FFFD}', ""));
    }
    // No stop string appears in what was released.
    assert!(!stops.iter().any(|s| !s.is_empty() && out.contains(s.as_str())));
});
