//! What the GPU engine runs of the model families ([`entrollm_model::arch`]): the one place that
//! says which parts of a block beyond Llama's it does not run yet. `GpuModel`'s upload refuses a
//! model with any of them, naming them (the CPU engine runs every family).
//!
//! Runs: q/k RMSNorm per head and partial rotary (`kernels/families.cu` `rope_heads_*`, fused with
//! the KV append), post-attention and post-MLP norms (`add_rmsnorm*`: the residual add with the
//! next norm), GeGLU (`geglu_*`), the embedding scale (`scale_f32`), the attention scale, attention
//! soft-capping and sliding windows per layer (the `ATTN_WINDOW` / `ATTN_SOFTCAP` and `FA_WINDOW` /
//! `FA_SOFTCAP` variants of the attention kernels), final soft-capping (`softcap_f32`), and a RoPE
//! base of the sliding layers' own (a second RoPE table). The decode step of each is in
//! [`crate::plan`].

use entrollm_model::weights::ModelWeights;

/// The parts of `w`'s forward pass the GPU engine does not run, by name (empty: it runs it).
pub fn unsupported(w: &ModelWeights) -> Vec<&'static str> {
    let mut out = Vec::new();
    if w.layers.iter().any(|l| l.mlp.gated().is_none()) {
        out.push("a mixture of experts");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families_selftest::family_model;
    use crate::selftest::Rng;
    use entrollm_model::config::Arch;

    #[test]
    fn a_q_norm_without_a_k_norm_is_named() {
        let mut w = family_model(Arch::Qwen3, &mut Rng::new(3)).unwrap();
        assert!(unsupported(&w).is_empty());
        w.layers[1].norms.k = None;
        let got = unsupported(&w);
        assert_eq!(got.len(), 1);
        assert!(got[0].contains("q norm without a k norm"), "{got:?}");
    }
}
