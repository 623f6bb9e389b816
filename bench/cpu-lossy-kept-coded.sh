#!/bin/bash
# CPU decode speed of `compress --quantizer int|fp8` containers served kept coded (the dtans form's
# product), decoded at load, and as the default plan serves them, beside llama.cpp's Q4_K_M of the
# same F32 GGUF (llama-bench, and `entrollm run` on that file), rounds alternating:
#   bash bench/cpu-lossy-kept-coded.sh ENTROLLM LLAMA_BIN_DIR F32.gguf THREADS TOKENS ROUNDS C1 [C2 ...]
set -euo pipefail
bin=$1; llama=$2; f32=$3; t=$4; n=$5; rounds=$6; shift 6
echo "date $(date -u +%FT%TZ); $(lscpu | grep -m1 'Model name'); nproc $(nproc); load $(cut -d' ' -f1-3 /proc/loadavg)"
q4="$(dirname "$1")/q4km-$(basename "$f32")"
[ -f "$q4" ] || "$llama/llama-quantize" "$f32" "$q4" Q4_K_M 2 > /dev/null 2>&1
ours() { # MODEL FLAGS...
    local m=$1; shift
    "$bin" run "$m" -p "Once upon a time" -n "$n" --device cpu -t "$t" -c 1024 --temperature 0 "$@" 2>&1 >/dev/null \
        | grep -E "^\[ prompt|^plan:" | sed -E 's/;.*//' | tr '\n' ' '; echo
}
for r in $(seq "$rounds"); do
    echo "== round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
    for c in "$@"; do
        for how in --keep-coded --decode-at-load default; do
            flags=(); [ "$how" = default ] || flags=("$how")
            echo "$(basename "$c") $how: $(ours "$c" "${flags[@]}")"
        done
    done
    echo "Q4_K_M entrollm: $(ours "$q4")"
    echo "Q4_K_M llama-bench: $("$llama/llama-bench" -m "$q4" -t "$t" -n "$n" -p 0 -r 1 -o csv 2>/dev/null | tail -1)"
done
