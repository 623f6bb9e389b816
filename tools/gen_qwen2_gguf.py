#!/usr/bin/env python3
"""A synthetic Qwen2-7B-shaped (or Llama-3.1-8B-shaped) checkpoint written as an F16 GGUF with the
`gguf` package, for llama.cpp's `llama-quantize` to turn into the quantisations users download
(Q4_K_M ...).

No complete real 7B GGUF ships in a registry, so the shapes, metadata and tokenizer are real
(Qwen2-7B's dimensions, or Llama-3.1-8B's with `--shape llama-3.1-8b`; SmolLM2's BPE tokenizer,
padded with unused tokens to the model's vocabulary) and the weights random: Gaussian matrices
with a per-row spread, unit norms, small biases (Qwen2's). Their text is noise; memory and speed
are what they measure.

    python3 tools/gen_qwen2_gguf.py --tokenizer-from SmolLM2.gguf -o qwen2-7b-f16.gguf [--layers N]
        [--shape qwen2-7b | llama-3.1-8b]

`--tiny` writes a one-layer Qwen2 of k-quant-sized dimensions (hidden 256, 4 heads, 2 KV heads,
FFN 512, the tokenizer's vocabulary padded to 512) in F32, for llama-quantize to make the small
k-quant test files of crates/model/tests/data (tools/gen_kquant_testdata.sh).

Tensors are generated and written one at a time (the file is 15 GB; memory stays under 2 GB).
"""
import argparse

import numpy as np
import gguf

# Set by main from SHAPES (or --tiny).
HIDDEN = HEADS = KV_HEADS = INTER = VOCAB = None
MATRIX_DTYPE = np.float16
# Per shape: architecture, dimensions as above, RoPE base, RMSNorm epsilon, context, q/k/v biases.
SHAPES = {
    "qwen2-7b": ("qwen2", (3584, 28, 28, 4, 18944, 152064), 1_000_000.0, 1e-6, 32768, True),
    "llama-3.1-8b": ("llama", (4096, 32, 32, 8, 14336, 128256), 500_000.0, 1e-5, 131072, False),
}
BIASES = True


def tensors(layers):
    """(name, numpy shape, kind) in file order; shapes as numpy holds them (rows, cols)."""
    head = HIDDEN // HEADS
    kv = KV_HEADS * head
    yield "token_embd.weight", (VOCAB, HIDDEN), "matrix"
    for i in range(layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (HIDDEN,), "norm"
        yield p + "attn_q.weight", (HIDDEN, HIDDEN), "matrix"
        if BIASES:
            yield p + "attn_q.bias", (HIDDEN,), "bias"
        yield p + "attn_k.weight", (kv, HIDDEN), "matrix"
        if BIASES:
            yield p + "attn_k.bias", (kv,), "bias"
        yield p + "attn_v.weight", (kv, HIDDEN), "matrix"
        if BIASES:
            yield p + "attn_v.bias", (kv,), "bias"
        yield p + "attn_output.weight", (HIDDEN, HIDDEN), "matrix"
        yield p + "ffn_norm.weight", (HIDDEN,), "norm"
        yield p + "ffn_gate.weight", (INTER, HIDDEN), "matrix"
        yield p + "ffn_up.weight", (INTER, HIDDEN), "matrix"
        yield p + "ffn_down.weight", (HIDDEN, INTER), "matrix"
    yield "output_norm.weight", (HIDDEN,), "norm"
    yield "output.weight", (VOCAB, HIDDEN), "matrix"


def values(shape, kind, rng):
    if kind == "norm":
        return np.ones(shape, np.float32)
    if kind == "bias":
        return (rng.standard_normal(shape, np.float32) * 0.01).astype(np.float32)
    rows, cols = shape
    out = np.empty(shape, MATRIX_DTYPE)
    std = 1.0 / np.sqrt(cols)
    for r in range(0, rows, 4096):
        n = min(4096, rows - r)
        spread = rng.uniform(0.5, 1.5, (n, 1)).astype(np.float32)
        out[r : r + n] = rng.standard_normal((n, cols), np.float32) * (std * spread)
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
    global HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, MATRIX_DTYPE, BIASES
    arch, dims, rope_base, eps, context, BIASES = SHAPES[a.shape]
    HIDDEN, layers, HEADS, KV_HEADS, INTER, VOCAB = dims
    a.layers = a.layers or layers
    if a.tiny:
        arch, BIASES = "qwen2", True
        HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, MATRIX_DTYPE = 256, 4, 2, 512, 512, np.float32
        a.layers = 1

    src = gguf.GGUFReader(a.tokenizer_from)

    def field(name):
        f = src.fields[name]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            return [f.contents(i) for i in range(len(f.data))]
        return f.contents()

    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    pad = VOCAB - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad

    w = gguf.GGUFWriter(a.output, arch)
    w.add_name("synthetic tiny Qwen2" if a.tiny else f"synthetic {a.shape} shape")
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)
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

    plan = list(tensors(a.layers))
    for name, shape, kind in plan:
        dtype = MATRIX_DTYPE if kind == "matrix" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for i, (name, shape, kind) in enumerate(plan):
        w.write_tensor_data(values(shape, kind, rng))
        if kind == "matrix":
            print(f"\r{i + 1}/{len(plan)} {name}", end="", flush=True)
    print()
    w.close()


if __name__ == "__main__":
    main()
