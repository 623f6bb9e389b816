#!/usr/bin/env python3
"""Coded sizes of a quantised checkpoint's container, per kind of tensor, from `inspect --json`.

For each tensor suffix (GPTQ/AWQ `qweight`, `qzeros`, `scales`, `g_idx`; compressed-tensors
`weight_packed`, `weight_scale`, `weight_zero_point`; `weight` for the float matrices): tensors,
source and stored bytes, bits a field and the fields' entropy where coded as fields. Then the
quantised matrices' bits a weight: their packed codes (`qweight`/`weight_packed`) and side tensors
(scales, zeros, act-order indices), stored and in the source, against the entropy bound, where a
weight is one code (a packed word's codes counted from the `bits` of its fields, else 4).

  python3 tools/quant_sizes.py INSPECT.json [--bits N]
"""
import argparse
import json
from collections import defaultdict

CODES = ("qweight", "weight_packed")
SIDE = ("qzeros", "scales", "g_idx", "weight_scale", "weight_zero_point", "weight_g_idx")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inspect")
    ap.add_argument("--bits", type=int, default=4, help="code bits of the packed words")
    a = ap.parse_args()
    rows = json.load(open(a.inspect))["tensors"]
    by = defaultdict(lambda: defaultdict(float))
    for r in rows:
        kind = r["name"].rsplit(".", 1)[-1]
        k = by[kind]
        k["tensors"] += 1
        k["source"] += r["source_bytes"]
        k["stored"] += r["stored_bytes"]
        k["numel"] += r["numel"]
        bound = r.get("entropy_bound_bpw")
        # Plain tensors are bounded by their own bytes here.
        k["bound_bits"] += (bound if bound is not None else r["bits_per_weight"]) * r["numel"]
        coding = r.get("coding") or {}
        if r.get("coder") == "rans-fields":
            k["fields"] += r["stored_bytes"] * 8 / coding["stats"]["bits_per_field"]
            k["fields_stored"] += r["stored_bytes"]
            k["field_bits"] = coding["bits"]
            k["field_entropy_bits"] += coding["stats"]["entropy_bits"] * (
                r["stored_bytes"] * 8 / coding["stats"]["bits_per_field"])
    print(f"{'tensor kind':<20} {'n':>5} {'source MB':>10} {'stored MB':>10} {'%':>6}  fields")
    for kind, k in sorted(by.items(), key=lambda kv: -kv[1]["source"]):
        extra = ""
        if k["fields"]:
            extra = (f"{int(k['field_bits'])}-bit fields: {k['fields_stored'] * 8 / k['fields']:.4f} bits a "
                     f"field, entropy {k['field_entropy_bits'] / k['fields']:.4f}")
        print(f"{kind:<20} {int(k['tensors']):>5} {k['source'] / 1e6:>10.2f} {k['stored'] / 1e6:>10.2f} "
              f"{100 * k['stored'] / max(k['source'], 1):>6.1f}  {extra}")
    codes = [by[c] for c in CODES if c in by]
    if not codes:
        return
    weights = sum(c["source"] * 8 / a.bits for c in codes)
    side = [by[s] for s in SIDE if s in by]
    per = lambda key, group: sum(k[key] for k in group) * 8 / weights
    print(f"quantised matrices, {weights / 1e9:.3f} G weights of {a.bits}-bit codes: "
          f"codes {per('source', codes):.4f} -> {per('stored', codes):.4f} bits a weight "
          f"(bound {sum(k['bound_bits'] for k in codes) / weights:.4f}); "
          f"side tensors {per('source', side):.4f} -> {per('stored', side):.4f} "
          f"(bound {sum(k['bound_bits'] for k in side) / weights:.4f})")


if __name__ == "__main__":
    main()
