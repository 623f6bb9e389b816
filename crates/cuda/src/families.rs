//! What the GPU engine runs of the model families ([`entrollm_model::arch`]): the one place that
//! says which parts of a block beyond Llama's it does not run yet. `GpuModel`'s upload refuses a
//! model with any of them, naming them (the CPU engine runs every family).
//!
//! Runs: q/k RMSNorm per head and partial rotary (`kernels/families.cu` `rope_heads_*`, fused with
//! the KV append), post-attention and post-MLP norms (`add_rmsnorm*`: the residual add with the
//! next norm), GeGLU (`geglu_*`), the embedding scale (`scale_f32`), the attention scale, attention
//! soft-capping, sliding windows and sinks per layer (the `ATTN_WINDOW` / `ATTN_SOFTCAP` /
//! `ATTN_SINKS` and `FA_WINDOW` / `FA_SOFTCAP` / `FA_SINKS` variants of the attention kernels),
//! final soft-capping (`softcap_f32`), a RoPE base of the sliding layers' own (a second RoPE
//! table), YaRN RoPE scaling (its frequencies and its attention factor in the RoPE table), a bias
//! on the attention output projection (`bias_residual`), and a mixture of experts (Mixtral,
//! Qwen3-MoE, gpt-oss: the router's GEMV, `moe_topk` on the device — softmax then top-k, or
//! top-k then softmax, with the router's bias —, the routed experts' gate/up and down each one
//! gathered launch, SwiGLU in the gate/up product's epilogue or, for experts with biases or
//! another activation (gpt-oss's clamped SwiGLU), `moe_glu_*` after a plain product,
//! `moe_combine` with the experts' down biases; prefill groups the prompt's tokens by expert).
//! The decode step of each is in [`crate::plan`].

use entrollm_model::weights::{Mlp, ModelWeights};

/// The parts of `w`'s forward pass the GPU engine does not run, by name (empty: it runs it).
pub fn unsupported(w: &ModelWeights) -> Vec<&'static str> {
    let mut out = Vec::new();
    let experts = |l: &&entrollm_model::LayerWeights| matches!(l.mlp, Mlp::Experts(_));
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
    // The clamped SwiGLU runs in the experts' activation kernel, not in a dense MLP's epilogue.
    if w.config.block.clamped_swiglu.is_some() && w.layers.iter().any(|l| !experts(&l)) {
        out.push("the clamped SwiGLU (gpt-oss's) in a dense MLP");
    }
    // The o projection's output goes through its bias straight into the residual stream.
    if w.layers
        .iter()
        .any(|l| l.norms.o_bias.is_some() && l.norms.post_attn.is_some())
    {
        out.push("a bias on the attention output projection before a post-attention norm");
    }
    // The attention kernels take sinks where the family's description has them (`layer_mask`).
    let family_sinks = w
        .config
        .arch
        .family()
        .has(entrollm_model::arch::Role::Sinks);
    if w.layers
        .iter()
        .any(|l| l.norms.sinks.is_some() != family_sinks)
    {
        out.push("attention sinks where the family has none, or none where it has them");
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
