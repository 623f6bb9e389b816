//! Every model family the engine runs, against Hugging Face transformers.
//!
//! `tools/gen_family_models.py` made each family's tiny model with transformers itself (the real
//! config and model classes, dimensions shrunk, the family's features on: sliding windows,
//! soft-capping, q/k norms, sandwich norms, fused tensors, partial rotary), saved it as
//! safetensors, converted it to GGUF with llama.cpp's own `convert_hf_to_gguf.py` (F32 and Q8_0)
//! and recorded transformers' logits at every position of two prompts and their greedy
//! continuations (`golden.json`). The CPU engine must give those logits from every file, and the
//! same greedy tokens. No torch here: the data is checked in.

use entrollm_model::gguf::GgufSource;
use entrollm_model::load::SafetensorsSource;
use entrollm_model::sampler::argmax;
use entrollm_model::{build_model, Engine, TensorSource};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Largest |Δ logit| between the engine and transformers, both in f32 (summation order only).
const F32_TOL: f32 = 5e-4;
/// The same for a Q8_0 GGUF against transformers' f32 logits (the weights' rounding).
const Q8_TOL: f32 = 0.5;
/// A BF16 checkpoint: transformers computes in BF16 and rounds every activation, the engine in
/// f32 over the same weights.
const BF16_TOL: f32 = 0.15;

#[derive(Deserialize)]
struct Golden {
    family: String,
    transformers_version: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    /// Per position of `prompt_ids ++ generated_ids[..-1]`.
    logits: Vec<Vec<f32>>,
}

fn dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/families")
        .join(family)
}

fn golden(path: &Path) -> Golden {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}. Make it with tools/gen_family_models.py (needs torch, transformers and \
             llama.cpp's converter)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `source` on every case of `golden`: the logits of every position within `tol` of
/// transformers', and the greedy token of every generating position transformers' own wherever
/// transformers' top two are further apart than the tolerance allows to swap.
fn check(what: &str, source: &dyn TensorSource, golden: &Golden, tol: f32) {
    let weights = build_model(source).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut engine = Engine::new(weights, 64).unwrap();
    let mut worst = 0f32;
    for case in &golden.cases {
        engine.reset();
        let mut tokens = case.prompt_ids.clone();
        tokens.extend(&case.generated_ids[..case.generated_ids.len() - 1]);
        let ours = engine.logits_for_all(&tokens).unwrap();
        assert_eq!(ours.len(), case.logits.len(), "{what} {}", case.name);
        for (pos, (ours, theirs)) in ours.iter().zip(&case.logits).enumerate() {
            let diff = ours
                .iter()
                .zip(theirs)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.max(diff);
            assert!(
                diff <= tol,
                "{what} {} position {pos}: max |Δ logit| {diff} > {tol}",
                case.name
            );
            let gen = pos + 1 - case.prompt_ids.len().min(pos + 1);
            if pos + 1 >= case.prompt_ids.len() {
                let expected = case.generated_ids[gen];
                let mut sorted = theirs.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let pick = argmax(ours).unwrap();
                assert!(
                    pick == expected || sorted[0] - sorted[1] <= 2.0 * tol,
                    "{what} {} step {gen}: engine picks {pick}, transformers {expected}",
                    case.name
                );
            }
        }
    }
    println!(
        "{what}: max |Δ logit| {worst:.2e} against transformers {} ({})",
        golden.transformers_version, golden.family
    );
}

fn hf(family: &str, tol: f32) {
    let d = dir(family);
    let source = SafetensorsSource::open(&d).unwrap_or_else(|e| panic!("{family}: {e}"));
    check(
        &format!("{family} safetensors"),
        &source,
        &golden(&d.join("golden.json")),
        tol,
    );
}

/// The F32 and Q8_0 GGUFs llama.cpp's converter made, against `golden` (a family whose GGUF
/// llama.cpp reads differently from the HF config has its own file of transformers' logits).
fn gguf(family: &str, golden_file: &str) {
    let d = dir(family);
    let golden = golden(&d.join(golden_file));
    for (file, tol) in [("model.f32.gguf", F32_TOL), ("model.q8_0.gguf", Q8_TOL)] {
        let source = GgufSource::open(d.join(file)).unwrap_or_else(|e| panic!("{family}: {e}"));
        check(&format!("{family} {file}"), &source, &golden, tol);
    }
}

#[test]
fn qwen3() {
    hf("qwen3", F32_TOL);
    hf("qwen3-bf16", BF16_TOL);
    gguf("qwen3", "golden.json");
}

#[test]
fn gemma2() {
    hf("gemma2", F32_TOL);
    gguf("gemma2", "golden.json");
}

#[test]
fn gemma3() {
    hf("gemma3", F32_TOL);
    hf("gemma3-bf16", BF16_TOL);
    gguf("gemma3", "golden.json");
}

#[test]
fn phi3() {
    hf("phi3", F32_TOL);
    gguf("phi3", "golden.json");
}

/// The HF config slides every layer's attention over 4 positions; llama.cpp's converter writes
/// Mistral as `llama` without a window, and llama.cpp attends over the whole context: the GGUFs
/// are checked against transformers with the window off.
#[test]
fn mistral() {
    hf("mistral", F32_TOL);
    gguf("mistral", "golden_no_swa.json");
}
