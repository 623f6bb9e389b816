//! What of the generated text a client is sent: stop strings matched across token boundaries,
//! and the log-probabilities OpenAI's `logprobs` report.

/// Holds back text that may be the start of a stop string until the next piece settles it.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received and not yet released.
    pending: String,
}

/// What [`StopMatcher::push`] releases.
#[derive(Debug, PartialEq)]
pub enum Release {
    /// Text to send; more may follow.
    Text(String),
    /// A stop string was found: the text before it, and nothing after.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds `piece`; releases the text that can no longer be part of a stop string.
    pub fn push(&mut self, piece: &str) -> Release {
        self.pending.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Release::Stopped(text);
        }
        // The longest suffix of the pending text that begins some stop string stays held.
        let held = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len().min(self.pending.len() + 1))
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.pending.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - held;
        Release::Text(self.pending.drain(..cut).collect())
    }

    /// The end of the answer: everything still held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// `log softmax(logits)[token]` and the `top` most likely tokens with theirs, most likely first
/// (ties by the lower id), in f64 from the logits the token was sampled from.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> (f64, Vec<(u32, f64)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f64::NEG_INFINITY, |&l| l as f64 - lse)
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() || (best.len() == top && l <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    (
        lp(token),
        best.into_iter().map(|(t, _)| (t, lp(t))).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                Release::Text(t) => out.push_str(&t),
                Release::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_match_across_pieces_and_release_what_cannot_match() {
        assert_eq!(run(&["END"], &["a", "bE", "N", "Dzz"]), ("ab".into(), true));
        assert_eq!(
            run(&["END"], &["a", "bE", "N", "x"]),
            ("abENx".into(), false)
        );
        assert_eq!(
            run(&["\n\n", "."], &["Hi", "!\n", "\nmore"]),
            ("Hi!".into(), true)
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        // The earliest stop wins whichever is listed first.
        assert_eq!(run(&["c", "b"], &["abc"]), ("a".into(), true));
    }

    #[test]
    fn held_text_is_released_as_soon_as_it_cannot_be_a_stop() {
        let mut m = StopMatcher::new(&["abc".to_string()]);
        assert_eq!(m.push("xa"), Release::Text("x".into()));
        assert_eq!(m.push("b"), Release::Text("".into()));
        assert_eq!(m.push("d"), Release::Text("abd".into()));
    }

    /// Every split of a text into pieces gives the same answer as the whole text at once.
    #[test]
    fn the_answer_does_not_depend_on_how_the_text_is_split() {
        let text = "one two. three\n\nfour END five";
        for stops in [vec!["END"], vec!["\n\n"], vec!["o t", "ee"], vec!["zzz"]] {
            let whole = run(&stops, &[text]);
            for cut1 in 0..text.len() {
                for cut2 in cut1..text.len() {
                    let pieces = [&text[..cut1], &text[cut1..cut2], &text[cut2..]];
                    assert_eq!(run(&stops, &pieces), whole, "{stops:?} {pieces:?}");
                }
            }
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let (lp, top) = logprobs(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((lp - (2f64.exp() / z).ln()).abs() < 1e-12);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2]);
        assert!((top[0].1 - (3f64.exp() / z).ln()).abs() < 1e-12);
        assert!(logprobs(&logits, 0, 0).1.is_empty());
        assert_eq!(logprobs(&logits, 0, 10).1.len(), 4);
    }
}
