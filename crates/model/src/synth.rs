//! Synthetic checkpoints with realistic weight statistics, for tests and benchmarks (no model hub).
//!
//! The distribution, per matrix W [rows × cols] of kind k (σ_k below):
//! - each row has a scale `s_row = σ_k · exp(0.25 · n_row)`, n_row ~ N(0, 1): the spread of per-channel
//!   scales seen in trained transformers (≈ ±25 % at one standard deviation);
//! - each weight is `s_row · τ · z`, z ~ N(0, 1), with τ = 2.5 for 3 % of weights and 1 otherwise: a
//!   scale mixture with kurtosis ≈ 4.8 (heavier tails than a Gaussian, as trained weights have);
//! - 1 column in 256 is an outlier channel whose weights are 4× larger (the channels behind LLMs'
//!   "massive activations").
//!
//! σ_k: q/k 0.025, v/o 0.015, gate/up 0.018, down 0.015, embeddings and lm_head 0.012. RMSNorm weights
//! are `1 + 0.05 · z`. Values are rounded to BF16/FP16 (round to nearest even).
//! Everything is a pure function of (seed, tensor name, row): any tensor, and any row of it, can be
//! generated alone and in parallel, and the same seed always gives the same bytes.

use crate::arch::Role;
use crate::config::{Arch, ModelConfig, RopeScaling, RopeStyle};
use crate::weights::{DenseBf16, LayerWeights, Linear, ModelWeights};
use entrollm_codec::histogram::{byte_histogram, entropy_bits};
use entrollm_codec::payload::f32_to_fp8_e4m3;
use entrollm_codec::rng::splitmix64;
use rayon::prelude::*;
use std::sync::Arc;

/// The model shapes `entrollm synth` makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthShape {
    /// Two small layers with ragged sizes (not multiples of tile widths), for tests.
    Tiny,
    /// Llama-3.2-1B's shape (tied embeddings): a 1B-class model a CPU serves.
    Llama32_1B,
    Llama31_8B,
    Llama33_70B,
}

impl SynthShape {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tiny" => Some(SynthShape::Tiny),
            "llama-3.2-1b" => Some(SynthShape::Llama32_1B),
            "llama-3.1-8b" => Some(SynthShape::Llama31_8B),
            "llama-3.3-70b" => Some(SynthShape::Llama33_70B),
            _ => None,
        }
    }

    pub fn names() -> &'static [&'static str] {
        &["tiny", "llama-3.2-1b", "llama-3.1-8b", "llama-3.3-70b"]
    }

    pub fn config(self) -> ModelConfig {
        let (hidden, inter, layers, heads, kv, vocab) = match self {
            SynthShape::Tiny => (192, 520, 2, 6, 2, 1000),
            SynthShape::Llama32_1B => (2048, 8192, 16, 32, 8, 128256),
            SynthShape::Llama31_8B => (4096, 14336, 32, 32, 8, 128256),
            SynthShape::Llama33_70B => (8192, 28672, 80, 64, 8, 128256),
        };
        let llama3 = !matches!(self, SynthShape::Tiny);
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hidden / heads,
            max_position_embeddings: if llama3 { 131072 } else { 2048 },
            rms_norm_eps: 1e-5,
            rope_theta: if llama3 { 500000.0 } else { 10000.0 },
            rope_scaling: if llama3 {
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }
            } else {
                RopeScaling::None
            },
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: self == SynthShape::Llama32_1B,
            attention_bias: false,
            bos_token_id: Some(if llama3 { 128000 } else { 1 }),
            eos_token_ids: vec![if llama3 { 128001 } else { 2 }],
            block: Default::default(),
        }
    }
}

/// The transformers `config.json` of a model the engine loads (a GGUF), for the Llama family
/// without attention biases, whose transformers modules are exactly the engine's weights (f32:
/// the engine widens norms and embeddings); `None` for other families.
pub fn transformers_config_json(c: &ModelConfig) -> Option<String> {
    if c.arch != Arch::Llama || c.attention_bias {
        return None;
    }
    let mut json: serde_json::Value =
        serde_json::from_str(&hf_config_json(c, "float32")).expect("the config is JSON");
    json.as_object_mut()
        .expect("an object")
        .remove("entrollm_synthetic");
    Some(json.to_string())
}

/// The HF `config.json` of a synthetic Llama-architecture model.
pub fn hf_config_json(c: &ModelConfig, torch_dtype: &str) -> String {
    let mut v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids.first(),
        "torch_dtype": torch_dtype,
        "entrollm_synthetic": true,
    });
    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = c.rope_scaling
    {
        v["rope_scaling"] = serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        });
    }
    serde_json::to_string_pretty(&v).expect("a JSON value serialises")
}

/// What a synthetic tensor is, which sets its statistics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SynthKind {
    Norm,
    Matrix { sigma: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct SynthTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: SynthKind,
}

impl SynthTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The HF name of a synthetic model's tensor: the Llama family's name of `role` in `layer` (the
/// model's own tensors ignore `layer`).
pub fn tensor_name(role: Role, layer: usize) -> String {
    Arch::Llama
        .family()
        .hf_name(role, layer, "weight")
        .expect("a synthetic model's roles are Llama's")
}

/// Every tensor of a Llama-architecture model, in HF names and shapes, in checkpoint order.
pub fn tensors(c: &ModelConfig) -> Vec<SynthTensor> {
    let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (q, kv) = (c.num_heads * d, c.num_kv_heads * d);
    let m = |role: Role, l: usize, rows: usize, cols: usize, sigma: f32| SynthTensor {
        name: tensor_name(role, l),
        shape: vec![rows, cols],
        kind: SynthKind::Matrix { sigma },
    };
    let norm = |role: Role, l: usize| SynthTensor {
        name: tensor_name(role, l),
        shape: vec![h],
        kind: SynthKind::Norm,
    };
    let mut v = vec![m(Role::Embed, 0, c.vocab_size, h, 0.012)];
    for l in 0..c.num_layers {
        v.push(norm(Role::AttnNorm, l));
        v.push(m(Role::Q, l, q, h, 0.025));
        v.push(m(Role::K, l, kv, h, 0.025));
        v.push(m(Role::V, l, kv, h, 0.015));
        v.push(m(Role::O, l, h, q, 0.015));
        v.push(norm(Role::MlpNorm, l));
        v.push(m(Role::Gate, l, i, h, 0.018));
        v.push(m(Role::Up, l, i, h, 0.018));
        v.push(m(Role::Down, l, h, i, 0.015));
    }
    v.push(norm(Role::FinalNorm, 0));
    if !c.tie_word_embeddings {
        v.push(m(Role::LmHead, 0, c.vocab_size, h, 0.012));
    }
    v
}

/// xoshiro256++: fast, good-quality streams, one per (tensor, row).
struct Xoshiro([u64; 4]);

impl Xoshiro {
    fn new(seed: u64) -> Self {
        let mut s = seed;
        Xoshiro(std::array::from_fn(|_| {
            s = splitmix64(s);
            s
        }))
    }
    #[inline(always)]
    fn next(&mut self) -> u64 {
        let s = &mut self.0;
        let r = (s[0].wrapping_add(s[3])).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
    /// Uniform in (0, 1].
    #[inline(always)]
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 1.0) * (1.0 / (1u64 << 24) as f32)
    }
    /// Two independent N(0, 1) (Box–Muller).
    #[inline(always)]
    fn normal2(&mut self) -> (f32, f32) {
        let r = (-2.0 * self.unit().ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * self.unit()).sin_cos();
        (r * c, r * s)
    }
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01B3)
    })
}

/// Fills one row of a synthetic tensor with f32 values.
pub fn fill_row(t: &SynthTensor, seed: u64, row: usize, out: &mut [f32]) {
    let mut rng = Xoshiro::new(splitmix64(seed ^ name_hash(&t.name)) ^ splitmix64(row as u64 + 1));
    match t.kind {
        SynthKind::Norm => {
            for pair in out.chunks_mut(2) {
                let (a, b) = rng.normal2();
                pair[0] = 1.0 + 0.05 * a;
                if let Some(x) = pair.get_mut(1) {
                    *x = 1.0 + 0.05 * b;
                }
            }
        }
        SynthKind::Matrix { sigma } => {
            let row_scale = sigma * (0.25 * rng.normal2().0).exp();
            let col_seed = splitmix64(seed ^ name_hash(&t.name) ^ 0xC011);
            for (c0, pair) in out.chunks_mut(2).enumerate() {
                let (a, b) = rng.normal2();
                let u = rng.next();
                for (j, (x, z)) in pair.iter_mut().zip([a, b]).enumerate() {
                    let col = 2 * c0 + j;
                    let tau = if (u >> (32 * j)) as u32 % 100 < 3 {
                        2.5
                    } else {
                        1.0
                    };
                    let outlier = if splitmix64(col_seed ^ col as u64).is_multiple_of(256) {
                        4.0
                    } else {
                        1.0
                    };
                    *x = row_scale * tau * outlier * z;
                }
            }
        }
    }
}

/// The 16-bit storage formats synth writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthDtype {
    Bf16,
    F16,
}

/// Fills a whole tensor as little-endian 16-bit values (rows in parallel).
pub fn fill_tensor_16(t: &SynthTensor, seed: u64, dtype: SynthDtype, out: &mut [u8]) {
    let cols = *t.shape.last().unwrap_or(&1);
    assert_eq!(
        out.len(),
        t.numel() * 2,
        "output buffer does not fit {}",
        t.name
    );
    out.par_chunks_mut(2 * cols).enumerate().for_each_init(
        || vec![0f32; cols],
        |buf, (row, bytes)| {
            fill_row(t, seed, row, buf);
            for (b, &v) in bytes.chunks_exact_mut(2).zip(buf.iter()) {
                let bits = match dtype {
                    SynthDtype::Bf16 => half::bf16::from_f32(v).to_bits(),
                    SynthDtype::F16 => half::f16::from_f32(v).to_bits(),
                };
                b.copy_from_slice(&bits.to_le_bytes());
            }
        },
    );
}

/// Whether synth stores `t` as FP8 when asked for an FP8 checkpoint: the decoder's linear layers,
/// as FP8 checkpoints do; embeddings, the LM head and norms stay 16-bit.
pub fn is_fp8_linear(t: &SynthTensor) -> bool {
    matches!(t.kind, SynthKind::Matrix { .. }) && t.name.starts_with("model.layers.")
}

/// Row `row` of `t` as FP8 E4M3 codes with one scale per row, like compressed-tensors'
/// "float-quantized" channel strategy: `scale = multiplier · amax / 448`, `code = e4m3(w / scale)`.
/// A multiplier of 1 uses the format's whole range; larger ones push the values towards zero, where
/// E4M3 has few levels, and lower the codes' entropy. `buf` is scratch of the row's length.
pub fn fp8_row(
    t: &SynthTensor,
    seed: u64,
    row: usize,
    multiplier: f32,
    buf: &mut [f32],
    codes: &mut [u8],
) -> f32 {
    fill_row(t, seed, row, buf);
    let amax = buf.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 {
        multiplier * amax / 448.0
    } else {
        1.0
    };
    for (c, &v) in codes.iter_mut().zip(buf.iter()) {
        *c = f32_to_fp8_e4m3(v / scale);
    }
    scale
}

/// Fills a whole tensor as FP8 E4M3 codes (`codes`, row-major) and row scales (rows in parallel).
pub fn fill_tensor_fp8(
    t: &SynthTensor,
    seed: u64,
    multiplier: f32,
    codes: &mut [u8],
    scales: &mut [f32],
) {
    let cols = *t.shape.last().unwrap_or(&1);
    assert_eq!(
        codes.len(),
        t.numel(),
        "code buffer does not fit {}",
        t.name
    );
    assert_eq!(
        scales.len(),
        t.numel() / cols,
        "scale buffer does not fit {}",
        t.name
    );
    codes
        .par_chunks_mut(cols)
        .zip(scales.par_iter_mut())
        .enumerate()
        .for_each_init(
            || vec![0f32; cols],
            |buf, (row, (codes, scale))| *scale = fp8_row(t, seed, row, multiplier, buf, codes),
        );
}

/// Entropy in bits of the FP8 codes of `t` at `multiplier`, measured on up to 64 rows spread over
/// the matrix.
fn fp8_entropy(t: &SynthTensor, seed: u64, multiplier: f32) -> f64 {
    let (rows, cols) = (t.shape[0], *t.shape.last().unwrap_or(&1));
    let step = rows.div_ceil(64).max(1);
    let picked: Vec<usize> = (0..rows).step_by(step).collect();
    let codes: Vec<u8> = picked
        .par_iter()
        .flat_map_iter(|&r| {
            let (mut buf, mut c) = (vec![0f32; cols], vec![0u8; cols]);
            fp8_row(t, seed, r, multiplier, &mut buf, &mut c);
            c
        })
        .collect();
    entropy_bits(&byte_histogram(&codes))
}

/// The multiplier (see [`fp8_row`]) at which the FP8 codes of `t` carry `bits` of entropy (within
/// 0.01 bits, measured on a sample of rows), found by bisection on its logarithm: the entropy falls
/// as the multiplier grows. Targets above the entropy at multiplier 1 give 1.
pub fn fit_fp8_multiplier(t: &SynthTensor, seed: u64, bits: f64) -> f32 {
    let (mut lo, mut hi) = (0f32, 24f32); // log2 of the multiplier
    if fp8_entropy(t, seed, 1.0) <= bits {
        return 1.0;
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        let h = fp8_entropy(t, seed, mid.exp2());
        if (h - bits).abs() < 0.01 {
            return mid.exp2();
        }
        if h > bits {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (0.5 * (lo + hi)).exp2()
}

/// A whole tensor as the BF16 bits `entrollm synth` stores (rows in parallel).
pub fn bf16_bits(t: &SynthTensor, seed: u64) -> Vec<u16> {
    let mut b = vec![0u8; t.numel() * 2];
    fill_tensor_16(t, seed, SynthDtype::Bf16, &mut b);
    b.chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// The synthetic BF16 model of `c` in memory with layer 0's weights in every layer (one `Arc` per
/// matrix, shared by all layers): `entrollm synth`'s shapes and statistics at the host memory of
/// one layer and the embeddings, for benchmarks and tuning on a device (a 70B model's layers do
/// not fit in host memory; every layer has the same shapes and statistics). Layer 0, the
/// embeddings and the final norm hold exactly the bytes of the BF16 checkpoint `synth` writes.
pub fn shared_layer_weights(c: &ModelConfig, seed: u64) -> crate::Result<ModelWeights> {
    c.validate()?;
    let ts = tensors(c);
    let get = |name: &str| -> crate::Result<&SynthTensor> {
        ts.iter()
            .find(|t| t.name == name)
            .ok_or_else(|| crate::ModelError::tensor(name, "not a tensor of this shape"))
    };
    let bits = |t: &SynthTensor| bf16_bits(t, seed);
    let matrix = |name: &str| -> crate::Result<Arc<dyn Linear>> {
        let t = get(name)?;
        Ok(Arc::new(DenseBf16::new(
            name,
            t.shape[0],
            t.shape[1],
            bits(t),
        )?))
    };
    let norm = |name: &str| -> crate::Result<Vec<f32>> {
        Ok(bits(get(name)?)
            .into_iter()
            .map(|b| half::bf16::from_bits(b).to_f32())
            .collect())
    };
    let l = |role: Role| tensor_name(role, 0);
    let layer = LayerWeights {
        attn_norm: norm(&l(Role::AttnNorm))?,
        q: matrix(&l(Role::Q))?,
        k: matrix(&l(Role::K))?,
        v: matrix(&l(Role::V))?,
        o: matrix(&l(Role::O))?,
        q_bias: None,
        k_bias: None,
        v_bias: None,
        mlp_norm: norm(&l(Role::MlpNorm))?,
        mlp: crate::weights::Mlp::Gated(crate::weights::GatedMlp {
            gate: matrix(&l(Role::Gate))?,
            up: matrix(&l(Role::Up))?,
            down: matrix(&l(Role::Down))?,
        }),
        norms: Default::default(),
    };
    let embed = matrix(&l(Role::Embed))?;
    let lm_head = match c.tie_word_embeddings {
        true => Arc::clone(&embed),
        false => matrix(&l(Role::LmHead))?,
    };
    let layers = vec![layer; c.num_layers];
    let w = ModelWeights {
        config: c.clone(),
        embed,
        layers,
        final_norm: norm(&l(Role::FinalNorm))?,
        lm_head,
    };
    w.validate()?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_layer_weights_hold_layer_0_in_every_layer() {
        let c = SynthShape::Tiny.config();
        let w = shared_layer_weights(&c, 5).unwrap();
        assert_eq!(w.layers.len(), c.num_layers);
        let gate = |i: usize| &w.layers[i].gated().unwrap().gate;
        assert!(Arc::ptr_eq(gate(0), gate(1)));
        assert!(!Arc::ptr_eq(&w.embed, &w.lm_head));
        for (name, m) in [
            ("model.layers.0.self_attn.k_proj.weight", &w.layers[1].k),
            ("lm_head.weight", &w.lm_head),
        ] {
            let t = tensors(&c).into_iter().find(|t| t.name == name).unwrap();
            let mut want = vec![0u8; t.numel() * 2];
            fill_tensor_16(&t, 5, SynthDtype::Bf16, &mut want);
            let got = m.as_any().downcast_ref::<DenseBf16>().unwrap().data();
            let got: Vec<u8> = got.iter().flat_map(|b| b.to_le_bytes()).collect();
            assert_eq!(got, want, "{name}");
        }
        assert_eq!(w.layers[1].mlp_norm, w.layers[0].mlp_norm);
    }

    #[test]
    fn shapes_match_llama_31_8b() {
        let c = SynthShape::Llama31_8B.config();
        let t = tensors(&c);
        let total: usize = t.iter().map(|t| t.numel()).sum();
        assert_eq!(total, 8_030_261_248, "Llama-3.1-8B has 8.03 B parameters");
        assert_eq!(t.len(), 2 + 9 * 32 + 1);
    }

    #[test]
    fn generation_is_deterministic_and_row_independent() {
        let c = SynthShape::Tiny.config();
        let t = &tensors(&c)[2];
        let mut a = vec![0u8; t.numel() * 2];
        let mut b = vec![0u8; t.numel() * 2];
        fill_tensor_16(t, 7, SynthDtype::Bf16, &mut a);
        fill_tensor_16(t, 7, SynthDtype::Bf16, &mut b);
        assert_eq!(a, b);
        fill_tensor_16(t, 8, SynthDtype::Bf16, &mut b);
        assert_ne!(a, b);
        let mut row = vec![0f32; t.shape[1]];
        fill_row(t, 7, 3, &mut row);
        let stored: Vec<f32> = a[6 * t.shape[1]..8 * t.shape[1]]
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(
            stored,
            row.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn fp8_codes_reach_the_entropy_asked_for() {
        let c = SynthShape::Tiny.config();
        let t = tensors(&c)
            .into_iter()
            .find(|t| t.name.ends_with("mlp.gate_proj.weight"))
            .unwrap();
        assert!(is_fp8_linear(&t));
        let full = fp8_entropy(&t, 3, 1.0);
        assert!(full > 5.0, "amax scaling uses many levels: {full}");
        for bits in [2.1, 3.0, 4.5] {
            let m = fit_fp8_multiplier(&t, 3, bits);
            assert!(m > 1.0);
            let mut codes = vec![0u8; t.numel()];
            let mut scales = vec![0f32; t.shape[0]];
            fill_tensor_fp8(&t, 3, m, &mut codes, &mut scales);
            let h = entropy_bits(&byte_histogram(&codes));
            assert!((h - bits).abs() < 0.1, "asked {bits}, got {h}");
            // Dequantised rows stay close to the weights in scale: codes·scale ≈ w.
            let mut w = vec![0f32; t.shape[1]];
            fill_row(&t, 3, 5, &mut w);
            let deq: Vec<f32> = codes[5 * t.shape[1]..6 * t.shape[1]]
                .iter()
                .map(|&c| entrollm_codec::payload::fp8_e4m3_to_f32(c) * scales[5])
                .collect();
            let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = w
                .iter()
                .zip(&deq)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= amax, "error {err} vs amax {amax}");
        }
        assert_eq!(fit_fp8_multiplier(&t, 3, 9.0), 1.0);
    }

    #[test]
    fn statistics_are_as_documented() {
        let t = SynthTensor {
            name: "x".into(),
            shape: vec![256, 4096],
            kind: SynthKind::Matrix { sigma: 0.02 },
        };
        let mut sum2 = 0f64;
        let mut sum4 = 0f64;
        let mut row = vec![0f32; 4096];
        let mut scales = Vec::new();
        for r in 0..256 {
            fill_row(&t, 1, r, &mut row);
            let s2: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 4096.0;
            scales.push(s2.sqrt());
            sum2 += s2;
            sum4 += row.iter().map(|&v| (v as f64).powi(4)).sum::<f64>() / 4096.0;
        }
        let n = 256.0;
        let kurtosis = (sum4 / n) / (sum2 / n).powi(2);
        assert!(
            kurtosis > 4.5,
            "kurtosis {kurtosis} should show heavy tails"
        );
        let mean_log: f64 = scales.iter().map(|s| s.ln()).sum::<f64>() / n;
        let sd_log = (scales
            .iter()
            .map(|s| (s.ln() - mean_log).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        assert!((0.18..0.35).contains(&sd_log), "row scale spread {sd_log}");
    }
}
