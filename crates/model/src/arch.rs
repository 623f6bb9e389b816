//! Model families as data. A [`Family`] says what a decoder-only family is: how its checkpoints
//! name their tensors (Hugging Face and GGUF), which config keys it reads, and what its block
//! computes beyond the common one (pre-norm attention with RoPE and GQA, then a gated MLP): q/k
//! norms, sandwich norms, the MLP's activation, embedding scaling, soft-capping, sliding windows,
//! attention sinks, fused tensors split at load, a mixture of experts (its routing, its biases,
//! experts stacked per layer in a GGUF or fused in an HF checkpoint). Loaders, the engines and the launch list ask the family; adding a
//! dense family is one row of [`FAMILIES`] (plus its config reading where it has keys of its own)
//! and its tests. docs/families.md has the steps.

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};

/// The families the engine runs; [`Arch::family`] is each one's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Mixtral,
    Qwen3Moe,
    GptOss,
}

/// A tensor of a layer (or of the model), by what the block does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm,
    Q,
    K,
    V,
    /// q, k and v stacked by rows in one tensor (split at load).
    Qkv,
    QNorm,
    KNorm,
    O,
    PostAttnNorm,
    MlpNorm,
    Gate,
    Up,
    /// gate and up stacked by rows in one tensor (split at load).
    GateUp,
    Down,
    PostMlpNorm,
    /// A mixture of experts' router (`[experts, hidden]`).
    Router,
    /// A learned logit per head joined to the attention's softmax denominator (gpt-oss).
    Sinks,
    /// Expert matrices ([`MoeSpec::experts`]).
    ExpertGate,
    ExpertUp,
    ExpertDown,
}

/// The MLP's activation of the gate (`act(gate) · up`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU: `x·σ(x)`.
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The activation an HF `hidden_act` / `hidden_activation` names.
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" => Some(Activation::GeluTanh),
            _ => None,
        }
    }

    /// `act(x)` in f32, as PyTorch computes it.
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }
}

/// Whether q/k/v carry biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvBias {
    Never,
    Always,
    /// As the HF config's `attention_bias` says (GGUF: as the file has them).
    FromConfig,
}

/// Which layers attend over a sliding window, when the config sets one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sliding {
    /// No window (a `sliding_window` key is ignored, as the family's reference code does).
    Never,
    /// Every layer, when `sliding_window` is set (HF; `use_sliding_window` where the family has
    /// that switch).
    Every,
    /// Every n-th layer (the last of each group of n) attends globally, the others over the window
    /// (Gemma: n = 2 and 6); HF `layer_types` or GGUF `attention.sliding_window_pattern` override.
    Pattern(usize),
}

/// One model family.
pub struct Family {
    pub arch: Arch,
    /// Name in messages and docs (`gemma3`).
    pub name: &'static str,
    /// HF `architectures[0]` values.
    pub hf_architectures: &'static [&'static str],
    /// HF `model_type` values.
    pub hf_model_types: &'static [&'static str],
    /// GGUF `general.architecture` values.
    pub gguf_archs: &'static [&'static str],
    /// Layer tensors: role, HF module (under `model.layers.N.`), GGUF module (under `blk.N.`).
    pub layer_tensors: &'static [(Role, &'static str, &'static str)],
    /// RMSNorm of each head of q and of k before RoPE ([`QK_NORM_TENSORS`]).
    pub qk_norm: bool,
    pub qkv_bias: QkvBias,
    /// RMSNorm weights multiply as `1 + w` in HF checkpoints (Gemma); llama.cpp's converter adds
    /// the 1 to GGUF files.
    pub hf_norm_plus_one: bool,
    /// The embedding output is multiplied by `sqrt(hidden_size)`.
    pub embed_scale: bool,
    /// The HF config key that names the activation, and the default.
    pub act_key: &'static str,
    pub act_default: Activation,
    pub sliding: Sliding,
    /// HF config's `use_sliding_window` switches the window on (Qwen2).
    pub sliding_switch: bool,
    /// llama.cpp permutes this family's Q/K rows for its interleaved RoPE (formats.md §1.8).
    pub gguf_qk_permuted: bool,
    /// Soft-capping of attention logits and final logits (config / GGUF keys).
    pub softcap: bool,
    /// The attention's query scale is `query_pre_attn_scalar^-½` (Gemma).
    pub query_pre_attn_scalar: bool,
    /// Sliding layers rotate with their own RoPE base, unscaled (Gemma 3: HF
    /// `rope_local_base_freq`, GGUF `rope.freq_base_swa`, default 10000).
    pub local_rope_base: Option<f64>,
    /// `partial_rotary_factor` (HF) / `rope.dimension_count` (GGUF) may rotate part of a head.
    pub partial_rotary: bool,
    /// A mixture of experts in place of the dense MLP.
    pub moe: Option<MoeSpec>,
    /// The gated MLP's activation is gpt-oss's clamped SwiGLU (HF `swiglu_limit`, `swiglu_alpha`).
    pub clamped_swiglu: bool,
}

/// How a family's mixture of experts is named and configured.
pub struct MoeSpec {
    /// HF config keys of the number of experts (the first present counts; transformers 5 writes
    /// Qwen3-MoE's as `num_local_experts`, its checkpoints have `num_experts`) and of an expert's
    /// intermediate size.
    pub experts_keys: &'static [&'static str],
    pub intermediate_key: &'static str,
    /// The HF key that switches renormalising the picked experts' weights; `None`: always.
    pub norm_topk_key: Option<&'static str>,
    /// Which layers have experts follows `decoder_sparse_step` and `mlp_only_layers` (Qwen); the
    /// others keep a dense MLP (GGUF: the layers with a router).
    pub sparse_layers: bool,
    /// HF module of the router, GGUF module of it.
    pub router: (&'static str, &'static str),
    /// Expert `{}`'s gate, up and down: HF module templates; GGUF modules of the tensors that
    /// stack every expert's (`[experts, rows, cols]`).
    pub experts: [(Role, &'static str, &'static str); 3],
    /// How the router's logits pick and weigh the experts.
    pub routing: Routing,
    /// The router and every expert matrix carry biases (`….bias`; GGUF: stacked per expert like
    /// the matrices, `[experts, rows]`).
    pub biases: bool,
    /// HF checkpoints hold each layer's experts in two tensors rather than one per expert (the
    /// templates above then name what a GGUF's stacks hold, expert by expert).
    pub hf_fused: Option<FusedExperts>,
}

/// How a router's logits become the experts' weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Softmax over all experts, then the `top_k` most probable (renormalised where the config
    /// says): Mixtral, Qwen-MoE.
    #[default]
    SoftmaxTopK,
    /// The `top_k` largest logits, then a softmax over those alone (gpt-oss).
    TopKSoftmax,
}

/// A layer's experts as gpt-oss's HF checkpoints store them (under `model.layers.N.`, no
/// `.weight` suffix): `gate_up` `[experts, hidden, 2·inter]` with expert e's gate in the even and
/// its up in the odd columns, `down` `[experts, inter, hidden]` (both the transpose of a linear
/// layer's weight), with `{gate_up}_bias` `[experts, 2·inter]` (interleaved alike) and
/// `{down}_bias` `[experts, hidden]`. Quantised (`quant_method: mxfp4`), the matrices are
/// `{name}_blocks` and `{name}_scales`, rows being output features ([`crate::hf_quant`]).
pub struct FusedExperts {
    pub gate_up: &'static str,
    pub down: &'static str,
}

/// HF config keys that change the forward pass: a family that does not read one refuses a config
/// that sets it to anything but its neutral value, naming it.
const MATH_KEYS: &[(&str, NeutralValue)] = &[
    ("attn_logit_softcapping", NeutralValue::Null),
    ("final_logit_softcapping", NeutralValue::Null),
    ("query_pre_attn_scalar", NeutralValue::Null),
    ("partial_rotary_factor", NeutralValue::One),
    ("rope_interleaved", NeutralValue::False),
    ("mlp_bias", NeutralValue::False),
    ("use_qk_norm", NeutralValue::False),
    ("attention_chunk_size", NeutralValue::Null),
    ("logits_scaling", NeutralValue::One),
    ("embedding_multiplier", NeutralValue::One),
    ("residual_multiplier", NeutralValue::One),
    ("attention_multiplier", NeutralValue::Null),
    ("num_local_experts", NeutralValue::Null),
    ("num_experts", NeutralValue::Null),
    ("shared_expert_intermediate_size", NeutralValue::Null),
    ("n_shared_experts", NeutralValue::Null),
    ("rope_local_base_freq", NeutralValue::Null),
    ("layer_types", NeutralValue::AllFull),
    ("use_bidirectional_attention", NeutralValue::False),
    ("swiglu_limit", NeutralValue::Null),
    ("swiglu_alpha", NeutralValue::Null),
];

#[derive(Clone, Copy)]
enum NeutralValue {
    Null,
    False,
    One,
    /// `layer_types` naming only full attention.
    AllFull,
}

impl NeutralValue {
    fn holds(self, v: &serde_json::Value) -> bool {
        match self {
            NeutralValue::Null => v.is_null(),
            NeutralValue::False => v.is_null() || v == &serde_json::Value::Bool(false),
            NeutralValue::One => v.is_null() || v.as_f64() == Some(1.0),
            NeutralValue::AllFull => {
                v.is_null()
                    || v.as_array()
                        .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")))
            }
        }
    }
}

/// The attention and norms of a Llama block, without its MLP (a mixture of experts' families).
const ATTENTION_TENSORS: &[(Role, &str, &str)] = &[
    (Role::AttnNorm, "input_layernorm", "attn_norm"),
    (Role::Q, "self_attn.q_proj", "attn_q"),
    (Role::K, "self_attn.k_proj", "attn_k"),
    (Role::V, "self_attn.v_proj", "attn_v"),
    (Role::O, "self_attn.o_proj", "attn_output"),
    (Role::MlpNorm, "post_attention_layernorm", "ffn_norm"),
];

const LLAMA_TENSORS: &[(Role, &str, &str)] = &[
    (Role::AttnNorm, "input_layernorm", "attn_norm"),
    (Role::Q, "self_attn.q_proj", "attn_q"),
    (Role::K, "self_attn.k_proj", "attn_k"),
    (Role::V, "self_attn.v_proj", "attn_v"),
    (Role::O, "self_attn.o_proj", "attn_output"),
    (Role::MlpNorm, "post_attention_layernorm", "ffn_norm"),
    (Role::Gate, "mlp.gate_proj", "ffn_gate"),
    (Role::Up, "mlp.up_proj", "ffn_up"),
    (Role::Down, "mlp.down_proj", "ffn_down"),
];

/// Gemma 2 and 3: norms after attention and after the MLP.
const GEMMA_TENSORS: &[(Role, &str, &str)] = &[
    (Role::AttnNorm, "input_layernorm", "attn_norm"),
    (Role::Q, "self_attn.q_proj", "attn_q"),
    (Role::K, "self_attn.k_proj", "attn_k"),
    (Role::V, "self_attn.v_proj", "attn_v"),
    (Role::O, "self_attn.o_proj", "attn_output"),
    (
        Role::PostAttnNorm,
        "post_attention_layernorm",
        "post_attention_norm",
    ),
    (Role::MlpNorm, "pre_feedforward_layernorm", "ffn_norm"),
    (Role::Gate, "mlp.gate_proj", "ffn_gate"),
    (Role::Up, "mlp.up_proj", "ffn_up"),
    (Role::Down, "mlp.down_proj", "ffn_down"),
    (
        Role::PostMlpNorm,
        "post_feedforward_layernorm",
        "post_ffw_norm",
    ),
];

/// Phi-3: q/k/v in one tensor, gate/up in one (llama.cpp keeps both fused: `attn_qkv`, and
/// `ffn_up` of twice the rows).
const PHI3_TENSORS: &[(Role, &str, &str)] = &[
    (Role::AttnNorm, "input_layernorm", "attn_norm"),
    (Role::Qkv, "self_attn.qkv_proj", "attn_qkv"),
    (Role::O, "self_attn.o_proj", "attn_output"),
    (Role::MlpNorm, "post_attention_layernorm", "ffn_norm"),
    (Role::GateUp, "mlp.gate_up_proj", "ffn_up"),
    (Role::Down, "mlp.down_proj", "ffn_down"),
];

/// gpt-oss: Llama's attention with sinks, no gated MLP (its experts are [`MoeSpec`]'s); GGUF
/// calls the MLP's pre-norm `post_attention_norm`.
const GPT_OSS_TENSORS: &[(Role, &str, &str)] = &[
    (Role::AttnNorm, "input_layernorm", "attn_norm"),
    (Role::Q, "self_attn.q_proj", "attn_q"),
    (Role::K, "self_attn.k_proj", "attn_k"),
    (Role::V, "self_attn.v_proj", "attn_v"),
    (Role::O, "self_attn.o_proj", "attn_output"),
    (Role::Sinks, "self_attn.sinks", "attn_sinks"),
    (
        Role::MlpNorm,
        "post_attention_layernorm",
        "post_attention_norm",
    ),
];

/// The q/k norms of the families that have them ([`Family::qk_norm`]): the same names in all.
const QK_NORM_TENSORS: &[(Role, &str, &str)] = &[
    (Role::QNorm, "self_attn.q_norm", "attn_q_norm"),
    (Role::KNorm, "self_attn.k_norm", "attn_k_norm"),
];

const fn family(
    arch: Arch,
    name: &'static str,
    layer_tensors: &'static [(Role, &'static str, &'static str)],
) -> Family {
    Family {
        arch,
        name,
        hf_architectures: &[],
        hf_model_types: &[],
        gguf_archs: &[],
        layer_tensors,
        qk_norm: false,
        qkv_bias: QkvBias::Never,
        hf_norm_plus_one: false,
        embed_scale: false,
        act_key: "hidden_act",
        act_default: Activation::Silu,
        sliding: Sliding::Never,
        sliding_switch: false,
        gguf_qk_permuted: false,
        softcap: false,
        query_pre_attn_scalar: false,
        local_rope_base: None,
        partial_rotary: false,
        moe: None,
        clamped_swiglu: false,
    }
}

/// Qwen-MoE's expert modules (HF) and llama.cpp's stacks of them (GGUF); gpt-oss's converter
/// splits its fused experts into the same.
const QWEN_EXPERTS: [(Role, &str, &str); 3] = [
    (
        Role::ExpertGate,
        "mlp.experts.{}.gate_proj",
        "ffn_gate_exps",
    ),
    (Role::ExpertUp, "mlp.experts.{}.up_proj", "ffn_up_exps"),
    (
        Role::ExpertDown,
        "mlp.experts.{}.down_proj",
        "ffn_down_exps",
    ),
];

/// Every family, in the order messages list them.
pub static FAMILIES: &[Family] = &[
    Family {
        hf_architectures: &["LlamaForCausalLM"],
        hf_model_types: &["llama"],
        gguf_archs: &["llama"],
        qkv_bias: QkvBias::FromConfig,
        gguf_qk_permuted: true,
        ..family(Arch::Llama, "llama", LLAMA_TENSORS)
    },
    Family {
        hf_architectures: &["MistralForCausalLM"],
        hf_model_types: &["mistral"],
        gguf_qk_permuted: true,
        sliding: Sliding::Every,
        ..family(Arch::Mistral, "mistral", LLAMA_TENSORS)
    },
    Family {
        hf_architectures: &["Qwen2ForCausalLM"],
        hf_model_types: &["qwen2"],
        gguf_archs: &["qwen2"],
        qkv_bias: QkvBias::Always,
        sliding: Sliding::Every,
        sliding_switch: true,
        ..family(Arch::Qwen2, "qwen2", LLAMA_TENSORS)
    },
    Family {
        hf_architectures: &["Qwen3ForCausalLM"],
        hf_model_types: &["qwen3"],
        gguf_archs: &["qwen3"],
        qkv_bias: QkvBias::FromConfig,
        sliding: Sliding::Every,
        sliding_switch: true,
        qk_norm: true,
        ..family(Arch::Qwen3, "qwen3", LLAMA_TENSORS)
    },
    Family {
        hf_architectures: &["Gemma2ForCausalLM"],
        hf_model_types: &["gemma2"],
        gguf_archs: &["gemma2"],
        hf_norm_plus_one: true,
        embed_scale: true,
        act_key: "hidden_activation",
        act_default: Activation::GeluTanh,
        sliding: Sliding::Pattern(2),
        softcap: true,
        query_pre_attn_scalar: true,
        ..family(Arch::Gemma2, "gemma2", GEMMA_TENSORS)
    },
    Family {
        hf_architectures: &["Gemma3ForCausalLM"],
        hf_model_types: &["gemma3_text"],
        gguf_archs: &["gemma3"],
        hf_norm_plus_one: true,
        embed_scale: true,
        act_key: "hidden_activation",
        act_default: Activation::GeluTanh,
        sliding: Sliding::Pattern(6),
        softcap: true,
        query_pre_attn_scalar: true,
        local_rope_base: Some(10_000.0),
        qk_norm: true,
        ..family(Arch::Gemma3, "gemma3", GEMMA_TENSORS)
    },
    Family {
        hf_architectures: &["Phi3ForCausalLM"],
        hf_model_types: &["phi3"],
        gguf_archs: &["phi3"],
        sliding: Sliding::Every,
        partial_rotary: true,
        ..family(Arch::Phi3, "phi3", PHI3_TENSORS)
    },
    Family {
        hf_architectures: &["MixtralForCausalLM"],
        hf_model_types: &["mixtral"],
        // llama.cpp's converter writes Mixtral as `llama` with experts.
        gguf_archs: &["llama"],
        gguf_qk_permuted: true,
        sliding: Sliding::Every,
        moe: Some(MoeSpec {
            experts_keys: &["num_local_experts"],
            intermediate_key: "intermediate_size",
            norm_topk_key: None,
            sparse_layers: false,
            routing: Routing::SoftmaxTopK,
            biases: false,
            hf_fused: None,
            router: ("block_sparse_moe.gate", "ffn_gate_inp"),
            experts: [
                (
                    Role::ExpertGate,
                    "block_sparse_moe.experts.{}.w1",
                    "ffn_gate_exps",
                ),
                (
                    Role::ExpertUp,
                    "block_sparse_moe.experts.{}.w3",
                    "ffn_up_exps",
                ),
                (
                    Role::ExpertDown,
                    "block_sparse_moe.experts.{}.w2",
                    "ffn_down_exps",
                ),
            ],
        }),
        ..family(Arch::Mixtral, "mixtral", ATTENTION_TENSORS)
    },
    Family {
        hf_architectures: &["Qwen3MoeForCausalLM"],
        hf_model_types: &["qwen3_moe"],
        gguf_archs: &["qwen3moe"],
        qkv_bias: QkvBias::FromConfig,
        qk_norm: true,
        sliding: Sliding::Every,
        sliding_switch: true,
        moe: Some(MoeSpec {
            experts_keys: &["num_experts", "num_local_experts"],
            intermediate_key: "moe_intermediate_size",
            norm_topk_key: Some("norm_topk_prob"),
            sparse_layers: true,
            routing: Routing::SoftmaxTopK,
            biases: false,
            hf_fused: None,
            router: ("mlp.gate", "ffn_gate_inp"),
            experts: QWEN_EXPERTS,
        }),
        ..family(Arch::Qwen3Moe, "qwen3_moe", LLAMA_TENSORS)
    },
    Family {
        hf_architectures: &["GptOssForCausalLM"],
        hf_model_types: &["gpt_oss"],
        gguf_archs: &["gpt-oss"],
        // `attention_bias` gives q, k, v and o their biases.
        qkv_bias: QkvBias::FromConfig,
        // Sliding, full, sliding, …: `layer_types` (HF); llama.cpp's pattern 2 (GGUF).
        sliding: Sliding::Pattern(2),
        clamped_swiglu: true,
        moe: Some(MoeSpec {
            experts_keys: &["num_local_experts"],
            intermediate_key: "intermediate_size",
            norm_topk_key: None,
            sparse_layers: false,
            routing: Routing::TopKSoftmax,
            biases: true,
            hf_fused: Some(FusedExperts {
                gate_up: "mlp.experts.gate_up_proj",
                down: "mlp.experts.down_proj",
            }),
            router: ("mlp.router", "ffn_gate_inp"),
            // Not HF names (HF fuses them, `hf_fused`): what llama.cpp's converter splits them
            // into, each a stack of `ffn_*_exps`.
            experts: QWEN_EXPERTS,
        }),
        ..family(Arch::GptOss, "gpt_oss", GPT_OSS_TENSORS)
    },
];

impl Arch {
    /// This family's description.
    pub fn family(self) -> &'static Family {
        FAMILIES
            .iter()
            .find(|f| f.arch == self)
            .expect("every Arch has a row in FAMILIES")
    }
}

/// Names of every family, for messages.
pub fn family_names() -> String {
    FAMILIES
        .iter()
        .map(|f| f.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Family {
    /// Every layer tensor: role, HF module, GGUF module.
    fn tensors(&self) -> impl Iterator<Item = (Role, &'static str, &'static str)> + '_ {
        let qk: &[_] = match self.qk_norm {
            true => QK_NORM_TENSORS,
            false => &[],
        };
        let router = self
            .moe
            .as_ref()
            .map(|m| (Role::Router, m.router.0, m.router.1));
        self.layer_tensors.iter().chain(qk).copied().chain(router)
    }

    /// The family of an HF `architectures[0]` name.
    pub fn from_hf_architecture(name: &str) -> Result<&'static Family> {
        FAMILIES
            .iter()
            .find(|f| f.hf_architectures.contains(&name))
            .ok_or_else(|| {
                let known: Vec<&str> = FAMILIES
                    .iter()
                    .flat_map(|f| f.hf_architectures.iter().copied())
                    .collect();
                ModelError::Config(format!(
                    "architectures: {name:?} is not supported ({})",
                    known.join(", ")
                ))
            })
    }

    /// The family of an HF `model_type`.
    pub fn from_hf_model_type(name: &str) -> Result<&'static Family> {
        FAMILIES
            .iter()
            .find(|f| f.hf_model_types.contains(&name))
            .ok_or_else(|| {
                let known: Vec<&str> = FAMILIES
                    .iter()
                    .flat_map(|f| f.hf_model_types.iter().copied())
                    .collect();
                ModelError::Config(format!(
                    "model_type: {name:?} is not supported ({})",
                    known.join(", ")
                ))
            })
    }

    /// The family of a GGUF `general.architecture` whose file has experts or not (llama.cpp
    /// writes Mixtral as `llama` with experts), if the engine runs it.
    pub fn from_gguf_arch(name: &str, experts: bool) -> Option<&'static Family> {
        FAMILIES
            .iter()
            .find(|f| f.gguf_archs.contains(&name) && f.moe.is_some() == experts)
    }

    /// GGUF architectures the engine runs, for messages.
    pub fn gguf_arch_names() -> String {
        FAMILIES
            .iter()
            .flat_map(|f| f.gguf_archs.iter().copied())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The HF name of expert `expert`'s matrix of this role in layer `layer`.
    pub fn hf_expert_name(&self, role: Role, layer: usize, expert: usize) -> Option<String> {
        self.hf_expert_tensor(role, layer, expert, "weight")
    }

    /// The HF name of expert `expert`'s tensor of this role in layer `layer` (`param`: `weight`
    /// or `bias`).
    pub fn hf_expert_tensor(
        &self,
        role: Role,
        layer: usize,
        expert: usize,
        param: &str,
    ) -> Option<String> {
        let spec = self.moe.as_ref()?;
        let (_, template, _) = spec.experts.iter().find(|&&(r, _, _)| r == role)?;
        Some(format!(
            "model.layers.{layer}.{}.{param}",
            template.replace("{}", &expert.to_string())
        ))
    }

    /// The GGUF tensor that stacks the experts of an HF expert matrix's (or bias's) name, and the
    /// expert.
    pub fn gguf_expert(&self, hf_name: &str) -> Option<(String, usize)> {
        let spec = self.moe.as_ref()?;
        let rest = hf_name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let (module, param) = rest.rsplit_once('.')?;
        if param != "weight" && param != "bias" {
            return None;
        }
        spec.experts.iter().find_map(|&(_, template, gguf)| {
            let (head, tail) = template.split_once("{}")?;
            let e = module.strip_prefix(head)?.strip_suffix(tail)?;
            let expert: usize = e
                .parse()
                .ok()
                .filter(|_| e.bytes().all(|b| b.is_ascii_digit()))?;
            Some((format!("blk.{layer}.{gguf}.{param}"), expert))
        })
    }

    /// The role of a tensor by its HF or GGUF name (an expert's too), if the family has it.
    pub fn role_of(&self, name: &str) -> Option<Role> {
        match name {
            "model.embed_tokens.weight" | "token_embd.weight" => return Some(Role::Embed),
            "model.norm.weight" | "output_norm.weight" => return Some(Role::FinalNorm),
            "lm_head.weight" | "output.weight" => return Some(Role::LmHead),
            _ => {}
        }
        // A tensor without a parameter suffix (gpt-oss's sinks).
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let (_layer, module) = rest.split_once('.')?;
            if let Some((r, _, _)) = self.tensors().find(|&(_, h, _)| h == module) {
                return Some(r);
            }
        }
        // `model.layers.N.MODULE.PARAM` or `blk.N.MODULE.PARAM`.
        let (path, _param) = name.rsplit_once('.')?;
        let hf = path.strip_prefix("model.layers.");
        let (_layer, module) = hf.or_else(|| path.strip_prefix("blk."))?.split_once('.')?;
        let by_table = self
            .tensors()
            .find(|&(_, h, g)| module == if hf.is_some() { h } else { g })
            .map(|(r, _, _)| r);
        by_table.or_else(|| {
            let spec = self.moe.as_ref()?;
            spec.experts.iter().find_map(|&(r, template, gguf)| {
                if hf.is_none() {
                    return (module == gguf).then_some(r);
                }
                let (head, tail) = template.split_once("{}")?;
                let e = module.strip_prefix(head)?.strip_suffix(tail)?;
                (!e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())).then_some(r)
            })
        })
    }

    /// Whether the family's layers have a tensor of this role.
    pub fn has(&self, role: Role) -> bool {
        matches!(role, Role::Embed | Role::FinalNorm | Role::LmHead)
            || self.tensors().any(|(r, _, _)| r == role)
    }

    /// The HF name of a tensor (`param`: `weight` or `bias`; a parameter of its own, as gpt-oss's
    /// sinks, has none: `param` is ignored); `layer` is ignored for the model's own tensors.
    /// `None` if the family has no such tensor.
    pub fn hf_name(&self, role: Role, layer: usize, param: &str) -> Option<String> {
        match role {
            Role::Embed => Some("model.embed_tokens.weight".into()),
            Role::FinalNorm => Some("model.norm.weight".into()),
            Role::LmHead => Some("lm_head.weight".into()),
            Role::Sinks => self
                .tensors()
                .find(|&(r, _, _)| r == role)
                .map(|(_, hf, _)| format!("model.layers.{layer}.{hf}")),
            _ => self
                .tensors()
                .find(|&(r, _, _)| r == role)
                .map(|(_, hf, _)| format!("model.layers.{layer}.{hf}.{param}")),
        }
    }

    /// The GGUF name of an HF tensor name, or `None` if the family has no counterpart.
    pub fn gguf_name(&self, hf_name: &str) -> Option<String> {
        let fixed = match hf_name {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" => Some("output.weight"),
            _ => None,
        };
        if let Some(n) = fixed {
            return Some(n.to_string());
        }
        let rest = hf_name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // A parameter of its own (sinks): GGUF names it `.weight`.
        if let Some((_, _, gguf)) = self
            .tensors()
            .find(|&(r, hf, _)| hf == rest && r == Role::Sinks)
        {
            return Some(format!("blk.{layer}.{gguf}.weight"));
        }
        let (module, param) = rest.rsplit_once('.')?;
        if param != "weight" && param != "bias" {
            return None;
        }
        let (_, _, gguf) = self.tensors().find(|&(_, hf, _)| hf == module)?;
        Some(format!("blk.{layer}.{gguf}.{param}"))
    }

    /// Refuses an HF config that sets a key this family does not read to a value that would
    /// change the forward pass.
    pub fn check_unread_keys(
        &self,
        obj: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        for &(key, neutral) in MATH_KEYS {
            let Some(v) = obj.get(key) else { continue };
            if self.reads(key) || neutral.holds(v) {
                continue;
            }
            return Err(ModelError::Unsupported(format!(
                "config {key}: {v} changes the {} forward pass in a way entrollm does not \
                 implement for this family",
                self.name
            )));
        }
        Ok(())
    }

    /// Whether the family's config reading takes this [`MATH_KEYS`] key into account.
    fn reads(&self, key: &str) -> bool {
        match key {
            "attn_logit_softcapping" | "final_logit_softcapping" => self.softcap,
            "query_pre_attn_scalar" => self.query_pre_attn_scalar,
            "partial_rotary_factor" => self.partial_rotary,
            "rope_local_base_freq" => self.local_rope_base.is_some(),
            "layer_types" => self.sliding != Sliding::Never,
            "swiglu_limit" | "swiglu_alpha" => self.clamped_swiglu,
            "num_local_experts" | "num_experts" => self
                .moe
                .as_ref()
                .is_some_and(|m| m.experts_keys.contains(&key)),
            _ => false,
        }
    }

    /// The activation an HF config names (under [`Family::act_key`]).
    pub fn activation(&self, name: Option<&str>) -> Result<Activation> {
        match name {
            None => Ok(self.act_default),
            Some(n) => Activation::from_hf(n).ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "config {}: {n:?} (silu and gelu_pytorch_tanh are supported)",
                    self.act_key
                ))
            }),
        }
    }
}

/// The role of a tensor by its HF or GGUF name in any family (matrices have one role in all).
pub fn role_of_tensor(name: &str) -> Option<Role> {
    FAMILIES.iter().find_map(|f| f.role_of(name))
}

/// Which layers of `num_layers` slide under a [`Sliding::Pattern`] of `n` (the last of each group
/// of `n` is global; `n = 0` or `1`: as llama.cpp reads them).
pub fn sliding_pattern(n: usize, num_layers: usize) -> Vec<bool> {
    (0..num_layers).map(|il| n == 0 || il % n < n - 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_one_family_and_names_are_unique() {
        for f in FAMILIES {
            assert!(std::ptr::eq(f.arch.family(), f), "{}", f.name);
            assert_eq!(
                FAMILIES.iter().filter(|g| g.name == f.name).count(),
                1,
                "{}",
                f.name
            );
        }
    }

    #[test]
    fn gguf_names_follow_the_family() {
        let llama = Arch::Llama.family();
        let gemma = Arch::Gemma2.family();
        let n = "model.layers.3.post_attention_layernorm.weight";
        assert_eq!(llama.gguf_name(n).unwrap(), "blk.3.ffn_norm.weight");
        assert_eq!(
            gemma.gguf_name(n).unwrap(),
            "blk.3.post_attention_norm.weight"
        );
        assert_eq!(
            Arch::Phi3
                .family()
                .gguf_name("model.layers.0.mlp.gate_up_proj.weight")
                .unwrap(),
            "blk.0.ffn_up.weight"
        );
        assert_eq!(
            Arch::Qwen3
                .family()
                .gguf_name("model.layers.1.self_attn.k_norm.weight")
                .unwrap(),
            "blk.1.attn_k_norm.weight"
        );
        assert_eq!(
            llama.gguf_name("model.layers.1.self_attn.k_norm.weight"),
            None
        );
        assert_eq!(
            llama.hf_name(Role::Q, 4, "bias").unwrap(),
            "model.layers.4.self_attn.q_proj.bias"
        );
        assert_eq!(llama.hf_name(Role::QNorm, 4, "weight"), None);
    }

    #[test]
    fn roles_of_tensor_names_in_every_family() {
        let cases = [
            ("model.layers.3.self_attn.q_proj.weight", Some(Role::Q)),
            ("blk.3.attn_q.bias", Some(Role::Q)),
            ("model.layers.0.self_attn.qkv_proj.weight", Some(Role::Qkv)),
            ("blk.0.attn_qkv.weight", Some(Role::Qkv)),
            ("model.layers.1.mlp.gate_up_proj.weight", Some(Role::GateUp)),
            (
                "model.layers.1.block_sparse_moe.experts.7.w2.weight",
                Some(Role::ExpertDown),
            ),
            (
                "model.layers.1.mlp.experts.12.up_proj.weight",
                Some(Role::ExpertUp),
            ),
            ("blk.1.ffn_gate_exps.weight", Some(Role::ExpertGate)),
            (
                "model.layers.1.block_sparse_moe.gate.weight",
                Some(Role::Router),
            ),
            ("blk.1.ffn_gate_inp.weight", Some(Role::Router)),
            ("model.layers.2.self_attn.k_norm.weight", Some(Role::KNorm)),
            ("output.weight", Some(Role::LmHead)),
            ("model.layers.1.mlp.experts.x.up_proj.weight", None),
            ("model.layers.1.mlp.something.weight", None),
            ("lm_head", None),
        ];
        for (name, role) in cases {
            assert_eq!(role_of_tensor(name), role, "{name}");
        }
    }

    #[test]
    fn gpt_oss_names_its_sinks_and_expert_biases() {
        let f = Arch::GptOss.family();
        let sinks = f.hf_name(Role::Sinks, 3, "weight").unwrap();
        assert_eq!(sinks, "model.layers.3.self_attn.sinks");
        assert_eq!(f.gguf_name(&sinks).unwrap(), "blk.3.attn_sinks.weight");
        assert_eq!(f.role_of(&sinks), Some(Role::Sinks));
        assert_eq!(f.role_of("blk.3.attn_sinks.weight"), Some(Role::Sinks));
        assert_eq!(
            f.gguf_name("model.layers.1.post_attention_layernorm.weight")
                .unwrap(),
            "blk.1.post_attention_norm.weight"
        );
        let bias = f.hf_expert_tensor(Role::ExpertUp, 1, 2, "bias").unwrap();
        assert_eq!(bias, "model.layers.1.mlp.experts.2.up_proj.bias");
        assert_eq!(
            f.gguf_expert(&bias).unwrap(),
            ("blk.1.ffn_up_exps.bias".to_string(), 2)
        );
        assert_eq!(
            f.gguf_expert("model.layers.1.mlp.experts.2.up_proj.scale"),
            None
        );
        assert_eq!(
            f.gguf_name("model.layers.0.mlp.router.bias").unwrap(),
            "blk.0.ffn_gate_inp.bias"
        );
        // Another family has no sinks: no name for them.
        assert_eq!(Arch::Llama.family().hf_name(Role::Sinks, 0, "weight"), None);
    }

    #[test]
    fn sliding_patterns_match_llama_cpp() {
        assert_eq!(
            sliding_pattern(6, 7),
            [true, true, true, true, true, false, true]
        );
        assert_eq!(sliding_pattern(2, 4), [true, false, true, false]);
        assert_eq!(sliding_pattern(1, 2), [false, false]);
    }

    #[test]
    fn gelu_tanh_matches_its_definition() {
        for x in [-3.0f32, -0.5, 0.0, 0.7, 2.5] {
            let want = 0.5
                * x as f64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * (x as f64 + 0.044715 * (x as f64).powi(3)))
                    .tanh());
            assert!(
                (Activation::GeluTanh.apply(x) as f64 - want).abs() < 1e-6,
                "{x}"
            );
        }
    }

    #[test]
    fn unread_math_keys_are_refused() {
        let obj = |k: &str, v: serde_json::Value| {
            let mut m = serde_json::Map::new();
            m.insert(k.into(), v);
            m
        };
        let llama = Arch::Llama.family();
        let err = llama
            .check_unread_keys(&obj("attn_logit_softcapping", 50.0.into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("attn_logit_softcapping"), "{err}");
        llama
            .check_unread_keys(&obj("attn_logit_softcapping", serde_json::Value::Null))
            .unwrap();
        llama
            .check_unread_keys(&obj("partial_rotary_factor", 1.0.into()))
            .unwrap();
        assert!(llama
            .check_unread_keys(&obj("partial_rotary_factor", 0.5.into()))
            .is_err());
        Arch::Gemma2
            .family()
            .check_unread_keys(&obj("attn_logit_softcapping", 50.0.into()))
            .unwrap();
        let err = llama
            .check_unread_keys(&obj("swiglu_limit", 7.0.into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("swiglu_limit"), "{err}");
        Arch::GptOss
            .family()
            .check_unread_keys(&obj("swiglu_limit", 7.0.into()))
            .unwrap();
    }
}
