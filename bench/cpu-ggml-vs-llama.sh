#!/bin/bash
# CPU decode speed of entrollm and llama.cpp on the same GGUF files, same threads, back to back:
#   bash bench/cpu-ggml-vs-llama.sh ENTROLLM LLAMA_BIN_DIR THREADS TOKENS ROUNDS A.gguf [B.gguf ...]
# Per file and round: `entrollm run` (greedy, its timing line and peak RSS) then `llama-bench -n
# TOKENS -p 0 -r 1` (its tg figure); the round's order alternates so that neither always runs first.
# ENTROLLM_ARGS: more flags for `entrollm run` (e.g. "--activations q8").
set -euo pipefail
bin=$1; llama=$2; t=$3; n=$4; rounds=$5; shift 5
echo "date $(date -u +%FT%TZ); $(lscpu | grep -m1 'Model name'); nproc $(nproc); entrollm args: ${ENTROLLM_ARGS:-none}"
ours() {
    /usr/bin/time -f "peak RSS %M kB" "$bin" run "$1" -p "Once upon a time" -n "$n" --device cpu -t "$t" ${ENTROLLM_ARGS:-} 2>&1 >/dev/null \
        | grep -E "^\[ prompt|peak RSS" | tr '\n' ' '; echo
}
theirs() { "$llama/llama-bench" -m "$1" -t "$t" -n "$n" -p 0 -r 1 -o csv 2>/dev/null | tail -1; }
for g in "$@"; do
    echo "== $(basename "$g") ($(stat -c %s "$g") bytes)"
    for r in $(seq "$rounds"); do
        if [ $((r % 2)) = 1 ]; then echo "entrollm: $(ours "$g")"; echo "llama.cpp: $(theirs "$g")"
        else echo "llama.cpp: $(theirs "$g")"; echo "entrollm: $(ours "$g")"; fi
    done
done
