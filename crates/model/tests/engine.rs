//! The CPU engine against an independent naive forward pass (plain loops, f64) on small synthetic
//! models built from a seeded PRNG, plus cache, RoPE, GQA, perplexity, generation and error tests.

use entrollm_codec::rng::SplitMix64;
use entrollm_model::config::{Arch, ModelConfig, RopeScaling, RopeStyle};
use entrollm_model::engine::rope_inv_freq;
use entrollm_model::sampler::argmax;
use entrollm_model::{
    build_model, generate, perplexity, Engine, HostTensor, ModelError, Sampler, SamplingParams,
    StopReason, TensorSource,
};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// Synthetic models

/// The codec's SplitMix64 stream.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(SplitMix64::new(seed))
    }
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f64 {
        self.0.unit() * 2.0 - 1.0
    }
    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % vocab as u64) as u32)
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Storage {
    F32,
    Bf16,
    F16,
}

impl Storage {
    /// Rounds `v` to this storage's precision (so the reference sees the stored values).
    fn round(self, v: f32) -> f32 {
        match self {
            Storage::F32 => v,
            Storage::Bf16 => half::bf16::from_f32(v).to_f32(),
            Storage::F16 => half::f16::from_f32(v).to_f32(),
        }
    }
    fn host(self, shape: Vec<usize>, data: &[f32]) -> HostTensor {
        match self {
            Storage::F32 => HostTensor::F32 {
                shape,
                data: data.to_vec(),
            },
            Storage::Bf16 => HostTensor::Bf16 {
                shape,
                data: data
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect(),
            },
            Storage::F16 => HostTensor::F16 {
                shape,
                data: data
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect(),
            },
        }
    }
}

/// An in-memory checkpoint under HF names; every value is exactly representable in `storage`.
#[derive(Clone)]
struct Synthetic {
    config: ModelConfig,
    storage: Storage,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl TensorSource for Synthetic {
    fn config(&self) -> entrollm_model::Result<ModelConfig> {
        Ok(self.config.clone())
    }
    fn tensor(&self, name: &str) -> entrollm_model::Result<Option<HostTensor>> {
        Ok(self
            .tensors
            .get(name)
            .map(|(shape, data)| self.storage.host(shape.clone(), data)))
    }
}

fn tiny_config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 61,
        hidden_size: 32,
        intermediate_size: 44,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_style: RopeStyle::Neox,
        tie_word_embeddings: false,
        attention_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        block: Default::default(),
    }
}

/// Weights with realistic scales: matrices with std 1/√fan_in, embeddings with std ~0.6, norm
/// weights near 1, small biases.
fn synthetic(config: &ModelConfig, storage: Storage, seed: u64) -> Synthetic {
    let mut rng = Rng::new(seed);
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f64, offset: f64| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| storage.round((offset + scale * rng.uniform()) as f32))
            .collect();
        tensors.insert(name, (shape, data));
    };
    let c = config;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let std = |fan_in: usize| 3f64.sqrt() / (fan_in as f64).sqrt();
    add(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, h],
        1.0,
        0.0,
    );
    for i in 0..c.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        add(p("input_layernorm.weight"), vec![h], 0.2, 1.0);
        add(p("self_attn.q_proj.weight"), vec![q, h], std(h), 0.0);
        add(p("self_attn.k_proj.weight"), vec![kv, h], std(h), 0.0);
        add(p("self_attn.v_proj.weight"), vec![kv, h], std(h), 0.0);
        add(p("self_attn.o_proj.weight"), vec![h, q], std(q), 0.0);
        if c.attention_bias {
            add(p("self_attn.q_proj.bias"), vec![q], 0.2, 0.0);
            add(p("self_attn.k_proj.bias"), vec![kv], 0.2, 0.0);
            add(p("self_attn.v_proj.bias"), vec![kv], 0.2, 0.0);
        }
        add(p("post_attention_layernorm.weight"), vec![h], 0.2, 1.0);
        add(p("mlp.gate_proj.weight"), vec![inter, h], std(h), 0.0);
        add(p("mlp.up_proj.weight"), vec![inter, h], std(h), 0.0);
        add(p("mlp.down_proj.weight"), vec![h, inter], std(inter), 0.0);
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    if !c.tie_word_embeddings {
        add(
            "lm_head.weight".into(),
            vec![c.vocab_size, h],
            std(h) * 2.0,
            0.0,
        );
    }
    Synthetic {
        config: config.clone(),
        storage,
        tensors,
    }
}

fn engine(model: &Synthetic, max_seq_len: usize) -> Engine {
    Engine::new(build_model(model).unwrap(), max_seq_len).unwrap()
}

// ---------------------------------------------------------------------------------------------
// The naive reference forward: f64, no cache, every position recomputed from scratch.

/// RoPE inverse frequencies, written independently of the engine (HF's tensor formulation of the
/// llama3 rule: first divide the low band, then blend the middle band).
fn reference_inv_freq(c: &ModelConfig) -> Vec<f64> {
    let d = c.head_dim as f64;
    let base: Vec<f64> = (0..c.head_dim / 2)
        .map(|i| 1.0 / (c.rope_theta as f64).powf(2.0 * i as f64 / d))
        .collect();
    match c.rope_scaling {
        RopeScaling::None => base,
        // YaRN scales cos and sin too, which this reference does not: tests/families.rs checks
        // it against transformers.
        RopeScaling::Yarn { .. } => panic!("the reference forward runs no YaRN"),
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f64).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let (factor, low, high) = (
                factor as f64,
                low_freq_factor as f64,
                high_freq_factor as f64,
            );
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let llama = if wavelen > old / low { f / factor } else { f };
                    let smooth = (old / wavelen - low) / (high - low);
                    let smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
                    let medium = wavelen >= old / high && wavelen <= old / low;
                    if medium {
                        smoothed
                    } else {
                        llama
                    }
                })
                .collect()
        }
    }
}

fn mat_vec(m: &Synthetic, name: &str, x: &[f64]) -> Vec<f64> {
    let (shape, w) = &m.tensors[name];
    let (rows, cols) = (shape[0], shape[1]);
    assert_eq!(cols, x.len(), "{name}");
    (0..rows)
        .map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum())
        .collect()
}

fn vector(m: &Synthetic, name: &str) -> Vec<f64> {
    m.tensors[name].1.iter().map(|&v| v as f64).collect()
}

fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

fn rotate_ref(v: &mut [f64], pos: usize, inv_freq: &[f64], style: RopeStyle) {
    let half = v.len() / 2;
    for (i, f) in inv_freq.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::Neox => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let angle = pos as f64 * f;
        let (x0, x1) = (v[a], v[b]);
        v[a] = x0 * angle.cos() - x1 * angle.sin();
        v[b] = x0 * angle.sin() + x1 * angle.cos();
    }
}

/// Logits after every token of `tokens`.
fn reference_logits(m: &Synthetic, tokens: &[u32]) -> Vec<Vec<f64>> {
    let c = &m.config;
    let (h, d) = (c.hidden_size, c.head_dim);
    let eps = c.rms_norm_eps as f64;
    let inv_freq = reference_inv_freq(c);
    let embed = &m.tensors["model.embed_tokens.weight"].1;
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            embed[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    for layer in 0..c.num_layers {
        let p = |s: &str| format!("model.layers.{layer}.{s}");
        let with_bias = |mut y: Vec<f64>, proj: &str| {
            if c.attention_bias {
                for (y, b) in y
                    .iter_mut()
                    .zip(vector(m, &p(&format!("self_attn.{proj}.bias"))))
                {
                    *y += b;
                }
            }
            y
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = rms_norm_ref(x, &vector(m, &p("input_layernorm.weight")), eps);
            let mut q = with_bias(mat_vec(m, &p("self_attn.q_proj.weight"), &hn), "q_proj");
            let mut k = with_bias(mat_vec(m, &p("self_attn.k_proj.weight"), &hn), "k_proj");
            let v = with_bias(mat_vec(m, &p("self_attn.v_proj.weight"), &hn), "v_proj");
            for head in q.chunks_mut(d).chain(k.chunks_mut(d)) {
                rotate_ref(head, pos, &inv_freq, c.rope_style);
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attended = vec![0f64; c.q_dim()];
            for head in 0..c.num_heads {
                let kv_head = head / (c.num_heads / c.num_kv_heads);
                let q = &qs[pos][head * d..(head + 1) * d];
                let scores: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let k = &ks[t][kv_head * d..(kv_head + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for (t, e) in exps.iter().enumerate() {
                    for j in 0..d {
                        attended[head * d + j] += e / sum * vs[t][kv_head * d + j];
                    }
                }
            }
            let o = mat_vec(m, &p("self_attn.o_proj.weight"), &attended);
            for (x, o) in x.iter_mut().zip(o) {
                *x += o;
            }
            let hn = rms_norm_ref(x, &vector(m, &p("post_attention_layernorm.weight")), eps);
            let gate = mat_vec(m, &p("mlp.gate_proj.weight"), &hn);
            let up = mat_vec(m, &p("mlp.up_proj.weight"), &hn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = mat_vec(m, &p("mlp.down_proj.weight"), &act);
            for (x, dn) in x.iter_mut().zip(down) {
                *x += dn;
            }
        }
    }
    let head = match c.tie_word_embeddings {
        true => "model.embed_tokens.weight",
        false => "lm_head.weight",
    };
    xs.iter()
        .map(|x| {
            mat_vec(
                m,
                head,
                &rms_norm_ref(x, &vector(m, "model.norm.weight"), eps),
            )
        })
        .collect()
}

/// max |a − b| / max |b| over a logit vector.
fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
    diff / scale
}

fn assert_close(engine: &[Vec<f32>], reference: &[Vec<f64>], tol: f64, what: &str) {
    assert_eq!(engine.len(), reference.len(), "{what}");
    for (pos, (e, r)) in engine.iter().zip(reference).enumerate() {
        let err = relative_error(e, r);
        assert!(err < tol, "{what}: position {pos}: relative error {err:e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn engine_matches_naive_reference() {
    let mut case = 0;
    for (heads, kv_heads) in [(4, 4), (4, 2), (8, 2), (4, 1)] {
        for (bias, tied) in [(false, false), (true, true)] {
            for storage in [Storage::F32, Storage::Bf16, Storage::F16] {
                case += 1;
                let config = ModelConfig {
                    num_heads: heads,
                    num_kv_heads: kv_heads,
                    attention_bias: bias,
                    tie_word_embeddings: tied,
                    arch: if bias { Arch::Qwen2 } else { Arch::Llama },
                    ..tiny_config()
                };
                let model = synthetic(&config, storage, case);
                let tokens = Rng::new(100 + case).tokens(13, config.vocab_size);
                let got = engine(&model, 64).logits_for_all(&tokens).unwrap();
                let what = format!("heads {heads}/{kv_heads} bias {bias} tied {tied} {storage:?}");
                assert_close(&got, &reference_logits(&model, &tokens), 2e-5, &what);
            }
        }
    }
}

#[test]
fn prefill_equals_step_by_step_decode() {
    let config = ModelConfig {
        attention_bias: true,
        ..tiny_config()
    };
    let model = synthetic(&config, Storage::Bf16, 7);
    // 300 tokens span two prefill chunks.
    let tokens = Rng::new(8).tokens(300, config.vocab_size);
    let mut batch = engine(&model, 512);
    let all = batch.logits_for_all(&tokens).unwrap();
    assert_eq!(batch.position(), 300);

    let mut stepper = engine(&model, 512);
    for (pos, &t) in tokens.iter().enumerate() {
        let logits = stepper.step(t).unwrap();
        let reference: Vec<f64> = all[pos].iter().map(|&v| v as f64).collect();
        let err = relative_error(&logits, &reference);
        assert!(err < 1e-4, "position {pos}: relative error {err:e}");
    }

    // prefill returns the last position's logits; prefill in two parts continues the sequence.
    let mut split = engine(&model, 512);
    split.prefill(&tokens[..100]).unwrap();
    let last = split.prefill(&tokens[100..]).unwrap();
    let reference: Vec<f64> = all[299].iter().map(|&v| v as f64).collect();
    assert!(relative_error(&last, &reference) < 1e-4);

    // The engine agrees with the f64 reference over the long sequence too (first 40 tokens to
    // keep the naive reference quick).
    let mut fresh = engine(&model, 512);
    let got = fresh.logits_for_all(&tokens[..40]).unwrap();
    assert_close(
        &got,
        &reference_logits(&model, &tokens[..40]),
        2e-5,
        "bf16 40 tokens",
    );
}

#[test]
fn truncate_and_reset_rewind_the_cache() {
    let model = synthetic(&tiny_config(), Storage::F32, 11);
    let tokens = Rng::new(12).tokens(10, 61);
    let mut e = engine(&model, 32);
    let all = e.logits_for_all(&tokens).unwrap();
    e.truncate(6);
    assert_eq!(e.position(), 6);
    assert_eq!(e.step(tokens[6]).unwrap(), all[6]);
    e.reset();
    assert_eq!(e.position(), 0);
    assert_eq!(e.prefill(&tokens[..3]).unwrap(), all[2]);
}

/// HF → GGUF-llama row order of Q/K (formats.md §1.8): `W_int[h·D + 2i + j] = W_hf[h·D + j·D/2 + i]`.
fn interleave_rows(data: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..head_dim / 2 {
            for j in 0..2 {
                let dst = h * head_dim + 2 * i + j;
                let src = h * head_dim + j * head_dim / 2 + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn rope_styles_agree_when_qk_rows_are_permuted() {
    let config = ModelConfig {
        attention_bias: true,
        num_heads: 4,
        num_kv_heads: 2,
        ..tiny_config()
    };
    let neox = synthetic(&config, Storage::F32, 21);
    let mut interleaved = neox.clone();
    interleaved.config.rope_style = RopeStyle::Interleaved;
    for layer in 0..config.num_layers {
        for (proj, heads) in [
            ("q_proj", config.num_heads),
            ("k_proj", config.num_kv_heads),
        ] {
            for (kind, cols) in [("weight", config.hidden_size), ("bias", 1)] {
                let name = format!("model.layers.{layer}.self_attn.{proj}.{kind}");
                let (_, data) = interleaved.tensors.get_mut(&name).unwrap();
                *data = interleave_rows(data, heads, config.head_dim, cols);
            }
        }
    }
    let tokens = Rng::new(22).tokens(17, config.vocab_size);
    let a = engine(&neox, 64).logits_for_all(&tokens).unwrap();
    let b = engine(&interleaved, 64).logits_for_all(&tokens).unwrap();
    let a64: Vec<Vec<f64>> = a
        .iter()
        .map(|r| r.iter().map(|&v| v as f64).collect())
        .collect();
    assert_close(&b, &a64, 1e-5, "interleaved vs neox");
    // Without the permutation the interleaved model computes something else.
    let mut unpermuted = neox.clone();
    unpermuted.config.rope_style = RopeStyle::Interleaved;
    let c = engine(&unpermuted, 64).logits_for_all(&tokens).unwrap();
    assert!(relative_error(&c[16], &a64[16]) > 1e-2);
    // And the reference agrees with the interleaved engine.
    assert_close(
        &b,
        &reference_logits(&interleaved, &tokens),
        2e-5,
        "interleaved reference",
    );
}

#[test]
fn llama3_rope_frequencies_match_transformers() {
    let config = ModelConfig {
        hidden_size: 4096,
        num_heads: 32,
        head_dim: 128,
        rope_theta: 500000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        ..tiny_config()
    };
    // transformers 5.24 `ROPE_INIT_FUNCTIONS["llama3"]` (float32) for Llama-3.1-8B: high band
    // unchanged (i ≤ 28), blended middle band (29..=35), low band divided by 8 (i ≥ 36).
    let expected = [
        (0, 1.0),
        (10, 0.12868738174438477),
        (20, 0.016560440883040428),
        (27, 0.003942275885492563),
        (28, 0.0032114461064338684),
        (29, 0.0021665706299245358),
        (30, 0.0013718936825171113),
        (31, 0.0008567514596506953),
        (32, 0.0005248460220173001),
        (33, 0.0003126936499029398),
        (34, 0.0001785077911335975),
        (35, 9.556212171446532e-05),
        (36, 7.784655463183299e-05),
        (50, 4.411534519022098e-06),
        (63, 3.068925877869333e-07),
    ];
    let ours = rope_inv_freq(&config);
    let independent = reference_inv_freq(&config);
    assert_eq!(ours.len(), 64);
    for (i, want) in expected {
        let rel = (ours[i] - want).abs() / want;
        assert!(
            rel < 2e-6,
            "inv_freq[{i}] = {} vs transformers {want}",
            ours[i]
        );
    }
    for (i, (a, b)) in ours.iter().zip(&independent).enumerate() {
        assert!((a - b).abs() <= 1e-12 * b, "inv_freq[{i}]: {a} vs {b}");
    }
    let unscaled = rope_inv_freq(&ModelConfig {
        rope_scaling: RopeScaling::None,
        ..config.clone()
    });
    assert_eq!(ours[10], unscaled[10]);
    assert!((ours[50] * 8.0 - unscaled[50]).abs() < 1e-18);
}

#[test]
fn scaled_rope_models_match_reference() {
    for scaling in [
        RopeScaling::Linear { factor: 4.0 },
        // A small original context puts this tiny model's frequencies in all three bands.
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        },
    ] {
        let config = ModelConfig {
            head_dim: 16,
            num_heads: 2,
            num_kv_heads: 1,
            rope_scaling: scaling,
            ..tiny_config()
        };
        let model = synthetic(&config, Storage::F32, 31);
        let tokens = Rng::new(32).tokens(20, config.vocab_size);
        let got = engine(&model, 64).logits_for_all(&tokens).unwrap();
        assert_close(
            &got,
            &reference_logits(&model, &tokens),
            2e-5,
            &format!("{scaling:?}"),
        );
    }
}

#[test]
fn tied_embeddings_share_one_matrix() {
    let config = ModelConfig {
        tie_word_embeddings: true,
        ..tiny_config()
    };
    let weights = build_model(&synthetic(&config, Storage::Bf16, 41)).unwrap();
    assert!(Arc::ptr_eq(&weights.embed, &weights.lm_head));
    let expected_bytes = {
        let c = &config;
        let per_layer = 2 * (2 * c.q_dim() * c.hidden_size + 2 * c.kv_dim() * c.hidden_size)
            + 2 * 3 * c.intermediate_size * c.hidden_size
            + 4 * 2 * c.hidden_size;
        2 * c.vocab_size * c.hidden_size + c.num_layers * per_layer + 4 * c.hidden_size
    };
    assert_eq!(weights.stored_bytes(), expected_bytes);
    let untied = build_model(&synthetic(&tiny_config(), Storage::Bf16, 41)).unwrap();
    assert!(!Arc::ptr_eq(&untied.embed, &untied.lm_head));
}

#[test]
fn perplexity_of_a_uniform_model_is_the_vocabulary_size() {
    let mut model = synthetic(&tiny_config(), Storage::F32, 51);
    model.tensors.get_mut("lm_head.weight").unwrap().1.fill(0.0);
    let mut e = engine(&model, 64);
    let tokens = Rng::new(52).tokens(50, 61);
    // (49 tokens with window 16 leave a one-token last window with nothing to score.)
    for len in [50, 49] {
        let tokens = &tokens[..len];
        for (window, stride) in [(64, 64), (16, 16), (16, 5), (16, 1), (2, 1), (51, 10)] {
            let p = perplexity(&mut e, tokens, window, stride).unwrap();
            assert!((p.ppl - 61.0).abs() < 1e-9, "{window}/{stride}: {}", p.ppl);
            assert!((p.mean_nll - 61f64.ln()).abs() < 1e-12);
            let expected_scored = match stride == window {
                // Each window's first token lacks context.
                true => len - len.div_ceil(window),
                false => len - 1,
            };
            assert_eq!(p.tokens_scored, expected_scored, "{len}: {window}/{stride}");
        }
    }
}

#[test]
fn perplexity_windows_score_each_token_once_with_its_window_context() {
    let model = synthetic(&tiny_config(), Storage::F32, 53);
    let tokens = Rng::new(54).tokens(23, 61);
    let (window, stride) = (10, 4);
    // By hand: windows [0,10) [4,14) [8,18) [12,22) [16,23); each scores the tokens after the
    // previous window's end, predicted from its own start.
    let mut nll = 0f64;
    let mut count = 0;
    let mut scored_until = 1;
    for begin in (0..).step_by(stride) {
        let end = (begin + window).min(tokens.len());
        let logits = reference_logits(&model, &tokens[begin..end]);
        for t in scored_until.max(begin + 1)..end {
            let l = &logits[t - 1 - begin];
            let max = l.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + l.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            nll += lse - l[tokens[t] as usize];
            count += 1;
        }
        scored_until = end;
        if end == tokens.len() {
            break;
        }
    }
    let p = perplexity(&mut engine(&model, 64), &tokens, window, stride).unwrap();
    assert_eq!(p.tokens_scored, count);
    assert_eq!(count, 22);
    assert!(
        (p.mean_nll - nll / count as f64).abs() < 1e-5,
        "{} vs {}",
        p.mean_nll,
        nll / count as f64
    );

    let mut e = engine(&model, 8);
    for (w, s) in [(1, 1), (10, 0), (10, 11), (10, 3)] {
        assert!(
            matches!(
                perplexity(&mut e, &tokens, w, s),
                Err(ModelError::Config(_))
            ),
            "{w}/{s}"
        );
    }
    assert!(perplexity(&mut e, &tokens[..1], 4, 2).is_err());
}

#[test]
fn context_full_is_an_error_that_leaves_the_sequence_intact() {
    let model = synthetic(&tiny_config(), Storage::F32, 61);
    let tokens = Rng::new(62).tokens(8, 61);
    let mut e = engine(&model, 8);
    e.prefill(&tokens[..6]).unwrap();
    let err = e.prefill(&tokens[..3]).unwrap_err().to_string();
    assert!(
        err.contains("context full") && err.contains("max_seq_len 8"),
        "{err}"
    );
    assert_eq!(e.position(), 6);
    e.step(tokens[6]).unwrap();
    e.step(tokens[7]).unwrap();
    assert!(e
        .step(tokens[0])
        .unwrap_err()
        .to_string()
        .contains("context full"));

    let weights = build_model(&model).unwrap();
    let err = Engine::new(weights, 513).err().unwrap().to_string();
    assert!(err.contains("max_seq_len"), "{err}");
}

#[test]
fn bad_token_ids_and_empty_input_are_errors() {
    let model = synthetic(&tiny_config(), Storage::F32, 63);
    let mut e = engine(&model, 8);
    let err = e.prefill(&[3, 61]).unwrap_err().to_string();
    assert!(
        err.contains("token id 61") && err.contains("embed_tokens"),
        "{err}"
    );
    assert_eq!(e.position(), 0);
    assert!(e.prefill(&[]).is_err());
}

fn tensor_error(model: &Synthetic) -> (String, String) {
    match build_model(model) {
        Err(ModelError::Tensor { name, msg }) => (name, msg),
        Err(other) => panic!("expected a tensor error, got {other}"),
        Ok(_) => panic!("expected a tensor error, got a model"),
    }
}

#[test]
fn shape_mismatches_and_missing_tensors_name_the_tensor() {
    let config = ModelConfig {
        attention_bias: true,
        ..tiny_config()
    };
    let good = synthetic(&config, Storage::Bf16, 71);
    assert!(build_model(&good).is_ok());

    let k = "model.layers.1.self_attn.k_proj.weight";
    let mut m = good.clone();
    m.tensors.insert(k.into(), (vec![8, 32], vec![0.0; 256]));
    let (name, msg) = tensor_error(&m);
    assert_eq!(name, k);
    assert!(msg.contains("[8, 32]") && msg.contains("[16, 32]"), "{msg}");

    let mut m = good.clone();
    m.tensors.remove("model.layers.0.mlp.down_proj.weight");
    let (name, msg) = tensor_error(&m);
    assert_eq!(name, "model.layers.0.mlp.down_proj.weight");
    assert!(msg.contains("missing"), "{msg}");

    let mut m = good.clone();
    m.tensors.remove("model.layers.1.self_attn.v_proj.bias");
    assert_eq!(tensor_error(&m).0, "model.layers.1.self_attn.v_proj.bias");

    let mut m = good.clone();
    m.tensors
        .insert("model.norm.weight".into(), (vec![31], vec![1.0; 31]));
    let (name, msg) = tensor_error(&m);
    assert_eq!(name, "model.norm.weight");
    assert!(msg.contains("length 31"), "{msg}");

    let mut m = good.clone();
    m.tensors.insert(
        "lm_head.weight".into(),
        (vec![61, 4, 8], vec![0.0; 61 * 32]),
    );
    let (name, msg) = tensor_error(&m);
    assert_eq!(name, "lm_head.weight");
    assert!(msg.contains("expected a matrix"), "{msg}");

    // An output projection's bias is read where the checkpoint has one (transformers' Llama with
    // `attention_bias`), and checked.
    let mut m = good.clone();
    m.tensors.insert(
        "model.layers.0.self_attn.o_proj.bias".into(),
        (vec![32], vec![0.5; 32]),
    );
    let w = build_model(&m).unwrap();
    assert_eq!(w.layers[0].norms.o_bias.as_deref(), Some(&[0.5f32; 32][..]));
    assert_eq!(w.layers[1].norms.o_bias, None);
    m.tensors.insert(
        "model.layers.0.self_attn.o_proj.bias".into(),
        (vec![31], vec![0.5; 31]),
    );
    let (name, msg) = tensor_error(&m);
    assert_eq!(name, "model.layers.0.self_attn.o_proj.bias");
    assert!(msg.contains("length 31"), "{msg}");

    let mut m = good.clone();
    m.config.num_kv_heads = 3;
    assert!(matches!(build_model(&m), Err(ModelError::Config(_))));
}

#[test]
fn greedy_generation_follows_the_argmax_chain() {
    let model = synthetic(&tiny_config(), Storage::F32, 81);
    let prompt = Rng::new(82).tokens(5, 61);
    // The chain by hand: argmax, feed it back.
    let mut e = engine(&model, 64);
    let mut logits = e.prefill(&prompt).unwrap();
    let mut chain = Vec::new();
    for _ in 0..12 {
        let t = argmax(&logits).unwrap();
        chain.push(t);
        logits = e.step(t).unwrap();
    }

    let mut e = engine(&model, 64);
    let mut streamed = Vec::new();
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    let out = generate(&mut e, &mut sampler, &prompt, &opts(12, &[]), |t, _| {
        streamed.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.tokens, chain);
    assert_eq!(streamed, chain);
    assert_eq!(out.stop, StopReason::MaxTokens);
    // The last token is not fed back.
    assert_eq!(e.position(), prompt.len() + 11);

    // A stop token ends generation and is not returned.
    let stop = chain[4];
    let first_stop = chain.iter().position(|&t| t == stop).unwrap();
    e.reset();
    let out = generate(&mut e, &mut sampler, &prompt, &opts(12, &[stop]), |_, _| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.stop, StopReason::StopToken(stop));
    assert_eq!(out.tokens, chain[..first_stop]);

    // The callback can stop it.
    e.reset();
    let out = generate(
        &mut e,
        &mut sampler,
        &prompt,
        &opts(12, &[]),
        |t, _| match t == chain[2] {
            true => ControlFlow::Break(()),
            false => ControlFlow::Continue(()),
        },
    )
    .unwrap();
    assert_eq!(out.stop, StopReason::Callback);
    assert_eq!(*out.tokens.last().unwrap(), chain[2]);

    // A full context stops it.
    let mut small = engine(&model, 8);
    let out = generate(&mut small, &mut sampler, &prompt, &opts(12, &[]), |_, _| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.stop, StopReason::ContextFull);
    assert_eq!(out.tokens, chain[..4]);
}

#[test]
fn seeded_sampling_generation_is_reproducible() {
    let model = synthetic(&tiny_config(), Storage::Bf16, 91);
    let prompt = Rng::new(92).tokens(4, 61);
    let run = |seed| {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 20,
            top_p: 0.95,
            repetition_penalty: 1.1,
            min_p: 0.0,
            seed,
        })
        .unwrap();
        let mut e = engine(&model, 64);
        generate(&mut e, &mut sampler, &prompt, &opts(30, &[]), |_, _| {
            ControlFlow::Continue(())
        })
        .unwrap()
        .tokens
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

fn opts(max_new_tokens: usize, stop_tokens: &[u32]) -> entrollm_model::GenerateOptions<'_> {
    entrollm_model::GenerateOptions {
        max_new_tokens,
        stop_tokens,
        ..Default::default()
    }
}
