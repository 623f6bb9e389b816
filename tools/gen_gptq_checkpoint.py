#!/usr/bin/env python3
"""A GPTQ checkpoint of a BF16/F16 HF llama checkpoint (e.g. `entrollm synth`'s), numpy only.

Every decoder linear (q/k/v/o, gate/up/down) is quantised round-to-nearest in groups as GPTQ's
`quantize` sets its parameters (symmetric: zero 2^(bits-1), scale max|w|·2/(2^bits − 1), the F16
scale used to round) and packed as gptqmodel 7.7.0's `PackableQuantLinear.pack_original` packs it
(qweight int32 [in·bits/32, out], qzeros int32 [groups, out·bits/32], scales F16 [groups, out],
g_idx int32 [in]), in the v1 format its checkpoints carry (`checkpoint_format: gptq`, zeros stored
less one). The embedding, LM head and norms are copied as they are. The vectorised packing is
checked against a transcription of pack_original's loops on a small matrix first (the same
transcription tools/gen_hf_quant_testdata.py checks our reader against).

  python3 tools/gen_gptq_checkpoint.py SRC_DIR OUT_DIR [--bits 4] [--group 128] [--jobs N]

Bits 2, 4 or 8; the output is one model.safetensors with config.json (quantization_config added)
and the source's other JSON files (tokenizer, generation config) copied.
"""
import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import struct
import sys

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4),
          "I32": (np.int32, 4)}


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h, 8 + n


def source_tensors(src):
    """name -> (file, absolute offset, dtype, shape)."""
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        sys.exit(f"{src}: no .safetensors files")
    out = {}
    for f in files:
        p = os.path.join(src, f)
        h, base = header(p)
        for name, t in h.items():
            a, b = t["data_offsets"]
            out[name] = (p, base + a, t["dtype"], t["shape"], b - a)
    return out


def is_linear(name):
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS and ".layers." in name


def as_f32(raw, dtype):
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return raw.astype(np.float32)
    if dtype == "F32":
        return raw
    raise ValueError(f"cannot quantise a {dtype} matrix")


def quantise(w, bits, group):
    """(codes int [out, in], scales f16 [groups, out], zero) as GPTQ's symmetric RTN sets them."""
    out_f, in_f = w.shape
    maxq = 2 ** bits - 1
    wg = w.reshape(out_f, in_f // group, group)
    xmin = np.minimum(wg.min(-1), np.float32(0))
    xmax = np.maximum(wg.max(-1), np.float32(0))
    xmax = np.maximum(np.abs(xmin), xmax)
    xmax = np.where(xmax == 0, np.float32(1), xmax)  # GPTQ's guard against an all-zero group
    s = (xmax * np.float32(2) / np.float32(maxq)).astype(np.float32)
    s16 = s.astype(np.float16)
    sf = s16.astype(np.float32)[..., None]
    zero = (maxq + 1) // 2
    q = np.rint((wg + np.float32(zero) * sf) / sf)
    q = np.clip(q, 0, maxq).astype(np.uint32).reshape(out_f, in_f)
    return q, np.ascontiguousarray(s16.T), zero


def pack_fast(q, bits):
    """pack_original's qweight of codes q [out, in] (2/4/8 bits), vectorised."""
    out_f, in_f = q.shape
    pf = 32 // bits
    t = q.T.reshape(in_f // pf, pf, out_f)
    words = np.zeros((in_f // pf, out_f), dtype=np.uint32)
    for j in range(pf):
        words |= t[:, j, :] << np.uint32(bits * j)
    return words


def pack_loops(q, bits):
    """pack_original's loops (gptqmodel 7.7.0), transcribed: the reference of pack_fast."""
    iw = q.T.astype(np.uint64)  # [in, out]
    pf = 32 // bits
    qweight = np.zeros((math.ceil(iw.shape[0] * bits / 32), iw.shape[1]), dtype=np.uint64)
    for row in range(qweight.shape[0]):
        for j in range(min(pf, iw.shape[0] - row * pf)):
            qweight[row] |= iw[row * pf + j] << np.uint64(bits * j)
    return qweight.astype(np.uint32)


def qzeros_v1(groups, out_f, bits, zero):
    """qzeros [groups, out·bits/32] of one zero for all, v1 (each field less one)."""
    pf = 32 // bits
    word = 0
    for j in range(pf):
        word |= ((zero - 1) & (2 ** bits - 1)) << (bits * j)
    return np.full((groups, out_f // pf), word, dtype=np.uint32)


def self_check(bits, group):
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.02, size=(40, 4 * group)).astype(np.float32)
    q, _, _ = quantise(w, bits, group)
    if not np.array_equal(pack_fast(q, bits), pack_loops(q, bits)):
        sys.exit("vectorised packing differs from pack_original's loops")


def out_tensors(name, dtype, shape, bits, group):
    """The output tensors of a source tensor: (name, dtype, shape)."""
    if not is_linear(name):
        return [(name, dtype, shape)]
    out_f, in_f = shape
    p = name[: -len(".weight")]
    g = in_f // group
    return [(f"{p}.qweight", "I32", [in_f * bits // 32, out_f]),
            (f"{p}.qzeros", "I32", [g, out_f * bits // 32]),
            (f"{p}.scales", "F16", [g, out_f]),
            (f"{p}.g_idx", "I32", [in_f])]


JOB = {}


def init(job):
    JOB.update(job)


def convert(item):
    """Writes the output tensors of one source tensor into the output file at their offsets."""
    name, (path, off, dtype, shape, nbytes) = item
    outs = JOB["layout"][name]
    mm = np.memmap(JOB["out"], mode="r+", dtype=np.uint8)
    if not is_linear(name):
        (_, a, b) = outs[0]
        with open(path, "rb") as f:
            f.seek(off)
            mm[a:b] = np.frombuffer(f.read(nbytes), dtype=np.uint8)
        mm.flush()
        return name
    bits, group = JOB["bits"], JOB["group"]
    np_dt, size = DTYPES[dtype]
    raw = np.fromfile(path, dtype=np_dt, count=nbytes // size, offset=off).reshape(shape)
    w = as_f32(raw, dtype)
    q, s16, zero = quantise(w, bits, group)
    out_f, in_f = shape
    arrays = [pack_fast(q, bits), qzeros_v1(in_f // group, out_f, bits, zero), s16,
              (np.arange(in_f) // group).astype(np.int32)]
    for (_, a, b), arr in zip(outs, arrays):
        mm[a:b] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    mm.flush()
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4, 8])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args()
    if os.path.exists(a.out) and os.listdir(a.out):
        sys.exit(f"{a.out} exists and is not empty")
    self_check(a.bits, a.group)
    src = source_tensors(a.src)
    for name, (_, _, dtype, shape, _) in src.items():
        if is_linear(name) and (len(shape) != 2 or shape[1] % a.group or shape[0] % (32 // a.bits)):
            sys.exit(f"{name}: shape {shape} is not whole groups of {a.group} ({a.bits} bits)")
    # The output's header, then every tensor at its offset.
    hdr, layout, at = {}, {}, 0
    for name, (_, _, dtype, shape, _) in src.items():
        layout[name] = []
        for (n, dt, sh) in out_tensors(name, dtype, shape, a.bits, a.group):
            size = DTYPES[dt][1] * int(np.prod(sh))
            hdr[n] = {"dtype": dt, "shape": sh, "data_offsets": [at, at + size]}
            layout[name].append((n, at, at + size))
            at += size
    hj = json.dumps(hdr, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    base = 8 + len(hj)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "model.safetensors")
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        f.truncate(base + at)
    layout = {k: [(n, base + x, base + y) for (n, x, y) in v] for k, v in layout.items()}
    job = {"out": tmp, "layout": layout, "bits": a.bits, "group": a.group}
    items = sorted(src.items(), key=lambda kv: -kv[1][4])
    done = 0
    with mp.Pool(a.jobs, initializer=init, initargs=(job,)) as pool:
        for _ in pool.imap_unordered(convert, items):
            done += 1
            print(f"\r{done}/{len(items)} tensors", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    os.replace(tmp, path)
    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": a.bits, "group_size": a.group,
                                  "desc_act": False, "sym": True, "checkpoint_format": "gptq",
                                  "pack_dtype": "int32"}
    cfg["torch_dtype"] = "float16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for f in os.listdir(a.src):
        if f.endswith(".json") and f not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(a.src, f), os.path.join(a.out, f))
    print(f"{path}: {base + at} bytes")


if __name__ == "__main__":
    main()
