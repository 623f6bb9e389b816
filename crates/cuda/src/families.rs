//! What the GPU engine runs of the model families ([`entrollm_model::arch`]): the one place that
//! says which parts of a block beyond Llama's it does not run yet. `GpuModel`'s upload refuses a
//! model with any of them, naming them (the CPU engine runs every family).
//!
//! Runs: q/k RMSNorm per head and partial rotary (`kernels/families.cu` `rope_heads_*`, fused with
//! the KV append), post-attention and post-MLP norms (`add_rmsnorm*`: the residual add with the
//! next norm), GeGLU (`geglu_*`), the embedding scale (`scale_f32`), the attention scale, attention
//! soft-capping and sliding windows per layer (the `ATTN_WINDOW` / `ATTN_SOFTCAP` and `FA_WINDOW` /
//! `FA_SOFTCAP` variants of the attention kernels), final soft-capping (`softcap_f32`), a RoPE
//! base of the sliding layers' own (a second RoPE table), and a mixture of experts with SwiGLU
//! experts (Mixtral, Qwen3-MoE: the router's GEMV, `moe_topk` on the device, the routed experts'
//! gate/up and down each one gathered launch, `moe_combine`; prefill groups the prompt's tokens by
//! expert). The decode step of each is in [`crate::plan`].

use entrollm_model::config::Activation;
use entrollm_model::weights::{Mlp, ModelWeights};

/// The parts of `w`'s forward pass the GPU engine does not run, by name (empty: it runs it).
pub fn unsupported(w: &ModelWeights) -> Vec<&'static str> {
    let mut out = Vec::new();
    let experts = |l: &&entrollm_model::LayerWeights| matches!(l.mlp, Mlp::Experts(_));
    // The gathered gate/up products apply SwiGLU in their epilogue.
    if w.config.block.activation != Activation::Silu && w.layers.iter().any(|l| experts(&l)) {
        out.push("a mixture of experts with an activation other than SiLU");
    }
    // Prefill adds the experts' weighted sum straight into the residual stream.
    if w.layers
        .iter()
        .any(|l| experts(&l) && l.norms.post_mlp.is_some())
    {
        out.push("a post-MLP norm after a mixture of experts");
    }
    if let Some(m) = &w.config.block.moe {
        use crate::ops::families::{MOE_MAX_EXPERTS, MOE_MAX_K};
        if m.experts > MOE_MAX_EXPERTS || m.top_k > MOE_MAX_K {
            out.push("more than 4096 experts, or more than 64 a token");
        }
    }
    if w.layers.iter().any(|l| l.norms.sinks.is_some()) {
        out.push("attention sinks");
    }
    if w.layers.iter().any(|l| l.norms.o_bias.is_some()) {
        out.push("a bias on the attention output projection");
    }
    // The RoPE table holds cos and sin unscaled: YaRN's attention factor has no place there.
    if matches!(
        w.config.rope_scaling,
        entrollm_model::config::RopeScaling::Yarn { .. }
    ) {
        out.push("YaRN RoPE scaling");
    }
    if w.config.block.clamped_swiglu.is_some() {
        out.push("the clamped SwiGLU (gpt-oss)");
    }
    if w.layers.iter().any(|l| {
        matches!(&l.mlp, entrollm_model::weights::Mlp::Experts(e)
            if e.router_bias.is_some() || !e.biases.is_empty())
    }) {
        out.push("biases on a mixture of experts' router and experts");
    }
    if w.config
        .block
        .moe
        .as_ref()
        .is_some_and(|m| m.routing == entrollm_model::config::Routing::TopKSoftmax)
    {
        out.push("experts weighted by the softmax of their top-k logits");
    }
    // The per-head kernel norms q and k heads alike: a model with one of the two norms only.
    if w.layers
        .iter()
        .any(|l| l.norms.q.is_some() != l.norms.k.is_some())
    {
        out.push("a q norm without a k norm (or a k norm without a q norm)");
    }
    out
}
