#!/usr/bin/env python3
"""Golden data for crates/format: a safetensors file written by Hugging Face's own writer.

Writes crates/format/tests/data/hf_written.safetensors and hf_written.json (per tensor, in file
order: name, dtype, shape, data file offset, xxh3-64 of the bytes; plus the file's xxh3-64), which
tests/golden.rs compares with what entrollm-format reads and writes.

    pip install safetensors numpy xxhash && python3 tools/format_golden_safetensors.py
"""
import json
import pathlib
import struct

import numpy as np
import xxhash
from safetensors.numpy import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates" / "format" / "tests" / "data"
rng = np.random.default_rng(20261129)
tensors = {
    "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float16),
    "model.norm.weight": rng.standard_normal(8).astype(np.float32),
    "model.layers.0.mlp.up_proj.weight": rng.standard_normal((12, 8)).astype(np.float16),
    "counts": rng.integers(-5, 5, size=(3, 5)).astype(np.int64),
    "mask": rng.integers(0, 2, size=7).astype(bool),
    "bytes.odd": rng.integers(0, 255, size=5).astype(np.uint8),
    "scalar": np.array(3.5, dtype=np.float64),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "name with \"quotes\" and ünïcode": rng.standard_normal(3).astype(np.float32),
}
OUT.mkdir(parents=True, exist_ok=True)
path = OUT / "hf_written.safetensors"
save_file(tensors, str(path), metadata={"format": "pt", "note": "golden"})

raw = path.read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8 : 8 + n])
entries = sorted(
    ((k, v) for k, v in header.items() if k != "__metadata__"),
    key=lambda kv: tuple(kv[1]["data_offsets"]),
)
records = []
for name, info in entries:
    b, e = info["data_offsets"]
    records.append(
        {
            "name": name,
            "dtype": info["dtype"],
            "shape": info["shape"],
            "offset": 8 + n + b,
            "xxh3": xxhash.xxh3_64_hexdigest(raw[8 + n + b : 8 + n + e]),
        }
    )
summary = {"file_xxh3": xxhash.xxh3_64_hexdigest(raw), "header_len": n, "metadata": header.get("__metadata__"), "tensors": records}
(OUT / "hf_written.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
print(path, len(raw), "bytes")
