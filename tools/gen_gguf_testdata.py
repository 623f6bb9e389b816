#!/usr/bin/env python3
"""Generates the GGUF golden test files of crates/model/tests/data/ with an independent
implementation: the `gguf` PyPI package (llama.cpp's gguf-py) writes the files and dequantises
them; numpy applies the Q/K permutations.

    python3 -m pip install gguf==0.19.0 numpy
    python3 tools/gen_gguf_testdata.py

Writes:
  gguf_dequant.gguf        one [2 x 256] tensor per supported type (random blocks with sane
                           scales) plus `<name>.expected`, its F32 dequantisation by gguf-py
  gguf_tiny_llama.gguf     a 2-layer llama (GQA, llama3 rope_freqs) with mixed tensor types and
                           llama.cpp-permuted Q/K
  gguf_tiny_llama.expected.gguf
                           some of those tensors as F32 under HF names, in HF layout (Q/K
                           un-permuted with transformers' `permute` from convert_llama_weights_to_hf.py)
  gguf_tiny_qwen2.gguf     a 1-layer qwen2 with q/k/v biases and tied embeddings
"""

import math
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "model", "tests", "data")
rng = np.random.default_rng(20261129)


def f16_bytes(x):
    return np.asarray(x, dtype=np.float16).view(np.uint8)


# Byte offsets of the f16 scale fields in each block type (kept finite and small).
SCALE_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
# Types added later draw from their own generator, so the files made before stay byte for byte.
LATER_SCALE_FIELDS = {T.Q2_K: [80, 82], T.Q3_K: [108], T.IQ4_NL: [0], T.IQ4_XS: [0]}
later_rng = np.random.default_rng(20261202)


# The FP4 types' scales are bytes, not f16: MXFP4's E8M0 exponent is kept near one (random bytes
# overflow to infinities), NVFP4's E4M3 scales are finite whatever their bytes.
FP4_TYPES = [T.MXFP4, T.NVFP4]
fp4_rng = np.random.default_rng(20261210)


def fp4_blocks(qtype, rows, cols):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = fp4_rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == T.MXFP4:
        raw[:, 0] = fp4_rng.integers(110, 136, size=n_blocks, dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def random_blocks(qtype, rows, cols, gen, fields):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = gen.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in fields[qtype]:
        scales = gen.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, cols // block * size)


def write_dequant_file():
    path = os.path.join(OUT, "gguf_dequant.gguf")
    w = gguf.GGUFWriter(path, "testdata")
    rows, cols = 2, 256
    floats = rng.standard_normal((rows, cols)).astype(np.float32)
    w.add_tensor("F32", floats)
    w.add_tensor("F32.expected", floats)
    half = floats.astype(np.float16)
    w.add_tensor("F16", half)
    w.add_tensor("F16.expected", half.astype(np.float32))
    bf16 = gguf.quants.quantize(floats, T.BF16)
    w.add_tensor("BF16", bf16, raw_dtype=T.BF16)
    w.add_tensor("BF16.expected", gguf.quants.dequantize(bf16, T.BF16).astype(np.float32))
    for qtype, gen, fields in [(q, rng, SCALE_FIELDS) for q in SCALE_FIELDS] + [
        (q, later_rng, LATER_SCALE_FIELDS) for q in LATER_SCALE_FIELDS
    ]:
        raw = random_blocks(qtype, rows, cols, gen, fields)
        w.add_tensor(qtype.name, raw, raw_dtype=qtype)
        w.add_tensor(qtype.name + ".expected", gguf.quants.dequantize(raw, qtype).astype(np.float32))
    for qtype in FP4_TYPES:
        raw = fp4_blocks(qtype, rows, cols)
        w.add_tensor(qtype.name, raw, raw_dtype=qtype)
        w.add_tensor(qtype.name + ".expected", gguf.quants.dequantize(raw, qtype).astype(np.float32))
    finish(w, path)


def finish(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def llama_cpp_permute(weights, n_head, n_head_kv):
    """conversion/llama.py `LlamaModel.permute`: HF layout -> GGUF (Meta) layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_permute(w, n_heads):
    """transformers convert_llama_weights_to_hf.py `permute`: Meta (GGUF) layout -> HF layout."""
    dim1 = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(dim1, *rest)


def store(w, name, array, qtype):
    """Writes `array` (HF layout [out, in] or 1-D) as `qtype`; returns its dequantised values."""
    array = array.astype(np.float32)
    if qtype == T.F32:
        w.add_tensor(name, array)
        return array
    if qtype == T.F16:
        h = array.astype(np.float16)
        w.add_tensor(name, h)
        return h.astype(np.float32)
    q = gguf.quants.quantize(array, qtype)
    w.add_tensor(name, q, raw_dtype=qtype)
    return gguf.quants.dequantize(q, qtype).astype(np.float32).reshape(array.shape)


# The tiny llama's shape and RoPE scaling (asserted by crates/model/tests/gguf_source.rs).
LLAMA = dict(hidden=64, n_head=4, n_head_kv=2, head_dim=16, ff=128, vocab=96, layers=2, ctx=512,
             theta=10000.0, eps=1e-5, factor=4.0, low=1.0, high=32.0, original=4096)


def llama3_rope_factors(rot_dim, theta, factor, low, high, original):
    """conversion/llama.py `generate_extra_tensors`: per-frequency RoPE divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_llama():
    c = LLAMA
    path = os.path.join(OUT, "gguf_tiny_llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ff"])
    w.add_head_count(c["n_head"])
    w.add_head_count_kv(c["n_head_kv"])
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_uint32("llama.rope.scaling.original_context_length", c["original"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    expected = {}
    h, d = c["hidden"], c["head_dim"]
    rnd = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)
    expected["model.embed_tokens.weight"] = store(w, "token_embd.weight", rnd(c["vocab"], h), T.Q8_0)
    w.add_tensor("rope_freqs.weight", llama3_rope_factors(d, c["theta"], c["factor"], c["low"], c["high"], c["original"]))
    q_types = [T.F16, T.Q4_1]
    k_types = [T.BF16, T.Q5_0]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        expected[p + "input_layernorm.weight"] = store(w, f"blk.{i}.attn_norm.weight", rnd(h) + 1, T.F32)
        q_hf, k_hf = rnd(c["n_head"] * d, h), rnd(c["n_head_kv"] * d, h)
        for name, hf, heads, qtype in [("attn_q", q_hf, c["n_head"], q_types[i]), ("attn_k", k_hf, c["n_head_kv"], k_types[i])]:
            gg = llama_cpp_permute(hf, c["n_head"], c["n_head_kv"] if name == "attn_k" else c["n_head"])
            if qtype == T.BF16:
                raw = gguf.quants.quantize(gg, T.BF16)
                w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=T.BF16)
                stored = gguf.quants.dequantize(raw, T.BF16).astype(np.float32).reshape(gg.shape)
            else:
                stored = store(w, f"blk.{i}.{name}.weight", gg, qtype)
            hf_name = p + ("self_attn.q_proj.weight" if name == "attn_q" else "self_attn.k_proj.weight")
            expected[hf_name] = hf_permute(stored, heads)
        expected[p + "self_attn.v_proj.weight"] = store(w, f"blk.{i}.attn_v.weight", rnd(c["n_head_kv"] * d, h), T.Q8_0)
        expected[p + "self_attn.o_proj.weight"] = store(w, f"blk.{i}.attn_output.weight", rnd(h, c["n_head"] * d), T.Q4_0)
        expected[p + "post_attention_layernorm.weight"] = store(w, f"blk.{i}.ffn_norm.weight", rnd(h) + 1, T.F32)
        expected[p + "mlp.gate_proj.weight"] = store(w, f"blk.{i}.ffn_gate.weight", rnd(c["ff"], h), T.Q5_1)
        expected[p + "mlp.up_proj.weight"] = store(w, f"blk.{i}.ffn_up.weight", rnd(c["ff"], h), T.F32)
        expected[p + "mlp.down_proj.weight"] = store(w, f"blk.{i}.ffn_down.weight", rnd(h, c["ff"]), T.Q4_1)
    expected["model.norm.weight"] = store(w, "output_norm.weight", rnd(h) + 1, T.F32)
    expected["lm_head.weight"] = store(w, "output.weight", rnd(c["vocab"], h), T.Q8_0)
    finish(w, path)

    path = os.path.join(OUT, "gguf_tiny_llama.expected.gguf")
    w = gguf.GGUFWriter(path, "expected")
    # Kept under 200 KB: the permuted Q/K of both layers, plus tensors whose HF shape differs
    # from their GGUF dims order (embeddings, lm_head, down_proj).
    keep = [n for n in expected if "q_proj" in n or "k_proj" in n]
    keep += ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"]
    for name in keep:
        w.add_tensor(name, expected[name].astype(np.float32))
    finish(w, path)


def write_tiny_qwen2():
    path = os.path.join(OUT, "gguf_tiny_qwen2.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    h, n_head, n_kv, d, ff, vocab = 64, 4, 2, 16, 96, 80
    w.add_context_length(1024)
    w.add_embedding_length(h)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(5)
    rnd = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)
    store(w, "token_embd.weight", rnd(vocab, h), T.Q8_0)
    store(w, "blk.0.attn_norm.weight", rnd(h), T.F32)
    store(w, "blk.0.attn_q.weight", rnd(n_head * d, h), T.Q4_0)
    store(w, "blk.0.attn_q.bias", rnd(n_head * d), T.F32)
    store(w, "blk.0.attn_k.weight", rnd(n_kv * d, h), T.F16)
    store(w, "blk.0.attn_k.bias", rnd(n_kv * d), T.F32)
    store(w, "blk.0.attn_v.weight", rnd(n_kv * d, h), T.Q8_0)
    store(w, "blk.0.attn_v.bias", rnd(n_kv * d), T.F32)
    store(w, "blk.0.attn_output.weight", rnd(h, n_head * d), T.Q8_0)
    store(w, "blk.0.ffn_norm.weight", rnd(h), T.F32)
    store(w, "blk.0.ffn_gate.weight", rnd(ff, h), T.Q8_0)
    store(w, "blk.0.ffn_up.weight", rnd(ff, h), T.Q8_0)
    store(w, "blk.0.ffn_down.weight", rnd(h, ff), T.Q8_0)
    store(w, "output_norm.weight", rnd(h), T.F32)
    finish(w, path)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    print(f"gguf-py {getattr(gguf, '__version__', '?')}, numpy {np.__version__}", file=sys.stderr)
    write_dequant_file()
    write_tiny_llama()
    write_tiny_qwen2()
