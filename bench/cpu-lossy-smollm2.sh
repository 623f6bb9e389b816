#!/bin/bash
# Lossy coding on a real model: SmolLM2-135M-Instruct's weights (its Q4_1 GGUF dequantised to F32
# by the gguf package: tools/gguf_f32_reference.py) coded at several rates, beside llama.cpp's own
# k-quant mixes of the same F32 weights, each scored against the F32 model on the same windows
# (perplexity, KL divergence, same top token), and one chat at 4 bits:
#   bash bench/cpu-lossy-smollm2.sh ENTROLLM LLAMA_QUANTIZE F32.gguf TEXT OUTDIR [TOKENS]
# (TOKENS: the first this many tokens of TEXT are scored, default 1536: the CPU scores two models
# token by token; LLAMA_QUANTIZE "-": no llama.cpp quantisations). SPECS (environment) lists the
# entrollm codings, each NAME=compress flags after the source, separated by ';' (default: tcq32 at
# 3, 4, 5 bits and e8 at 4, allocated by rate and distortion, data-free); a calibration text
# goes in the flags (--calib FILE), and should not be TEXT.
# The token embedding (tied to the output) stays F32 on both sides, so only the 210 matrices of the
# decoder differ; their bits a weight come from `inspect`.
set -euo pipefail
bin=$1; quant=$2; f32=$3; text=$4; out=$5; tokens=${6:-1536}
mkdir -p "$out"
eval_one() { # NAME MODEL
    echo "== $1" | tee -a "$out/eval.txt"
    "$bin" inspect "$2" --json > "$out/$1.inspect.json"
    python3 - "$out/$1.inspect.json" <<'PY' | tee -a "$out/eval.txt"
import json, sys
t = json.load(open(sys.argv[1]))["tensors"]
m = [r for r in t if len(r["shape"]) == 2 and "token_embd" not in r["name"]]
n = sum(r["numel"] for r in m)
b = sum(r["stored_bytes"] for r in m)
print(f"decoder matrices: {len(m)}, {n} weights, {8 * b / n:.3f} bits a weight")
PY
    "$bin" eval ppl "$2" --reference "$f32" --file "$text" --window 512 --stride 256 \
        --max-tokens "$tokens" --device cpu -t 2 2>&1 | grep -v "^note:" | tee -a "$out/eval.txt"
}
: > "$out/eval.txt"; : > "$out/compress.txt"
specs=${SPECS:-tcq32-3=--bits 3;tcq32-4=--bits 4;tcq32-5=--bits 5;e8-4=--bits 4 --quantizer e8}
IFS=';' read -ra specs <<< "$specs"
for spec in "${specs[@]}"; do
    name=${spec%%=*}; read -ra flags <<< "${spec#*=}"
    c="$out/smol-$name"
    echo "== $name: ${flags[*]}" >> "$out/compress.txt"
    /usr/bin/time -f "compress $name: %e s, peak RSS %M KB" \
        "$bin" compress "$f32" -o "$c" "${flags[@]}" --overwrite 2>&1 | tail -5 | tee -a "$out/compress.txt"
    eval_one "$name" "$c"
done
[[ $quant == - ]] && exit 0
for t in Q3_K_M Q4_K_M Q5_K_M; do
    g="$out/smol-$t.gguf"
    "$quant" --token-embedding-type f32 --output-tensor-type f32 "$f32" "$g" "$t" 2 > "$out/quantize-$t.log" 2>&1
    eval_one "llama.cpp-$t" "$g"
done
echo "What is the capital of France?" | "$bin" chat "$out/smol-tcq32-4" --max-tokens 40 --device cpu 2>&1 \
    | tee "$out/chat-tcq32-4.txt"
