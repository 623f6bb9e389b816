//! Model configuration: what the engine needs to know about an architecture, from an HF
//! `config.json` or GGUF metadata.

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};

pub use crate::arch::{Activation, Arch, Routing};
use crate::arch::{Family, Sliding};

/// Which pairs of a head's dimensions RoPE rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// HF layout ("NEOX"): rotate (x[i], x[i + d/2]).
    Neox,
    /// GGUF llama layout ("NORM"): rotate adjacent pairs (x[2i], x[2i+1]).
    Interleaved,
}

/// RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    /// Llama 3.1: per-frequency scaling between a low and a high wavelength band.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// YaRN (transformers' `_compute_yarn_parameters`): per rotated pair, a ramp over its index
    /// between the correction dimensions of `beta_fast` and `beta_slow` rotations mixes the
    /// interpolated (`freq / factor`) and the original frequency; cos and sin are multiplied by
    /// `attention_factor`.
    Yarn {
        factor: f32,
        beta_fast: f32,
        beta_slow: f32,
        original_max_position_embeddings: usize,
        /// The correction range floored and ceiled to whole dimensions (transformers' default;
        /// gpt-oss's config turns it off; llama.cpp always does it).
        truncate: bool,
        attention_factor: f32,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2 always; Llama with `attention_bias`).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// What the family's block computes beyond the common one, with this checkpoint's values.
    pub block: Block,
}

/// The parts of a block that vary between families ([`crate::arch`]); the default is Llama's.
/// Tensors that only some families have (q/k norms, sandwich norms) are known by their presence
/// in [`crate::weights::LayerWeights`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub activation: Activation,
    /// The embedding rows are multiplied by this (Gemma: `sqrt(hidden_size)`).
    pub embed_scale: Option<f32>,
    /// Scale of q·k; `None`: `1/sqrt(head_dim)`.
    pub attn_scale: Option<f32>,
    /// Attention logits become `cap · tanh(logit / cap)`.
    pub attn_softcap: Option<f32>,
    /// Final logits become `cap · tanh(logit / cap)`.
    pub final_softcap: Option<f32>,
    /// Positions a sliding layer attends to, its own included.
    pub sliding_window: Option<usize>,
    /// Per layer, whether it slides (empty: none does).
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers, unscaled (Gemma 3); `None`: the model's RoPE.
    pub local_rope_theta: Option<f32>,
    /// Leading dimensions of a head that RoPE rotates; `None`: all of them.
    pub rotary_dim: Option<usize>,
    /// A mixture of experts in place of the dense MLP.
    pub moe: Option<Moe>,
    /// The gated MLP's activation is gpt-oss's clamped SwiGLU instead of [`Block::activation`].
    #[serde(default)]
    pub clamped_swiglu: Option<ClampedSwiglu>,
}

/// gpt-oss's SwiGLU: `gate = min(gate, limit)`, `up = clamp(up, −limit, limit)`,
/// `out = (up + 1) · gate · σ(alpha · gate)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClampedSwiglu {
    pub alpha: f32,
    pub limit: f32,
}

impl ClampedSwiglu {
    /// `act(gate, up)` in f32, in transformers' order of operations.
    #[inline(always)]
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        let gate = gate.min(self.limit);
        let up = up.clamp(-self.limit, self.limit);
        let glu = gate * (1.0 / (1.0 + (-(gate * self.alpha)).exp()));
        (up + 1.0) * glu
    }
}

/// A mixture of experts: per token the router picks `top_k` experts ([`Routing`]: its softmax's
/// most probable, their probabilities renormalised to sum to one where `norm_topk`; or the
/// largest logits, weighted by their own softmax), whose outputs it adds up weighted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    /// Rows of each expert's gate and up.
    pub intermediate_size: usize,
    pub norm_topk: bool,
    /// Per layer, whether its MLP is the experts (empty: every layer's is).
    pub layers: Vec<bool>,
    #[serde(default)]
    pub routing: Routing,
}

impl Moe {
    fn validate(&self, num_layers: usize) -> Result<()> {
        if self.experts == 0 || self.experts > 4096 {
            return Err(ModelError::Config(format!(
                "number of experts: {} is out of range (1..=4096)",
                self.experts
            )));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(ModelError::Config(format!(
                "experts per token: {} is out of range (1..={})",
                self.top_k, self.experts
            )));
        }
        if self.intermediate_size == 0 || self.intermediate_size > MAX_INTERMEDIATE {
            return Err(ModelError::Config(format!(
                "expert intermediate size: {} is out of range (1..={MAX_INTERMEDIATE})",
                self.intermediate_size
            )));
        }
        if !self.layers.is_empty() && self.layers.len() != num_layers {
            return Err(ModelError::Config(format!(
                "{} mixture-of-experts layer flags for {num_layers} layers",
                self.layers.len()
            )));
        }
        Ok(())
    }
}

impl Block {
    fn validate(&self, c: &ModelConfig) -> Result<()> {
        let positive = |field: &str, v: Option<f32>| -> Result<()> {
            match v {
                Some(v) if !(v.is_finite() && v > 0.0) => Err(ModelError::Config(format!(
                    "{field}: {v} is not a finite value > 0"
                ))),
                _ => Ok(()),
            }
        };
        positive("attention scale (query_pre_attn_scalar)", self.attn_scale)?;
        positive("attn_logit_softcapping", self.attn_softcap)?;
        positive("final_logit_softcapping", self.final_softcap)?;
        positive("embedding scale", self.embed_scale)?;
        if let Some(t) = self.local_rope_theta {
            if !(t.is_finite() && t > 1.0) {
                return Err(ModelError::Config(format!(
                    "local RoPE base: {t} is not a finite value > 1"
                )));
            }
        }
        if !self.sliding_layers.is_empty() && self.sliding_layers.len() != c.num_layers {
            return Err(ModelError::Config(format!(
                "{} sliding-window layer flags for {} layers",
                self.sliding_layers.len(),
                c.num_layers
            )));
        }
        if self.sliding_window == Some(0) {
            return Err(ModelError::Config("sliding_window: must be ≥ 1".into()));
        }
        if let Some(m) = &self.moe {
            m.validate(c.num_layers)?;
        }
        if let Some(s) = self.clamped_swiglu {
            positive("swiglu_limit", Some(s.limit))?;
            if !s.alpha.is_finite() {
                return Err(ModelError::Config(format!(
                    "swiglu_alpha: {} is not finite",
                    s.alpha
                )));
            }
        }
        if let Some(r) = self.rotary_dim {
            if r == 0 || r > c.head_dim || !r.is_multiple_of(2) {
                return Err(ModelError::Config(format!(
                    "rotary dimensions: {r} is not an even number in 2..={}",
                    c.head_dim
                )));
            }
        }
        Ok(())
    }

    /// The mixture of experts of layer `layer`, if its MLP is one.
    pub fn moe_at(&self, layer: usize) -> Option<&Moe> {
        self.moe
            .as_ref()
            .filter(|m| m.layers.is_empty() || m.layers.get(layer) == Some(&true))
    }

    /// Dimensions of a head that RoPE rotates.
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        self.rotary_dim.unwrap_or(head_dim)
    }

    /// Whether layer `layer` attends over a sliding window, and its width.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.sliding_layers.get(layer) {
            Some(true) => self.sliding_window,
            _ => None,
        }
    }
}

/// Upper bounds on sizes, far above any real checkpoint, so a corrupt or hostile config is rejected
/// before anything is allocated from it.
const MAX_VOCAB: usize = 1 << 22;
const MAX_HIDDEN: usize = 1 << 16;
const MAX_INTERMEDIATE: usize = 1 << 19;
const MAX_LAYERS: usize = 1024;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 1024;
const MAX_POSITIONS: usize = 1 << 24;

/// `rope_theta` when a config names none (transformers' `RotaryEmbeddingConfigMixin.default_theta`).
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

impl ModelConfig {
    /// Parses a Hugging Face `config.json` of a family the engine runs ([`crate::arch`]) and
    /// validates it.
    ///
    /// Follows transformers' defaults: `num_key_value_heads` = `num_attention_heads`, `head_dim` =
    /// `hidden_size / num_attention_heads`, `rope_theta` = 10000; `rope_theta` and the scaling may sit
    /// at the top level with a legacy `rope_scaling` (keyed `type` or `rope_type`) or in v5's
    /// `rope_parameters` (per layer type where the family has two). HF checkpoints store Q/K rows
    /// for NEOX-style RoPE, so `rope_style` is [`RopeStyle::Neox`]. Sliding windows follow
    /// `layer_types` where the config has it, else the family's pattern. A key that changes the
    /// forward pass in a way the family does not implement is an error naming it.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let obj = json
            .as_object()
            .ok_or_else(|| ModelError::Config("config.json is not a JSON object".into()))?;
        let fields = HfFields(obj);

        let family = fields.family()?;
        family.check_unread_keys(obj)?;
        let activation = family.activation(fields.string(family.act_key)?)?;
        if fields.bool("mlp_bias")?.unwrap_or(false) {
            return Err(ModelError::Unsupported(
                "config mlp_bias: true (MLP biases)".into(),
            ));
        }

        let hidden_size = fields.required_usize("hidden_size")?;
        let num_heads = fields.required_usize("num_attention_heads")?;
        let num_kv_heads = fields.usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match fields.usize("head_dim")? {
            Some(d) => d,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(ModelError::Config(format!(
                        "hidden_size ({hidden_size}) is not divisible by num_attention_heads \
                         ({num_heads}) and there is no head_dim"
                    )));
                }
                hidden_size / num_heads
            }
        };
        let num_layers = fields.required_usize("num_hidden_layers")?;
        let (sliding_window, sliding_layers) = fields.sliding(family, num_layers)?;
        let ((rope_theta, rope_scaling), local_rope) = fields.rope(family)?;
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(ids)) => ids
                .iter()
                .map(|v| token_id("eos_token_id", v))
                .collect::<Result<_>>()?,
            Some(v) => vec![token_id("eos_token_id", v)?],
        };
        let bos_token_id = match obj.get("bos_token_id") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(token_id("bos_token_id", v)?),
        };
        let softcap = |key: &str| -> Result<Option<f32>> {
            match family.softcap {
                true => Ok(fields.f64(key)?.map(|v| v as f32)),
                false => Ok(None),
            }
        };
        // v5 keeps the factor in `rope_parameters`.
        let partial = match fields.f64("partial_rotary_factor")? {
            Some(f) => Some(f),
            None => match fields.get("rope_parameters").and_then(|p| p.as_object()) {
                Some(p) => HfFields(p)
                    .f64("partial_rotary_factor")
                    .map_err(|e| ModelError::Config(format!("rope_parameters.{e}")))?,
                None => None,
            },
        };
        if !family.partial_rotary && partial.is_some_and(|f| f != 1.0) {
            return Err(ModelError::Unsupported(format!(
                "config partial_rotary_factor: {} in a {} model",
                partial.unwrap_or(1.0),
                family.name
            )));
        }
        let rotary_dim = match (family.partial_rotary, partial) {
            (true, Some(f)) if f != 1.0 => {
                if !(f > 0.0 && f <= 1.0) {
                    return Err(ModelError::Config(format!(
                        "partial_rotary_factor: {f} is not in (0, 1]"
                    )));
                }
                Some((head_dim as f64 * f) as usize)
            }
            _ => None,
        };

        let config = ModelConfig {
            arch: family.arch,
            vocab_size: fields.required_usize("vocab_size")?,
            hidden_size,
            intermediate_size: fields.required_usize("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: fields.required_usize("max_position_embeddings")?,
            rms_norm_eps: fields.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: fields.bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: match family.qkv_bias {
                crate::arch::QkvBias::Always => true,
                crate::arch::QkvBias::Never => false,
                crate::arch::QkvBias::FromConfig => fields.bool("attention_bias")?.unwrap_or(false),
            },
            bos_token_id,
            eos_token_ids,
            block: Block {
                activation,
                embed_scale: family
                    .embed_scale
                    .then(|| (hidden_size as f64).sqrt() as f32),
                // transformers' Gemma configs default to 256.
                attn_scale: match family.query_pre_attn_scalar {
                    true => Some(
                        (1.0 / fields.f64("query_pre_attn_scalar")?.unwrap_or(256.0).sqrt()) as f32,
                    ),
                    false => None,
                },
                attn_softcap: softcap("attn_logit_softcapping")?,
                final_softcap: softcap("final_logit_softcapping")?,
                sliding_window,
                sliding_layers,
                local_rope_theta: local_rope.map(|t| t as f32),
                rotary_dim,
                moe: fields.moe(family, num_layers)?,
                // transformers' GptOssConfig defaults.
                clamped_swiglu: match family.clamped_swiglu {
                    true => Some(ClampedSwiglu {
                        alpha: fields.f64("swiglu_alpha")?.unwrap_or(1.702) as f32,
                        limit: fields.f64("swiglu_limit")?.unwrap_or(7.0) as f32,
                    }),
                    false => None,
                },
            },
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that every size is non-zero, plausible and consistent with the others; errors name the
    /// field. Loaders call this on configs they build (e.g. from GGUF metadata).
    pub fn validate(&self) -> Result<()> {
        let bounded = |field: &str, value: usize, max: usize| -> Result<()> {
            if value == 0 || value > max {
                return Err(ModelError::Config(format!(
                    "{field}: {value} is out of range (1..={max})"
                )));
            }
            Ok(())
        };
        bounded("vocab_size", self.vocab_size, MAX_VOCAB)?;
        bounded("hidden_size", self.hidden_size, MAX_HIDDEN)?;
        bounded(
            "intermediate_size",
            self.intermediate_size,
            MAX_INTERMEDIATE,
        )?;
        bounded("num_layers", self.num_layers, MAX_LAYERS)?;
        bounded("num_heads", self.num_heads, MAX_HEADS)?;
        bounded("num_kv_heads", self.num_kv_heads, self.num_heads)?;
        bounded("head_dim", self.head_dim, MAX_HEAD_DIM)?;
        bounded(
            "max_position_embeddings",
            self.max_position_embeddings,
            MAX_POSITIONS,
        )?;
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(ModelError::Config(format!(
                "num_heads ({}) is not a multiple of num_kv_heads ({})",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim: {} is odd (RoPE rotates pairs)",
                self.head_dim
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return Err(ModelError::Config(format!(
                "rms_norm_eps: {} is not in (0, 1)",
                self.rms_norm_eps
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(ModelError::Config(format!(
                "rope_theta: {} is not a finite value > 1",
                self.rope_theta
            )));
        }
        self.rope_scaling.validate()?;
        self.block.validate(self)?;
        for &id in self.eos_token_ids.iter().chain(self.bos_token_id.iter()) {
            if id as usize >= self.vocab_size {
                return Err(ModelError::Config(format!(
                    "bos/eos token id {id} is outside the vocabulary ({})",
                    self.vocab_size
                )));
            }
        }
        Ok(())
    }

    /// Width of the query projection output (`num_heads · head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key and value projection outputs (`num_kv_heads · head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

impl RopeScaling {
    fn validate(&self) -> Result<()> {
        let positive = |field: &str, v: f32| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ModelError::Config(format!(
                    "rope_scaling.{field}: {v} is not a finite value > 0"
                )))
            }
        };
        match *self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(ModelError::Config(format!(
                        "rope_scaling.high_freq_factor ({high_freq_factor}) must exceed \
                         low_freq_factor ({low_freq_factor})"
                    )));
                }
                if original_max_position_embeddings == 0
                    || original_max_position_embeddings > MAX_POSITIONS
                {
                    return Err(ModelError::Config(format!(
                        "rope_scaling.original_max_position_embeddings: \
                         {original_max_position_embeddings} is out of range (1..={MAX_POSITIONS})"
                    )));
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate: _,
                attention_factor,
            } => {
                positive("factor", factor)?;
                positive("beta_fast", beta_fast)?;
                positive("beta_slow", beta_slow)?;
                positive("attention_factor", attention_factor)?;
                if original_max_position_embeddings == 0
                    || original_max_position_embeddings > MAX_POSITIONS
                {
                    return Err(ModelError::Config(format!(
                        "rope_scaling.original_max_position_embeddings: \
                         {original_max_position_embeddings} is out of range (1..={MAX_POSITIONS})"
                    )));
                }
                Ok(())
            }
        }
    }
}

/// YaRN's attention factor of a scaling `factor` (`0.1·mscale·ln(factor) + 1`, 1 for factors up
/// to 1; transformers' `yarn_get_mscale`, llama.cpp's `get_mscale`).
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * factor.ln() + 1.0,
    }
}

fn token_id(field: &str, v: &serde_json::Value) -> Result<u32> {
    v.as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| ModelError::Config(format!("{field}: {v} is not a token id")))
}

/// Typed access to the fields of a `config.json` object; a present field of the wrong type is an
/// error naming it, an absent or `null` one is `None`.
struct HfFields<'a>(&'a serde_json::Map<String, serde_json::Value>);

impl HfFields<'_> {
    fn get(&self, field: &str) -> Option<&serde_json::Value> {
        self.0.get(field).filter(|v| !v.is_null())
    }

    fn usize(&self, field: &str) -> Result<Option<usize>> {
        self.get(field)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        ModelError::Config(format!("{field}: {v} is not a non-negative integer"))
                    })
            })
            .transpose()
    }

    fn required_usize(&self, field: &str) -> Result<usize> {
        self.usize(field)?
            .ok_or_else(|| ModelError::Config(format!("{field}: missing")))
    }

    fn f64(&self, field: &str) -> Result<Option<f64>> {
        self.get(field)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| ModelError::Config(format!("{field}: {v} is not a number")))
            })
            .transpose()
    }

    fn bool(&self, field: &str) -> Result<Option<bool>> {
        self.get(field)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| ModelError::Config(format!("{field}: {v} is not a boolean")))
            })
            .transpose()
    }

    fn string(&self, field: &str) -> Result<Option<&str>> {
        self.get(field)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| ModelError::Config(format!("{field}: {v} is not a string")))
            })
            .transpose()
    }

    /// The family from `architectures[0]`, else from `model_type`.
    fn family(&self) -> Result<&'static Family> {
        if let Some(list) = self.get("architectures") {
            let name = list
                .as_array()
                .and_then(|a| a.first())
                .and_then(|v| v.as_str())
                .ok_or_else(|| {
                    ModelError::Config(format!("architectures: {list} is not a list of names"))
                })?;
            return Family::from_hf_architecture(name);
        }
        match self.string("model_type")? {
            Some(t) => Family::from_hf_model_type(t),
            None => Err(ModelError::Config(
                "architectures and model_type: both missing".into(),
            )),
        }
    }

    /// The mixture of experts, where the family has one: its size, experts per token and which
    /// layers have it (Qwen's `decoder_sparse_step` and `mlp_only_layers`).
    fn moe(&self, family: &Family, num_layers: usize) -> Result<Option<Moe>> {
        let Some(spec) = &family.moe else {
            return Ok(None);
        };
        let mut experts = None;
        for key in spec.experts_keys {
            if let Some(n) = self.usize(key)? {
                experts = Some(n);
                break;
            }
        }
        let experts = experts.ok_or_else(|| {
            ModelError::Config(format!("{}: missing", spec.experts_keys.join(" or ")))
        })?;
        let layers = match spec.sparse_layers {
            true => {
                let step = self.usize("decoder_sparse_step")?.unwrap_or(1);
                if step == 0 {
                    return Err(ModelError::Config(
                        "decoder_sparse_step: must be ≥ 1".into(),
                    ));
                }
                let dense: Vec<usize> = match self.get("mlp_only_layers") {
                    None => Vec::new(),
                    Some(v) => v
                        .as_array()
                        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                        .ok_or_else(|| {
                            ModelError::Config(format!(
                                "mlp_only_layers: {v} is not a list of layers"
                            ))
                        })?,
                };
                (0..num_layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect()
            }
            false => Vec::new(),
        };
        Ok(Some(Moe {
            routing: spec.routing,
            experts,
            top_k: self.required_usize("num_experts_per_tok")?,
            intermediate_size: self.required_usize(spec.intermediate_key)?,
            norm_topk: match spec.norm_topk_key {
                Some(k) => self.bool(k)?.unwrap_or(false),
                None => true,
            },
            layers,
        }))
    }

    /// The sliding window and which layers use it: `layer_types` where the config has it, else
    /// the family's rule.
    fn sliding(&self, family: &Family, num_layers: usize) -> Result<(Option<usize>, Vec<bool>)> {
        if family.sliding == Sliding::Never {
            return Ok((None, Vec::new()));
        }
        let window = self.usize("sliding_window")?;
        let on = match family.sliding_switch {
            true => self.bool("use_sliding_window")?.unwrap_or(false),
            false => window.is_some(),
        };
        let Some(window) = window.filter(|_| on) else {
            return Ok((None, Vec::new()));
        };
        if window == 0 {
            return Err(ModelError::Config("sliding_window: must be ≥ 1".into()));
        }
        let layers = match self.get("layer_types") {
            Some(list) => {
                let names = list.as_array().ok_or_else(|| {
                    ModelError::Config(format!("layer_types: {list} is not a list"))
                })?;
                if names.len() != num_layers {
                    return Err(ModelError::Config(format!(
                        "layer_types: {} entries for {num_layers} layers",
                        names.len()
                    )));
                }
                names
                    .iter()
                    .map(|n| match n.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(ModelError::Unsupported(format!(
                            "config layer_types: {n} (sliding_attention and full_attention are \
                             supported)"
                        ))),
                    })
                    .collect::<Result<Vec<bool>>>()?
            }
            None => match family.sliding {
                Sliding::Pattern(n) => crate::arch::sliding_pattern(
                    self.usize("sliding_window_pattern")?.unwrap_or(n),
                    num_layers,
                ),
                // transformers' Qwen2/Qwen3: layers from `max_window_layers` on slide.
                _ if family.sliding_switch => {
                    let from = self.usize("max_window_layers")?.unwrap_or(28);
                    (0..num_layers).map(|i| i >= from).collect()
                }
                _ => vec![true; num_layers],
            },
        };
        Ok((Some(window), layers))
    }

    /// `rope_theta` and the frequency scaling, from v5 `rope_parameters` or the legacy top-level
    /// `rope_theta` + `rope_scaling`.
    /// With the sliding layers' own RoPE base where the family has one: v5's
    /// `rope_parameters.sliding_attention` (nested beside `full_attention`), else
    /// `rope_local_base_freq`, else the family's default.
    #[allow(clippy::type_complexity)]
    fn rope(&self, family: &Family) -> Result<((f64, RopeScaling), Option<f64>)> {
        let nested = self
            .get("rope_parameters")
            .and_then(|p| p.as_object())
            .filter(|p| p.contains_key("full_attention"));
        let Some(nested) = nested else {
            let (section, params) = match self.get("rope_parameters") {
                Some(p) => ("rope_parameters", Some(p)),
                None => ("rope_scaling", self.get("rope_scaling")),
            };
            let local = match family.local_rope_base {
                Some(default) => Some(self.f64("rope_local_base_freq")?.unwrap_or(default)),
                None => None,
            };
            return Ok((self.rope_section(section, params)?, local));
        };
        let global = self.rope_section(
            "rope_parameters.full_attention",
            nested.get("full_attention"),
        )?;
        let local = match nested.get("sliding_attention") {
            None => None,
            Some(p) => {
                let (theta, scaling) =
                    self.rope_section("rope_parameters.sliding_attention", Some(p))?;
                if scaling != RopeScaling::None {
                    return Err(ModelError::Unsupported(
                        "config rope_parameters.sliding_attention: RoPE scaling on sliding \
                         layers"
                            .into(),
                    ));
                }
                Some(theta)
            }
        };
        if local.is_some() && family.local_rope_base.is_none() {
            return Err(ModelError::Unsupported(format!(
                "config rope_parameters.sliding_attention: a RoPE of its own on the sliding \
                 layers of a {} model",
                family.name
            )));
        }
        Ok((global, local))
    }

    /// `rope_theta` and the scaling of one section (`rope_scaling`, `rope_parameters` or one of
    /// its layer types); the theta falls back to the top-level `rope_theta`.
    fn rope_section(
        &self,
        section: &str,
        params: Option<&serde_json::Value>,
    ) -> Result<(f64, RopeScaling)> {
        let params = params
            .map(|p| {
                p.as_object()
                    .map(HfFields)
                    .ok_or_else(|| ModelError::Config(format!("{section}: {p} is not an object")))
            })
            .transpose()?;
        let named = |e: ModelError| match e {
            ModelError::Config(msg) => ModelError::Config(format!("{section}.{msg}")),
            other => other,
        };
        let theta = match params
            .as_ref()
            .map(|p| p.f64("rope_theta"))
            .transpose()
            .map_err(named)?
        {
            Some(Some(theta)) => theta,
            _ => self.f64("rope_theta")?.unwrap_or(DEFAULT_ROPE_THETA),
        };
        let Some(params) = params else {
            return Ok((theta, RopeScaling::None));
        };
        let rope_type = match params.string("rope_type").map_err(named)? {
            Some(t) => Some(t),
            None => params.string("type").map_err(named)?,
        };
        let factor = || -> Result<f32> {
            params
                .f64("factor")?
                .map(|f| f as f32)
                .ok_or_else(|| ModelError::Config("factor: missing".into()))
        };
        let scaling = match rope_type.unwrap_or("default") {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: factor().map_err(named)?,
            },
            "llama3" => {
                let required_f32 = |field: &str| -> Result<f32> {
                    params
                        .f64(field)?
                        .map(|f| f as f32)
                        .ok_or_else(|| ModelError::Config(format!("{field}: missing")))
                };
                RopeScaling::Llama3 {
                    factor: factor().map_err(named)?,
                    low_freq_factor: required_f32("low_freq_factor").map_err(named)?,
                    high_freq_factor: required_f32("high_freq_factor").map_err(named)?,
                    original_max_position_embeddings: params
                        .required_usize("original_max_position_embeddings")
                        .map_err(named)?,
                }
            }
            "yarn" => {
                // transformers' _compute_yarn_parameters, its defaults included.
                let original = params
                    .required_usize("original_max_position_embeddings")
                    .map_err(named)?;
                let factor = match params.f64("factor").map_err(named)? {
                    Some(f) => f,
                    None => {
                        self.required_usize("max_position_embeddings")? as f64 / original as f64
                    }
                };
                let beta = |field: &str, default: f64| -> Result<f32> {
                    // `or`: 0 counts as unset there.
                    Ok(match params.f64(field).map_err(named)? {
                        Some(b) if b != 0.0 => b as f32,
                        _ => default as f32,
                    })
                };
                let attention_factor = match params.f64("attention_factor").map_err(named)? {
                    Some(a) => a,
                    None => {
                        let m = params.f64("mscale").map_err(named)?.filter(|&m| m != 0.0);
                        let all = params
                            .f64("mscale_all_dim")
                            .map_err(named)?
                            .filter(|&m| m != 0.0);
                        match (m, all) {
                            (Some(m), Some(all)) => {
                                yarn_mscale(factor, m) / yarn_mscale(factor, all)
                            }
                            _ => yarn_mscale(factor, 1.0),
                        }
                    }
                };
                RopeScaling::Yarn {
                    factor: factor as f32,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    original_max_position_embeddings: original,
                    truncate: params.bool("truncate").map_err(named)?.unwrap_or(true),
                    attention_factor: attention_factor as f32,
                }
            }
            other => {
                return Err(ModelError::Unsupported(format!(
                    "config {section}.rope_type: {other:?} (default, linear, llama3, yarn are \
                     supported)"
                )))
            }
        };
        Ok((theta, scaling))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_135M: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
      "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": true,
      "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
      "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05, "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
      "use_cache": true, "vocab_size": 49152}"#;

    const LLAMA_31_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
      "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
      "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
      "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "vocab_size": 128256}"#;

    const QWEN25_05B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
      "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
      "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936}"#;

    const MISTRAL_7B_V01: &str = r#"{
      "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
      "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16", "vocab_size": 32000}"#;

    /// Edits a config: sets (or with `null`, removes) top-level fields.
    fn edited(base: &str, edits: &[(&str, serde_json::Value)]) -> String {
        let mut v: serde_json::Value = serde_json::from_str(base).unwrap();
        let obj = v.as_object_mut().unwrap();
        for (k, val) in edits {
            if val.is_null() {
                obj.remove(*k);
            } else {
                obj.insert(k.to_string(), val.clone());
            }
        }
        v.to_string()
    }

    fn config_error(text: &str) -> String {
        match ModelConfig::from_hf_json(text) {
            Err(ModelError::Config(msg)) => msg,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    /// openai/gpt-oss-20b's config.json with 4 of its 24 layers.
    const GPT_OSS_20B: &str = r#"{
      "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
      "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
      "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
      "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention",
      "sliding_attention", "full_attention"], "max_position_embeddings": 131072,
      "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
      "num_hidden_layers": 4, "num_key_value_heads": 8, "num_local_experts": 32,
      "output_router_logits": false, "pad_token_id": 199999,
      "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
        "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
      "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
        "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
        "truncate": false},
      "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
      "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
      "use_cache": true, "vocab_size": 201088}"#;

    #[test]
    fn gpt_oss_config() {
        let c = ModelConfig::from_hf_json(GPT_OSS_20B).unwrap();
        assert_eq!(c.arch, Arch::GptOss);
        assert!(c.attention_bias);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096,
                truncate: false,
                attention_factor: (0.1 * 32f64.ln() + 1.0) as f32,
            }
        );
        assert_eq!(c.block.sliding_window, Some(128));
        assert_eq!(c.block.sliding_layers, [true, false, true, false]);
        let moe = c.block.moe.as_ref().unwrap();
        assert_eq!(
            (moe.experts, moe.top_k, moe.intermediate_size),
            (32, 4, 2880)
        );
        assert_eq!(moe.routing, Routing::TopKSoftmax);
        assert_eq!(
            c.block.clamped_swiglu,
            Some(ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            })
        );
        // transformers' YaRN defaults: truncated, the attention factor from the factor; the
        // mscale pair of DeepSeek's configs divides.
        let yarn = |params: serde_json::Value| {
            ModelConfig::from_hf_json(&edited(LLAMA_31_8B, &[("rope_scaling", params)]))
                .unwrap()
                .rope_scaling
        };
        let RopeScaling::Yarn {
            truncate,
            attention_factor,
            factor,
            ..
        } = yarn(serde_json::json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}))
        else {
            panic!("not YaRN")
        };
        assert!(truncate);
        assert_eq!(factor, 4.0);
        assert!((attention_factor as f64 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6);
        let RopeScaling::Yarn {
            attention_factor, ..
        } = yarn(
            serde_json::json!({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
        )
        else {
            panic!("not YaRN")
        };
        assert_eq!(attention_factor, 1.0);
        assert!(ModelConfig::from_hf_json(&edited(
            LLAMA_31_8B,
            &[(
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn", "factor": 4.0})
            )]
        ))
        .is_err());
    }

    #[test]
    fn clamped_swiglu_clamps_as_transformers() {
        let s = ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        };
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        for (g, u) in [(0.5f32, -0.25f32), (10.0, 9.0), (-10.0, -9.0), (8.0, -20.0)] {
            let (gc, uc) = ((g as f64).min(7.0), (u as f64).clamp(-7.0, 7.0));
            let want = (uc + 1.0) * gc * sigmoid(1.702 * gc);
            assert!((s.apply(g, u) as f64 - want).abs() < 1e-5, "{g} {u}");
        }
    }

    #[test]
    fn smollm2_config() {
        let c = ModelConfig::from_hf_json(SMOLLM2_135M).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(
            (
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                c.num_layers
            ),
            (49152, 576, 1536, 30)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
        assert_eq!(c.max_position_embeddings, 8192);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert_eq!(c.rope_style, RopeStyle::Neox);
        assert!(c.tie_word_embeddings);
        assert!(!c.attention_bias);
        assert_eq!(
            (c.bos_token_id, c.eos_token_ids.clone()),
            (Some(1), vec![2])
        );
        assert_eq!((c.q_dim(), c.kv_dim()), (576, 192));
    }

    #[test]
    fn llama31_config_with_llama3_rope_and_eos_list() {
        let c = ModelConfig::from_hf_json(LLAMA_31_8B).unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            }
        );
        assert!(!c.tie_word_embeddings);
        assert_eq!((c.num_kv_heads, c.head_dim), (8, 128));
    }

    #[test]
    fn qwen2_always_has_qkv_bias() {
        let c = ModelConfig::from_hf_json(QWEN25_05B).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.attention_bias);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (14, 2, 64));
        assert_eq!(c.rope_theta, 1e6);
        // use_sliding_window is false: the window does not limit the context.
        assert_eq!(c.max_position_embeddings, 32768);
        assert_eq!(c.bos_token_id, Some(151643));
    }

    #[test]
    fn mistral_slides_every_layer() {
        let c = ModelConfig::from_hf_json(MISTRAL_7B_V01).unwrap();
        assert_eq!(c.arch, Arch::Mistral);
        assert_eq!(c.max_position_embeddings, 32768);
        assert_eq!(c.block.sliding_window, Some(4096));
        assert_eq!(c.block.sliding_layers, vec![true; 32]);
        assert_eq!(
            (c.block.window(0), c.block.window(31)),
            (Some(4096), Some(4096))
        );
        let no_window = edited(
            MISTRAL_7B_V01,
            &[("sliding_window", serde_json::Value::Null)],
        );
        let c = ModelConfig::from_hf_json(&no_window).unwrap();
        assert_eq!((c.block.sliding_window, c.block.window(0)), (None, None));
    }

    #[test]
    fn qwen2_slides_from_max_window_layers_when_switched_on() {
        use serde_json::json;
        let on = edited(
            QWEN25_05B,
            &[
                ("use_sliding_window", json!(true)),
                ("sliding_window", json!(512)),
                ("max_window_layers", json!(20)),
            ],
        );
        let c = ModelConfig::from_hf_json(&on).unwrap();
        assert_eq!((c.block.window(19), c.block.window(20)), (None, Some(512)));
        let types = edited(
            &on,
            &[("layer_types", json!(vec!["sliding_attention"; 24]))],
        );
        let c = ModelConfig::from_hf_json(&types).unwrap();
        assert_eq!(c.block.window(0), Some(512));
        let bad = edited(
            &on,
            &[("layer_types", json!(vec!["chunked_attention"; 24]))],
        );
        assert!(matches!(
            ModelConfig::from_hf_json(&bad),
            Err(ModelError::Unsupported(m)) if m.contains("layer_types")
        ));
        let short = edited(&on, &[("layer_types", json!(vec!["full_attention"; 3]))]);
        assert!(config_error(&short).contains("layer_types: 3 entries for 24 layers"));
    }

    #[test]
    fn gemma3_reads_its_block() {
        let text = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 7,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
          "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
          "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 512,
          "final_logit_softcapping": null, "attn_logit_softcapping": null,
          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "vocab_size": 262144}"#;
        let c = ModelConfig::from_hf_json(text).unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(c.block.activation, Activation::GeluTanh);
        assert_eq!(c.block.embed_scale, Some(640f64.sqrt() as f32));
        assert_eq!(c.block.attn_scale, Some(1.0 / 16.0));
        assert_eq!((c.block.attn_softcap, c.block.final_softcap), (None, None));
        assert_eq!(
            c.block.sliding_layers,
            [true, true, true, true, true, false, true]
        );
        assert_eq!(c.block.local_rope_theta, Some(10000.0));
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        // A key Gemma 3 does not read, set: refused, named.
        let softcapped = edited(text, &[("use_qk_norm", true.into())]);
        assert!(matches!(
            ModelConfig::from_hf_json(&softcapped),
            Err(ModelError::Unsupported(m)) if m.contains("use_qk_norm")
        ));
    }

    #[test]
    fn defaults_for_absent_fields() {
        use serde_json::json;
        let text = edited(
            SMOLLM2_135M,
            &[
                ("num_key_value_heads", json!(null)),
                ("rope_theta", json!(null)),
                ("rope_scaling", json!(null)),
                ("eos_token_id", json!(null)),
                ("bos_token_id", json!(null)),
                ("tie_word_embeddings", json!(null)),
                ("architectures", json!(null)),
            ],
        );
        let c = ModelConfig::from_hf_json(&text).unwrap();
        assert_eq!(c.arch, Arch::Llama); // from model_type
        assert_eq!(c.num_kv_heads, 9);
        assert_eq!(c.rope_theta, 10000.0);
        assert!(c.eos_token_ids.is_empty());
        assert_eq!(c.bos_token_id, None);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn explicit_head_dim_need_not_divide_hidden() {
        // Mistral-Nemo: hidden 5120, 32 heads of 128.
        let text = edited(
            MISTRAL_7B_V01,
            &[("hidden_size", 5120.into()), ("head_dim", 128.into())],
        );
        let c = ModelConfig::from_hf_json(&text).unwrap();
        assert_eq!((c.hidden_size, c.head_dim, c.q_dim()), (5120, 128, 4096));
    }

    #[test]
    fn rope_variants() {
        use serde_json::json;
        let legacy_linear = edited(
            SMOLLM2_135M,
            &[("rope_scaling", json!({"type": "linear", "factor": 4.0}))],
        );
        let c = ModelConfig::from_hf_json(&legacy_linear).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 4.0 });

        let v5 = edited(
            LLAMA_31_8B,
            &[
                ("rope_scaling", json!(null)),
                ("rope_theta", json!(null)),
                (
                    "rope_parameters",
                    json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}),
                ),
            ],
        );
        assert_eq!(
            ModelConfig::from_hf_json(&v5).unwrap(),
            ModelConfig::from_hf_json(LLAMA_31_8B).unwrap()
        );

        let v5_default = edited(
            SMOLLM2_135M,
            &[
                ("rope_theta", json!(null)),
                (
                    "rope_parameters",
                    json!({"rope_type": "default", "rope_theta": 1234.0}),
                ),
            ],
        );
        let c = ModelConfig::from_hf_json(&v5_default).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1234.0, RopeScaling::None));

        let dynamic = edited(
            QWEN25_05B,
            &[("rope_scaling", json!({"type": "dynamic", "factor": 4.0}))],
        );
        match ModelConfig::from_hf_json(&dynamic) {
            Err(ModelError::Unsupported(msg)) => assert!(msg.contains("dynamic"), "{msg}"),
            other => panic!("expected unsupported, got {other:?}"),
        }

        let missing_low = edited(
            LLAMA_31_8B,
            &[(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}),
            )],
        );
        let msg = config_error(&missing_low);
        assert!(msg.contains("rope_scaling.low_freq_factor"), "{msg}");

        let inverted = edited(
            LLAMA_31_8B,
            &[(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
            )],
        );
        assert!(config_error(&inverted).contains("high_freq_factor"));
    }

    #[test]
    fn bad_configs_name_the_field() {
        use serde_json::json;
        let cases: &[(&[(&str, serde_json::Value)], &str)] = &[
            (
                &[("architectures", json!(["GPT2LMHeadModel"]))],
                "architectures",
            ),
            (
                &[
                    ("architectures", json!(null)),
                    ("model_type", json!("gpt2")),
                ],
                "model_type",
            ),
            (&[("hidden_size", json!(null))], "hidden_size: missing"),
            (&[("vocab_size", json!(0))], "vocab_size"),
            (&[("num_hidden_layers", json!(-3))], "num_hidden_layers"),
            (&[("intermediate_size", json!("big"))], "intermediate_size"),
            (
                &[("num_attention_heads", json!(7))],
                "not divisible by num_attention_heads",
            ),
            (&[("num_key_value_heads", json!(2))], "num_kv_heads (2)"),
            (&[("num_key_value_heads", json!(18))], "num_kv_heads"),
            (&[("hidden_size", json!(1u64 << 40))], "hidden_size"),
            (&[("vocab_size", json!(1u64 << 30))], "vocab_size"),
            (&[("rms_norm_eps", json!(0.0))], "rms_norm_eps"),
            (&[("rope_theta", json!(-1.0))], "rope_theta"),
            (&[("eos_token_id", json!(49152))], "token id 49152"),
            (&[("eos_token_id", json!([2, "x"]))], "eos_token_id"),
            (&[("head_dim", json!(63))], "head_dim"),
            (
                &[("tie_word_embeddings", json!("yes"))],
                "tie_word_embeddings",
            ),
        ];
        for (edits, needle) in cases {
            let msg = config_error(&edited(SMOLLM2_135M, edits));
            assert!(
                msg.contains(needle),
                "{edits:?}: {msg:?} should name {needle:?}"
            );
        }
        assert!(config_error("[1, 2]").contains("not a JSON object"));
        assert!(config_error("{").contains("not valid JSON"));
    }

    #[test]
    fn unsupported_activation_and_mlp_bias() {
        use serde_json::json;
        for edits in [[("hidden_act", json!("gelu"))], [("mlp_bias", json!(true))]] {
            assert!(matches!(
                ModelConfig::from_hf_json(&edited(SMOLLM2_135M, &edits)),
                Err(ModelError::Unsupported(_))
            ));
        }
    }
}
