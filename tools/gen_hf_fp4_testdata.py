#!/usr/bin/env python3
"""Test data for the FP4 and int-quantized compressed-tensors readers (crates/model/src/hf_quant.rs).

Writes crates/model/tests/data/hfq/fp4.safetensors + fp4.json: small matrices of every case as
compressed-tensors writes them (its own parameter calculation `calculate_qparams` /
`generate_gparam` and compressors `NVFP4PackedCompressor`, `MXFP4PackedCompressor`,
`IntQuantizationCompressor`), each with `<case>.ref`: its reference dequantisation in f32 (the
compressor's `decompress`, with the scales widened to f32 first so that nothing rounds to BF16);
and a tiny llama checkpoint per format (nvfp4/, mxfp4/, intq/, with <fmt>.expected.json:
transformers' f32 logits of the model made of the reference's dequantised weights), by
tools/gen_hf_quant_testdata.py's `model`.

  pip install compressed-tensors==0.20.1   (torch comes with it)
  python3 tools/gen_hf_fp4_testdata.py
"""
import json
import os

import torch
from safetensors.torch import save_file

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from gen_hf_quant_testdata import ct_config, ct_pack, model

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "model", "tests", "data", "hfq")
torch.manual_seed(11)


def config(fmt, args):
    w = args.model_dump(mode="json")
    for k in ("observer", "observer_kwargs", "block_structure", "actorder"):
        w.pop(k, None)
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}},
            "ignore": ["lm_head"]}


def fp4(w, preset, compressor, fmt):
    args = PRESET_SCHEMES[preset]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out_f, in_f = w.shape
    g = args.group_size
    wg = w.reshape(out_f, in_f // g, g)
    sd = {"weight": w}
    gs = None
    if fmt == "nvfp4-pack-quantized":
        gs = generate_gparam(w.amin(), w.amax())
        sd["weight_global_scale"] = gs
    scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=gs)
    sd["weight_scale"] = scale
    packed = compressor.compress(sd, scheme)
    # Reference: the compressor's own unpacking and dequantisation, in f32.
    codes = unpack_fp4_from_uint8(packed["weight_packed"], out_f, in_f, dtype=torch.float32)
    s = compressor._decompress_scale(packed["weight_scale"], torch.float32)
    ref = dequantize(x_q=codes, scale=s, args=args, global_scale=packed.get("weight_global_scale"),
                     dtype=torch.float32)
    return packed, config(fmt, args), ref.float()


def intq(w, bits, symmetric, group, sdtype):
    packed, weights, ref = ct_pack(w, bits, symmetric, group, sdtype, IntQuantizationCompressor)
    return packed, {**ct_config(weights), "format": "int-quantized"}, ref


def main():
    tensors, cases = {}, []

    def add(name, packed, cfg, ref):
        for k, v in packed.items():
            tensors[f"{name}.{k}"] = v.contiguous()
        tensors[f"{name}.ref"] = ref.contiguous()
        cases.append({"name": name, "quantization_config": cfg})

    for rows, cols in [(24, 128), (7, 192)]:
        w = torch.randn(rows, cols) * 0.05
        w[0, :16] *= 40  # one group far larger than the rest: its scale near the top of FP8
        add(f"ct_nvfp4_{rows}x{cols}",
            *fp4(w, "NVFP4A16", NVFP4PackedCompressor, "nvfp4-pack-quantized"))
    for rows, cols in [(10, 96), (3, 256)]:
        w = torch.randn(rows, cols) * 0.05
        add(f"ct_mxfp4_{rows}x{cols}",
            *fp4(w, "MXFP4A16", MXFP4PackedCompressor, "mxfp4-pack-quantized"))
    for name, bits, sym, group, sdtype, shape in [
        ("ct_intq_int8_sym_channel", 8, True, None, torch.bfloat16, (12, 64)),
        ("ct_intq_int4_asym_g32", 4, False, 32, torch.float16, (9, 96)),
        ("ct_intq_int8_sym_g64", 8, True, 64, torch.float32, (5, 128)),
    ]:
        w = torch.randn(*shape) * 0.05
        add(name, *intq(w, bits, sym, group, sdtype))

    save_file(tensors, os.path.join(OUT, "fp4.safetensors"))
    with open(os.path.join(OUT, "fp4.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    for k, v in sorted(tensors.items()):
        print(k, v.dtype, tuple(v.shape))

    torch.manual_seed(12)
    model("nvfp4", lambda w: fp4(w, "NVFP4A16", NVFP4PackedCompressor, "nvfp4-pack-quantized"))
    model("mxfp4", lambda w: fp4(w, "MXFP4A16", MXFP4PackedCompressor, "mxfp4-pack-quantized"))
    model("intq", lambda w: intq(w, 8, True, None, torch.bfloat16))


if __name__ == "__main__":
    main()
