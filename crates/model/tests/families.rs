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
use entrollm_model::{build_model, Engine, HostTensor, TensorSource};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Largest |Δ logit| between the engine and transformers, both in f32 (summation order only).
const F32_TOL: f32 = 5e-4;
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

/// The F32 GGUF llama.cpp's converter made, against `golden` (a family whose GGUF llama.cpp reads
/// differently from the HF config has its own file of transformers' logits); the Q8_0 one, served
/// as its blocks, against the same file with every matrix widened to f32 (the engine's products
/// of a quantised file are those of its dequantised weights: experts picked alike, every logit
/// within the f32 tolerance).
fn gguf(family: &str, golden_file: &str) {
    let d = dir(family);
    let golden = golden(&d.join(golden_file));
    let open =
        |file: &str| GgufSource::open(d.join(file)).unwrap_or_else(|e| panic!("{family}: {e}"));
    gguf_file(family, "model.f32.gguf", golden_file);
    let q8 = open("model.q8_0.gguf");
    let mut engine = Engine::new(build_model(&q8).unwrap(), 64).unwrap();
    let mut widened = Engine::new(build_model(&Widened(&q8)).unwrap(), 64).unwrap();
    let mut worst = 0f32;
    for case in &golden.cases {
        let mut tokens = case.prompt_ids.clone();
        tokens.extend(&case.generated_ids);
        engine.reset();
        widened.reset();
        let (a, b) = (
            engine.logits_for_all(&tokens).unwrap(),
            widened.logits_for_all(&tokens).unwrap(),
        );
        for (a, b) in a.iter().flatten().zip(b.iter().flatten()) {
            worst = worst.max((a - b).abs());
        }
    }
    println!("{family} model.q8_0.gguf: max |Δ logit| {worst:.2e} against its weights in f32");
    assert!(worst <= F32_TOL, "{family} Q8_0: {worst} > {F32_TOL}");
}

/// One GGUF file of `family` against `golden_file`, every logit within the f32 tolerance.
fn gguf_file(family: &str, file: &str, golden_file: &str) {
    let d = dir(family);
    let source = GgufSource::open(d.join(file)).unwrap_or_else(|e| panic!("{family}: {e}"));
    check(
        &format!("{family} {file}"),
        &source,
        &golden(&d.join(golden_file)),
        F32_TOL,
    );
}

/// A source whose matrices are handed out as f32 (a quantised file's dequantised weights).
struct Widened<'a>(&'a dyn TensorSource);

impl TensorSource for Widened<'_> {
    fn config(&self) -> entrollm_model::Result<entrollm_model::ModelConfig> {
        self.0.config()
    }
    fn norms_hold_the_one(&self) -> bool {
        self.0.norms_hold_the_one()
    }
    fn tensor(&self, name: &str) -> entrollm_model::Result<Option<HostTensor>> {
        Ok(match self.0.tensor(name)? {
            Some(HostTensor::Linear(m)) => {
                let (rows, cols) = (m.rows(), m.cols());
                let mut data = vec![0f32; rows * cols];
                for (r, row) in data.chunks_exact_mut(cols).enumerate() {
                    m.row(r, row);
                }
                Some(HostTensor::F32 {
                    shape: vec![rows, cols],
                    data,
                })
            }
            other => other,
        })
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

/// Mixtral: 4 experts, 2 a token, renormalised; llama.cpp writes it as `llama` with experts
/// (Q/K rows permuted, every layer's experts stacked in one tensor each).
#[test]
fn mixtral() {
    hf("mixtral", F32_TOL);
    gguf("mixtral", "golden.json");
}

/// Qwen3-MoE: q/k norms and 4 experts, 2 a token (`norm_topk_prob`).
#[test]
fn qwen3_moe() {
    hf("qwen3_moe", F32_TOL);
    gguf("qwen3_moe", "golden.json");
}

/// gpt-oss: attention sinks, q/k/v/o biases, YaRN RoPE (`truncate: false`), sliding and full
/// layers alternating (window 4), 4 experts fused and interleaved in HF (2 a token: top-k of the
/// router's logits, then their softmax) with biases and the clamped SwiGLU. llama.cpp floors and
/// ceils YaRN's correction range whatever the config says: the GGUFs are checked against
/// transformers with `truncate: true` (golden_gguf.json). `gpt_oss-mxfp4` is the same model with
/// its experts in OpenAI's MXFP4 (`_blocks`/`_scales`), against transformers' dequantised reading
/// of it, and llama.cpp's GGUF of it (MXFP4 experts).
#[test]
fn gpt_oss() {
    hf("gpt_oss", F32_TOL);
    gguf("gpt_oss", "golden_gguf.json");
    hf("gpt_oss-mxfp4", F32_TOL);
    gguf_file("gpt_oss-mxfp4", "model.mxfp4.gguf", "golden_gguf.json");
}

/// The HF config's YaRN (`truncate: false`) and llama.cpp's reading of the GGUF (truncated) give
/// logits over the same prompts that differ by more than the tolerance: each file is checked
/// against its own golden for a reason.
#[test]
fn gpt_oss_yarn_truncation_matters() {
    let d = dir("gpt_oss");
    let (hf, gguf) = (
        golden(&d.join("golden.json")),
        golden(&d.join("golden_gguf.json")),
    );
    let mut worst = 0f32;
    for (a, b) in hf.cases.iter().zip(&gguf.cases) {
        assert_eq!(a.prompt_ids, b.prompt_ids);
        let n = a.prompt_ids.len();
        for (a, b) in a.logits[..n]
            .iter()
            .flatten()
            .zip(b.logits[..n].iter().flatten())
        {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst > 2.0 * F32_TOL, "{worst}");
}

/// A source that serves `inner`'s tensors with one of them replaced (`None`: removed).
struct Edited<'a> {
    inner: &'a dyn TensorSource,
    name: &'a str,
    with: Option<fn(HostTensor) -> HostTensor>,
}

impl TensorSource for Edited<'_> {
    fn config(&self) -> entrollm_model::Result<entrollm_model::ModelConfig> {
        self.inner.config()
    }
    fn tensor(&self, name: &str) -> entrollm_model::Result<Option<HostTensor>> {
        let t = self.inner.tensor(name)?;
        Ok(match name == self.name {
            true => t.and_then(|t| self.with.map(|f| f(t))),
            false => t,
        })
    }
}

/// gpt-oss's fused experts of the wrong shape, or without their down projection or biases, are
/// errors naming the tensor.
#[test]
fn gpt_oss_fused_experts_that_do_not_fit_are_errors_naming_them() {
    for family in ["gpt_oss", "gpt_oss-mxfp4"] {
        let source = SafetensorsSource::open(&dir(family)).unwrap();
        let error = |name: &str, with: Option<fn(HostTensor) -> HostTensor>| {
            let edited = Edited {
                inner: &source,
                name,
                with,
            };
            match build_model(&edited) {
                Ok(_) => panic!("{family}: {name} edited, and the model built"),
                Err(e) => e.to_string(),
            }
        };
        let gu = "model.layers.1.mlp.experts.gate_up_proj";
        let shrunk: fn(HostTensor) -> HostTensor = |t| match t {
            HostTensor::F32 { shape, data } => HostTensor::F32 {
                shape: vec![shape[0], shape[1], shape[2] - 2],
                data: data[..shape[0] * shape[1] * (shape[2] - 2)].to_vec(),
            },
            HostTensor::Linear(m) => {
                let (rows, cols) = (m.rows() - 2, m.cols());
                let mut data = vec![0f32; rows * cols];
                for (r, row) in data.chunks_exact_mut(cols).enumerate() {
                    m.row(r, row);
                }
                HostTensor::F32 {
                    shape: vec![rows, cols],
                    data,
                }
            }
            other => other,
        };
        let e = error(gu, Some(shrunk));
        assert!(e.contains(gu) && e.contains("shape"), "{family}: {e}");
        for missing in [
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.experts.down_proj_bias",
            "model.layers.0.mlp.experts.gate_up_proj_bias",
            "model.layers.0.mlp.router.bias",
            "model.layers.1.self_attn.sinks",
        ] {
            let e = error(missing, None);
            assert!(
                e.contains(missing) && e.contains("missing"),
                "{family}: {e}"
            );
        }
    }
}
