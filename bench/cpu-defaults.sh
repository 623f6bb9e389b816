#!/usr/bin/env bash
# The default rule on the CPU (issue 43): SmolLM2-135M Q4_1 GGUF and its lossless container, each
# served by plain `run` and by `run --budget` at 1.0x, 1.5x and 3x the GGUF file's size, back to
# back, twice; then a synthetic Llama-3.2-1B-shaped BF16 checkpoint, default against dense.
# Each run's stderr (plan line, decode tok/s, weights) and /usr/bin/time's peak RSS and wall time
# go to $OUT/*.log.
#   bench/cpu-defaults.sh OUT [ENTROLLM]
set -euo pipefail
out="${1:?usage: bench/cpu-defaults.sh OUT [ENTROLLM]}"
bin="${2:-${CARGO_TARGET_DIR:-target}/release/entrollm}"
mkdir -p "$out"
gguf="$(scripts/fetch-smollm2 | tail -n1)"
container="${TMPDIR:-/tmp}/smollm2-defaults.entrollm"
[[ -d "$container" ]] || "$bin" compress "$gguf" -o "$container" 2>"$out/compress.log"
file=$(stat -c %s "$gguf")
prompt="Write a long story about a lighthouse keeper who finds a map in a bottle. Once upon a time"
run() { # NAME MODEL [ARGS...]
    local name="$1" model="$2"
    shift 2
    /usr/bin/time -v "$bin" run "$model" --device cpu -c 512 --max-tokens 128 -p "$prompt" "$@" \
        >"$out/$name.out" 2>"$out/$name.log" || true
    echo "$name: $(grep -o 'predicted [0-9.]* tok/s' "$out/$name.log" | head -1) |" \
        "$(grep -o 'decode [0-9]* tokens, [0-9.]* tok/s' "$out/$name.log")" \
        "$(grep -o 'weights [0-9.]* MB' "$out/$name.log" | tail -1)" \
        "rss $(grep 'Maximum resident' "$out/$name.log" | awk '{print $NF}') kB" \
        "wall $(grep 'Elapsed (wall' "$out/$name.log" | awk '{print $NF}')"
}
for round in 1 2; do
    for m in gguf container; do
        model="$gguf"
        [[ $m == container ]] && model="$container"
        run "$m-default-r$round" "$model"
        for x in 1.0 1.5 3.0; do
            b=$(python3 -c "print(int($file * $x))")
            run "$m-budget-${x}x-r$round" "$model" --budget "${b}B"
            # A budget too small names the least that fits (the KV cache is in the budget): that.
            least=$(grep -o 'pass --budget [0-9]*' "$out/$m-budget-${x}x-r$round.log" | awk '{print $3}' || true)
            if [[ -n "$least" ]]; then run "$m-budget-least-r$round" "$model" --budget "${least}B"; fi
        done
    done
done
