#!/bin/bash
# GGUF files coded losslessly: for each file, `compress`, `decompress` and a byte comparison with
# the original, `inspect` of the container (per-tensor coding and entropy bound; totals), and the
# container's greedy tokens against the GGUF's (decoded at load and, with --keep-coded, fused):
#   bash bench/cpu-gguf-coded.sh ENTROLLM WORKDIR A.gguf [B.gguf ...]
# WORKDIR is emptied per file; the originals are only read.
set -euo pipefail
bin=$1; work=$2; shift 2
for g in "$@"; do
    name=$(basename "$g" .gguf)
    rm -rf "$work/c" "$work/back"; mkdir -p "$work"
    echo "== $name: $(python3 -c "
import gguf,collections,sys
r=gguf.GGUFReader(sys.argv[1]); print(dict(collections.Counter(t.tensor_type.name for t in r.tensors)))" "$g")"
    /usr/bin/time -f "compress: %e s, peak RSS %M KB" "$bin" compress "$g" -o "$work/c" 2>&1 | tail -2
    /usr/bin/time -f "decompress: %e s, peak RSS %M KB" "$bin" decompress "$work/c" -o "$work/back" 2>&1 | tail -2
    cmp "$g" "$work/back/$(basename "$g")" && echo "round trip: byte-identical"
    "$bin" inspect "$work/c"
    if [ "${RUN_TOKENS:-1}" = 1 ]; then
        for p in "The capital of France is" "def fibonacci(n):"; do
            a=$("$bin" run "$g" -p "$p" -n 24 --device cpu -t 2 -q 2>/dev/null)
            b=$("$bin" run "$work/c" -p "$p" -n 24 --device cpu -t 2 -q 2>/dev/null)
            c=$("$bin" run "$work/c" -p "$p" -n 24 --device cpu -t 2 -q --keep-coded 2>/dev/null)
            [ "$a" = "$b" ] && [ "$a" = "$c" ] && echo "tokens equal: $p" || echo "TOKENS DIFFER: $p"
        done
    fi
    rm -rf "$work/back"
done
