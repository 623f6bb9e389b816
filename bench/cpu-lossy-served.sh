#!/bin/bash
# A lossy container served on the CPU: decoded at load (the default), kept coded (--keep-coded: the
# fused tile decode in every product), and as a plan mixes them under a budget from a tune file
# made here (`tune`: each lossy launch's coded form timed beside its reconstruction's lossless
# forms):
#   bash bench/cpu-lossy-served.sh ENTROLLM CONTAINER OUTDIR BUDGET [ROUNDS] [TOKENS]
# (BUDGET: `run --budget`'s, the KV cache and workspace included)
# Decode speed is each run's timing line (greedy, prompt "Once upon a time", 2 threads, context
# 1024), rounds alternating between the modes.
set -euo pipefail
bin=$1; c=$2; out=$3; budget=$4; rounds=${5:-3}; n=${6:-64}
mkdir -p "$out"
common=(-p "Once upon a time" -n "$n" --device cpu -t 2 -c 1024 --temperature 0)
"$bin" tune "$c" --device cpu -t 2 -o "$out/tune.json" 2>&1 | tail -3 | tee "$out/tune.txt"
"$bin" run "$c" -p "Hi" -n 1 --device cpu -t 2 -c 1024 --tune "$out/tune.json" --budget "$budget" \
    2>&1 >/dev/null | tee "$out/plan.txt"
: > "$out/runs.txt"
for r in $(seq "$rounds"); do
    for mode in decoded coded planned; do
        case $mode in
            decoded) flags=() ;;
            coded) flags=(--keep-coded) ;;
            planned) flags=(--tune "$out/tune.json" --budget "$budget") ;;
        esac
        echo "== round $r $mode ${flags[*]}" >> "$out/runs.txt"
        /usr/bin/time -f "peak RSS %M KB" "$bin" run "$c" "${common[@]}" "${flags[@]}" \
            2>&1 >/dev/null | grep -E "tok/s|peak RSS|plan:" >> "$out/runs.txt"
    done
done
cat "$out/runs.txt"
