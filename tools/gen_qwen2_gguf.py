#!/usr/bin/env python3
"""A synthetic checkpoint of a real model's shape, written as an F16 GGUF with the `gguf` package,
for llama.cpp's `llama-quantize` to turn into the quantisations users download (Q4_K_M ...).

No complete real multi-billion GGUF ships in a registry, so the shapes, metadata and tokenizer are
real (the dimensions of the model the shape names; SmolLM2's BPE tokenizer, padded with unused
tokens to the model's vocabulary) and the weights random: Gaussian matrices with a per-row spread,
unit norms, small biases (Qwen2's). Their text is noise; memory and speed are what they measure.

    python3 tools/gen_qwen2_gguf.py --tokenizer-from SmolLM2.gguf -o qwen2-7b-f16.gguf [--layers N]
        [--shape NAME]     (NAME: one of SHAPES below; default qwen2-7b)

Each shape writes its family's GGUF architecture, tensors and metadata as llama.cpp's converter
writes them: Qwen3's per-head q/k norms, Gemma 3's post-attention/post-MLP norms, sliding window
and local RoPE base (its output head tied to the embeddings), a mixture of experts' router and
stacked `*_exps` tensors (Qwen3-MoE). `--layers N` keeps the first N layers (a large MoE then fits
a device's disk; per-token work scales with the layers).

`--tiny` writes a one-layer Qwen2 of k-quant-sized dimensions (hidden 256, 4 heads, 2 KV heads,
FFN 512, the tokenizer's vocabulary padded to 512) in F32, for llama-quantize to make the small
k-quant test files of crates/model/tests/data (tools/gen_kquant_testdata.sh).

Tensors are generated and written one at a time (memory stays under 2 GB).
"""
import argparse

import numpy as np
import gguf

# hidden, layers, heads, KV heads, head_dim, FFN, vocab, RoPE base, RMSNorm eps, context; the rest
# per family: q/k/v biases, q/k norms, Gemma 3's extras, experts (count, used, FFN per expert).
SHAPES = {
    "qwen2-7b": dict(arch="qwen2", dims=(3584, 28, 28, 4, 128, 18944, 152064), rope=1e6, eps=1e-6,
                     ctx=32768, biases=True),
    "llama-3.1-8b": dict(arch="llama", dims=(4096, 32, 32, 8, 128, 14336, 128256), rope=5e5,
                         eps=1e-5, ctx=131072),
    "qwen3-8b": dict(arch="qwen3", dims=(4096, 36, 32, 8, 128, 12288, 151936), rope=1e6, eps=1e-6,
                     ctx=40960, qk_norm=True),
    "gemma3-270m": dict(arch="gemma3", dims=(640, 18, 4, 1, 256, 2048, 262144), rope=1e6,
                        eps=1e-6, ctx=32768, qk_norm=True, gemma=dict(window=512, rope_swa=1e4)),
    "gemma3-1b": dict(arch="gemma3", dims=(1152, 26, 4, 1, 256, 6912, 262144), rope=1e6, eps=1e-6,
                      ctx=32768, qk_norm=True, gemma=dict(window=512, rope_swa=1e4)),
    "qwen3-30b-a3b": dict(arch="qwen3moe", dims=(2048, 48, 32, 4, 128, 6144, 151936), rope=1e6,
                          eps=1e-6, ctx=40960, qk_norm=True, experts=(128, 8, 768)),
}
TINY = dict(arch="qwen2", dims=(256, 1, 4, 2, 64, 512, 512), rope=1e6, eps=1e-6, ctx=32768,
            biases=True)


def tensors(s, layers):
    """(name, numpy shape, kind) in file order; shapes as numpy holds them (rows, cols)."""
    hidden, _, heads, kv_heads, head, inter, vocab = s["dims"]
    q, kv = heads * head, kv_heads * head
    biases, qk_norm, gemma, experts = (s.get(k) for k in ("biases", "qk_norm", "gemma", "experts"))
    yield "token_embd.weight", (vocab, hidden), "matrix"
    for i in range(layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (hidden,), "norm"
        for t, rows in (("q", q), ("k", kv), ("v", kv)):
            yield p + f"attn_{t}.weight", (rows, hidden), "matrix"
            if biases:
                yield p + f"attn_{t}.bias", (rows,), "bias"
        if qk_norm:
            yield p + "attn_q_norm.weight", (head,), "norm"
            yield p + "attn_k_norm.weight", (head,), "norm"
        yield p + "attn_output.weight", (hidden, q), "matrix"
        if gemma:
            yield p + "post_attention_norm.weight", (hidden,), "norm"
        yield p + "ffn_norm.weight", (hidden,), "norm"
        if experts:
            n, _, ei = experts
            yield p + "ffn_gate_inp.weight", (n, hidden), "router"
            yield p + "ffn_gate_exps.weight", (n, ei, hidden), "matrix"
            yield p + "ffn_up_exps.weight", (n, ei, hidden), "matrix"
            yield p + "ffn_down_exps.weight", (n, hidden, ei), "matrix"
        else:
            yield p + "ffn_gate.weight", (inter, hidden), "matrix"
            yield p + "ffn_up.weight", (inter, hidden), "matrix"
            yield p + "ffn_down.weight", (hidden, inter), "matrix"
        if gemma:
            yield p + "post_ffw_norm.weight", (hidden,), "norm"
    yield "output_norm.weight", (hidden,), "norm"
    if not gemma:  # Gemma ties its output head to the embeddings
        yield "output.weight", (vocab, hidden), "matrix"


def values(shape, kind, rng, dtype):
    if kind == "norm":
        return np.ones(shape, np.float32)
    if kind == "bias":
        return (rng.standard_normal(shape, np.float32) * 0.01).astype(np.float32)
    out = np.empty(shape, dtype)
    flat = out.reshape(-1, shape[-1])
    std = 1.0 / np.sqrt(shape[-1])
    for r in range(0, flat.shape[0], 4096):
        n = min(4096, flat.shape[0] - r)
        spread = rng.uniform(0.5, 1.5, (n, 1)).astype(np.float32)
        flat[r : r + n] = rng.standard_normal((n, shape[-1]), np.float32) * (std * spread)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-from", required=True, help="a GGUF with a gpt2-style tokenizer")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape's")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="a one-layer F32 Qwen2 of 256 columns")
    a = ap.parse_args()
    s = TINY if a.tiny else SHAPES[a.shape]
    arch = s["arch"]
    hidden, layers, heads, kv_heads, head, inter, vocab = s["dims"]
    layers = 1 if a.tiny else (a.layers or layers)
    matrix_dtype = np.float32 if a.tiny else np.float16

    src = gguf.GGUFReader(a.tokenizer_from)

    def field(name):
        f = src.fields[name]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            return [f.contents(i) for i in range(len(f.data))]
        return f.contents()

    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad

    w = gguf.GGUFWriter(a.output, arch)
    w.add_name("synthetic tiny Qwen2" if a.tiny else f"synthetic {a.shape} shape")
    w.add_context_length(s["ctx"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head * heads != hidden or s.get("qk_norm"):
        w.add_key_length(head)
        w.add_value_length(head)
    w.add_rope_freq_base(s["rope"])
    w.add_layer_norm_rms_eps(s["eps"])
    if s.get("gemma"):
        w.add_sliding_window(s["gemma"]["window"])
        w.add_rope_freq_base_swa(s["gemma"]["rope_swa"])
    if s.get("experts"):
        n, used, ei = s["experts"]
        w.add_expert_count(n)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(ei)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if a.tiny else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(field("tokenizer.chat_template"))

    plan = list(tensors(s, layers))
    for name, shape, kind in plan:
        dtype = matrix_dtype if kind == "matrix" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for i, (name, shape, kind) in enumerate(plan):
        w.write_tensor_data(values(shape, kind, rng, matrix_dtype if kind == "matrix" else np.float32))
        if kind == "matrix":
            print(f"\r{i + 1}/{len(plan)} {name}", end="", flush=True)
    print()
    w.close()


if __name__ == "__main__":
    main()
