#!/usr/bin/env python3
"""Test data for the integer-quantised HF checkpoint reader (crates/model/src/hf_quant.rs).

Writes crates/model/tests/data/hfq/:
  matrices.safetensors + matrices.json  small matrices of every case, packed, with `<case>.ref`,
                                        the reference dequantisation in f32;
  <fmt>/config.json, model.safetensors  a tiny llama checkpoint per format (ct, gptq, awq);
  <fmt>.expected.json                   transformers' f32 logits of that model made of the
                                        reference's dequantised weights.

compressed-tensors: its own quantiser (calculate_qparams, quantize) and compressor
(PackedQuantizationCompressor.compress / decompress) from PyPI. GPTQ and AWQ: the packers
(gptqmodel, autoawq) need CUDA builds, so their pack steps are transcribed here from their
published source (gptqmodel 7.7.0 `PackableQuantLinear.pack_original` and
`convert_gptq_v2_to_v1_format_module`; autoawq 0.2.9 `WQLinear_GEMM.from_linear`), and the
reference dequantisation is theirs (`scales[g_idx] * (weight - zeros[g_idx])`,
`(iweight - izeros) * scales`) in f32.

Needs: pip install compressed-tensors (torch, transformers come with it).
"""
import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_qparams

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "model", "tests", "data", "hfq")
torch.manual_seed(7)
np.random.seed(7)


# ---------------------------------------------------------------- compressed-tensors
def ct_pack(w, bits, symmetric, group, sdtype, compressor=PackedQuantizationCompressor):
    """(tensors, config weights, reference f32) of w [out, in] by compressed-tensors (`compressor`:
    pack-quantized's, or int-quantized's IntQuantizationCompressor)."""
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out_f, in_f = w.shape
    g = group or in_f
    wg = w.to(sdtype).reshape(out_f, in_f // g, g)
    scale, zp = calculate_qparams(wg.amin(dim=-1), wg.amax(dim=-1), args)
    sd = {"weight": w.to(sdtype), "weight_scale": scale.to(sdtype)}
    if not symmetric:
        sd["weight_zero_point"] = zp.to(torch.int8)
    packed = compressor.compress(sd, scheme)
    # The reference dequantisation, in f32 (its arithmetic: `(x_q - zero_point) * scale`).
    back = dict(packed)
    back["weight_scale"] = packed["weight_scale"].float()
    ref = compressor.decompress(back, scheme)["weight"].float()
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group, "dynamic": False}
    return packed, weights, ref


def ct_config(weights):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"]}


# ---------------------------------------------------------------- GPTQ (gptqmodel layout)
def gptq_qparams(w, bits, sym, group, desc_act):
    """GPTQ-style scales/zeros per group and g_idx (columns quantised in a permuted order)."""
    out_f, in_f = w.shape
    g = group if group > 0 else in_f
    maxq = 2 ** bits - 1
    perm = torch.randperm(in_f) if desc_act else torch.arange(in_f)
    invperm = torch.argsort(perm)
    g_idx = (torch.arange(in_f) // g)[invperm].to(torch.int32)  # group of each original input
    n_groups = in_f // g
    scales = torch.zeros(n_groups, out_f)
    zeros = torch.zeros(n_groups, out_f)
    for gi in range(n_groups):
        cols = (g_idx == gi).nonzero().flatten()
        xmin = torch.minimum(w[:, cols].amin(1), torch.zeros(1))
        xmax = torch.maximum(w[:, cols].amax(1), torch.zeros(1))
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        s = (xmax - xmin) / maxq
        z = torch.full_like(s, (maxq + 1) / 2) if sym else torch.round(-xmin / s)
        scales[gi], zeros[gi] = s, z
    return scales, zeros, g_idx


def gptq_pack(w, bits, sym, group, desc_act, v1):
    """gptqmodel's pack_original (2/3/4/8 bits), then its v2 -> v1 qzeros conversion."""
    out_f, in_f = w.shape
    maxq = 2 ** bits - 1
    scales32, zeros, g_idx = gptq_qparams(w, bits, sym, group, desc_act)
    # pack_original: scales [groups, out] are transposed to [out, groups] by the caller's
    # convention; here they already are [groups, out], as the module stores them.
    scales16 = scales32.to(torch.float16)
    scale_zeros = zeros * scales16.float()
    gi = g_idx.long()
    int_weight = torch.round((w + scale_zeros[gi].T) / scales16.float()[gi].T)
    int_weight.clamp_(0, maxq)
    int_weight = int_weight.to(torch.int32).T.contiguous().numpy().astype(np.uint64)  # [in, out]
    ref = (scales16.float()[gi] * (torch.from_numpy(int_weight.astype(np.float32))
                                   - zeros[gi])).T.contiguous()  # [out, in]
    pf = 32 // bits if bits != 3 else None
    qweight = np.zeros((math.ceil(in_f * bits / 32), out_f), dtype=np.uint64)
    if bits in (2, 4, 8):
        for row in range(qweight.shape[0]):
            for j in range(min(pf, in_f - row * pf)):
                qweight[row] |= int_weight[row * pf + j] << np.uint64(bits * j)
    else:
        pack3(qweight, int_weight)
    z = zeros.numpy().astype(np.uint64)
    qzeros = np.zeros((z.shape[0], math.ceil(z.shape[1] * bits / 32)), dtype=np.uint64)
    if bits in (2, 4, 8):
        for col in range(qzeros.shape[1]):
            for j in range(min(pf, z.shape[1] - col * pf)):
                qzeros[:, col] |= z[:, col * pf + j] << np.uint64(bits * j)
    else:
        pack3(qzeros.T, z.T)
    qweight = qweight.astype(np.uint32)
    qzeros = qzeros.astype(np.uint32)
    if v1:
        # convert_gptq_v2_to_v1_format_module: one word-wide subtraction for 2/4/8 bits; 3 bits
        # shift each field (`_revert_gptq_v1_qzeros_correction`).
        ones = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}
        if bits in ones:
            qzeros = (qzeros.astype(np.int64) - ones[bits]).astype(np.uint32)
        else:
            fields = ((z.astype(np.int64) - 1) & 7).astype(np.uint64)
            qzeros = np.zeros_like(qzeros, dtype=np.uint64)
            pack3(qzeros.T, fields.T)
            qzeros = qzeros.astype(np.uint32)
    t = {
        "qweight": torch.from_numpy(qweight.view(np.int32).copy()),
        "qzeros": torch.from_numpy(qzeros.view(np.int32).copy()),
        "scales": scales16,
        "g_idx": g_idx,
    }
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
           "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32"}
    return t, cfg, ref


def pack3(q, iw):
    """pack_original's 3-bit loop down the rows of q from the rows of iw (32 values, 3 words)."""
    i = row = 0
    while row < q.shape[0]:
        for j in range(i, i + 10):
            q[row] |= iw[j] << np.uint64(3 * (j - i))
        i += 10
        q[row] |= iw[i] << np.uint64(30)
        row += 1
        q[row] |= (iw[i] >> np.uint64(2)) & np.uint64(1)
        i += 1
        for j in range(i, i + 10):
            q[row] |= iw[j] << np.uint64(3 * (j - i) + 1)
        i += 10
        q[row] |= iw[i] << np.uint64(31)
        row += 1
        q[row] |= (iw[i] >> np.uint64(1)) & np.uint64(0x3)
        i += 1
        for j in range(i, i + 10):
            q[row] |= iw[j] << np.uint64(3 * (j - i) + 2)
        i += 10
        row += 1
    q &= np.uint64(0xFFFFFFFF)


# ---------------------------------------------------------------- AWQ GEMM (autoawq layout)
def awq_pack(w, group):
    """autoawq's WQLinear_GEMM.from_linear, 4 bits, with AWQ's min-max zero-point qparams."""
    out_f, in_f = w.shape
    wg = w.reshape(out_f, in_f // group, group)
    mx, mn = wg.amax(-1), wg.amin(-1)
    s = ((mx - mn).clamp(min=1e-5) / 15)
    z = (-torch.round(mn / s)).clamp(0, 15)
    scales = s.T.contiguous().half()  # [groups, out]
    zeros = z.T.contiguous()  # [groups, out]
    scale_zeros = zeros * scales.float()
    intweight = []
    for idx in range(in_f):
        intweight.append(torch.round((w[:, idx] + scale_zeros[idx // group])
                                     / scales.float()[idx // group]).to(torch.int)[:, None])
    intweight = torch.cat(intweight, dim=1).clamp(0, 15)  # [out, in]
    ref = ((intweight - zeros.T.repeat_interleave(group, 1)).float()
           * scales.float().T.repeat_interleave(group, 1))
    intweight = intweight.t().contiguous().to(torch.int32)  # [in, out]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(x):
        q = torch.zeros((x.shape[0], x.shape[1] // 8), dtype=torch.int32)
        for col in range(x.shape[1] // 8):
            for i in range(8):
                q[:, col] |= x[:, col * 8 + order_map[i]] << (i * 4)
        return q

    t = {"qweight": pack(intweight), "qzeros": pack(zeros.to(torch.int32)), "scales": scales}
    cfg = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group,
           "zero_point": True}
    return t, cfg, ref


# ---------------------------------------------------------------- matrices
def matrices():
    tensors, cases = {}, []

    def add(name, t, cfg, ref, prefix_weight):
        for k, v in t.items():
            tensors[f"{name}.{k}"] = v.contiguous()
        tensors[f"{name}.ref"] = ref.float().contiguous()
        cases.append({"name": name, "quantization_config": cfg})

    w = lambda o, i: torch.randn(o, i) * 0.05
    for name, bits, sym, group, dt in [
        ("ct_int4_sym_g32", 4, True, 32, torch.float16),
        ("ct_int4_asym_g64", 4, False, 64, torch.bfloat16),
        ("ct_int4_asym_channel", 4, False, None, torch.float16),
        ("ct_int8_sym_channel", 8, True, None, torch.float16),
        ("ct_int8_asym_g128", 8, False, 128, torch.bfloat16),
        ("ct_int4_sym_g128_f32", 4, True, 128, torch.float32),
    ]:
        t, weights, ref = ct_pack(w(16, 256), bits, sym, group, dt)
        add(name, t, ct_config(weights), ref, True)
    for name, bits, sym, group, desc, v1, rows in [
        ("gptq_4_sym_g32_desc_v1", 4, True, 32, True, True, 16),
        ("gptq_4_asym_g64_v1", 4, False, 64, False, True, 16),
        ("gptq_3_asym_g32_desc_v1", 3, False, 32, True, True, 32),
        ("gptq_2_sym_channel_v2", 2, True, -1, False, False, 16),
        ("gptq_8_asym_g128_v2", 8, False, 128, False, False, 16),
    ]:
        m = w(rows, 256)
        if not sym:
            # A row of positive weights has zero points of 0: v1 then borrows across fields.
            m[0] = m[0].abs()
        t, cfg, ref = gptq_pack(m, bits, sym, group, desc, v1)
        add(name, t, cfg, ref, False)
    for name, group in [("awq_g32", 32), ("awq_g64", 64), ("awq_g128", 128)]:
        t, cfg, ref = awq_pack(w(16, 256), group)
        add(name, t, cfg, ref, False)
    save_file(tensors, os.path.join(OUT, "matrices.safetensors"))
    with open(os.path.join(OUT, "matrices.json"), "w") as f:
        json.dump(cases, f, indent=1)


# ---------------------------------------------------------------- tiny models
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
          "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float16"}
PROMPT = [1, 5, 17, 200, 33, 9, 120]


def model(fmt, pack):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures",)})
    base = LlamaForCausalLM(cfg).float()
    dense = {k: v.detach().clone() for k, v in base.state_dict().items()}
    embed = (torch.randn(256, 128) * 0.5).half()
    stored = {"model.embed_tokens.weight": embed,
              "model.norm.weight": (1 + 0.1 * torch.randn(128)).half()}
    ref_sd = {"model.embed_tokens.weight": embed.float(), "lm_head.weight": embed.float(),
              "model.norm.weight": stored["model.norm.weight"].float()}
    for n in ["input_layernorm", "post_attention_layernorm"]:
        k = f"model.layers.0.{n}.weight"
        stored[k] = (1 + 0.1 * torch.randn(128)).half()
        ref_sd[k] = stored[k].float()
    qcfg = None
    for lin in LINEARS:
        p = f"model.layers.0.{lin}"
        w = torch.randn_like(dense[p + ".weight"]) * 0.08
        t, qcfg, ref = pack(w)
        for k, v in t.items():
            stored[f"{p}.{k}"] = v.contiguous()
        ref_sd[p + ".weight"] = ref.float()
    d = os.path.join(OUT, fmt)
    os.makedirs(d, exist_ok=True)
    save_file(stored, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**CONFIG, "quantization_config": qcfg}, f, indent=1)
    base.load_state_dict(ref_sd, strict=True)
    base.eval()
    with torch.no_grad():
        logits = base(torch.tensor([PROMPT])).logits[0, -1].tolist()
    with open(os.path.join(OUT, f"{fmt}.expected.json"), "w") as f:
        json.dump({"prompt": PROMPT, "logits": logits}, f)


def main():
    os.makedirs(OUT, exist_ok=True)
    matrices()

    def ct(w):
        t, weights, ref = ct_pack(w, 4, False, 32, torch.bfloat16)
        return t, ct_config(weights), ref

    model("ct", ct)
    model("gptq", lambda w: gptq_pack(w, 4, True, 32, True, True))
    model("awq", lambda w: awq_pack(w, 64))


if __name__ == "__main__":
    sys.exit(main())
