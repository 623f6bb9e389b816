#!/usr/bin/env python3
"""Prefill throughput of a Llama-3.1-8B-shaped model in PyTorch (cuBLAS GEMMs + SDPA), the peer of
`entrollm bench --synth llama-3.1-8b --prefill-len 4096`.

The model: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocabulary
128256, untied LM head, llama3 RoPE (theta 500000) -- random BF16 weights (N(0, sigma^2), sigma as
entrollm's synth), all in BF16 like HF transformers' BF16 inference: RMSNorm in f32 then cast, fused
q/k/v and gate/up projections (one GEMM each, as we do), RoPE, K/V repeated to the query heads
(HF's repeat_kv) and `scaled_dot_product_attention(is_causal=True)`, SwiGLU, residuals; the final
norm and LM head on the last token only (what a generation needs, and what entrollm computes).
Timed with CUDA events around the whole forward, after warm-ups; median of the runs.

Usage: python3 bench/torch_prefill.py [--tokens 4096] [--runs 5] [--json out.json]
"""
import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

H, I, L, NQ, NKV, D, V = 4096, 14336, 32, 32, 8, 128, 128256
EPS = 1e-5


def rope_inv_freq():
    base, factor, low, high, orig = 500000.0, 8.0, 1.0, 4.0, 8192.0
    out = []
    for i in range(D // 2):
        f = base ** (-(2 * i) / D)
        wl = 2 * math.pi / f
        if wl < orig / high:
            out.append(f)
        elif wl > orig / low:
            out.append(f / factor)
        else:
            s = (orig / wl - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(torch.bfloat16)


def rotate(x, cos, sin):  # x [1, heads, n, D], NEOX pairs (i, i + D/2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16

    def mat(rows, cols, sigma):
        return (torch.randn(rows, cols, device=dev, dtype=torch.float32) * sigma).to(bf)

    layers = []
    for _ in range(L):
        layers.append(
            dict(
                ln1=torch.ones(H, device=dev),
                qkv=mat(NQ * D + 2 * NKV * D, H, 0.025),
                o=mat(H, NQ * D, 0.015),
                ln2=torch.ones(H, device=dev),
                gate_up=mat(2 * I, H, 0.018),
                down=mat(H, I, 0.015),
            )
        )
    embed = mat(V, H, 0.012)
    lm_head = mat(V, H, 0.012)
    final_norm = torch.ones(H, device=dev)
    n = a.tokens
    tokens = torch.randint(0, V, (n,), device=dev)
    pos = torch.arange(n, device=dev, dtype=torch.float64)
    ang = torch.outer(pos, rope_inv_freq().to(dev))
    cos = ang.cos().to(bf)[None, None]
    sin = ang.sin().to(bf)[None, None]
    k_cache = [torch.empty(1, NKV, n, D, device=dev, dtype=bf) for _ in range(L)]
    v_cache = [torch.empty(1, NKV, n, D, device=dev, dtype=bf) for _ in range(L)]

    @torch.inference_mode()
    def forward():
        x = embed[tokens]  # [n, H] bf16
        for li, w in enumerate(layers):
            h = rms_norm(x, w["ln1"])
            qkv = h @ w["qkv"].t()
            q = qkv[:, : NQ * D].view(n, NQ, D).transpose(0, 1)[None]
            k = qkv[:, NQ * D : NQ * D + NKV * D].view(n, NKV, D).transpose(0, 1)[None]
            v = qkv[:, NQ * D + NKV * D :].view(n, NKV, D).transpose(0, 1)[None]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k_cache[li].copy_(k)
            v_cache[li].copy_(v)
            rep = NQ // NKV
            kr = k.repeat_interleave(rep, dim=1)
            vr = v.repeat_interleave(rep, dim=1)
            att = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            x = x + att[0].transpose(0, 1).reshape(n, NQ * D) @ w["o"].t()
            h = rms_norm(x, w["ln2"])
            gu = h @ w["gate_up"].t()
            x = x + (F.silu(gu[:, :I]) * gu[:, I:]) @ w["down"].t()
        last = rms_norm(x[-1:], final_norm)
        return (last @ lm_head.t()).float().argmax(-1)

    for _ in range(a.warmup):
        forward()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        forward()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    med = statistics.median(times)
    out = dict(
        peer="pytorch cuBLAS + SDPA (bf16, repeat_kv, is_causal)",
        torch=torch.__version__,
        device=torch.cuda.get_device_name(),
        tokens=n,
        runs_s=times,
        median_s=med,
        tok_s=n / med,
    )
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
