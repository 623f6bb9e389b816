#!/usr/bin/env bash
# The default rule on the CPU (issue 43): SmolLM2-135M Q4_1 GGUF and its lossless container, each
# loaded planned (the default rule) and unplanned (--decode-at-load), then served by plain `run`
# and by `run --budget` at 1.0x, 1.5x and 3x the GGUF file's size, back to back, ROUNDS times
# (default 2); then a synthetic Llama-3.2-1B-shaped BF16 checkpoint by `bench --device cpu`.
# Each run's stderr (plan line, decode tok/s, weights) and /usr/bin/time's peak RSS and wall time
# go to $OUT/*.log; one summary line a run on stdout, with the plan's prediction error
# (predicted / measured - 1) and the load average at its start.
#   bench/cpu-defaults.sh OUT [ENTROLLM]
set -euo pipefail
out="${1:?usage: bench/cpu-defaults.sh OUT [ENTROLLM]}"
bin="${2:-${CARGO_TARGET_DIR:-target}/release/entrollm}"
rounds="${ROUNDS:-2}"
mkdir -p "$out"
gguf="$(scripts/fetch-smollm2 | tail -n1)"
container="${TMPDIR:-/tmp}/smollm2-defaults.entrollm"
[[ -d "$container" ]] || "$bin" compress "$gguf" -o "$container" 2>"$out/compress.log"
file=$(stat -c %s "$gguf")
prompt="Write a long story about a lighthouse keeper who finds a map in a bottle. Once upon a time"
loadavg() { cut -d' ' -f1 /proc/loadavg; }
run() { # NAME MODEL [ARGS...]
    local name="$1" model="$2" la
    shift 2
    la=$(loadavg)
    /usr/bin/time -v "$bin" run "$model" --device cpu -c 512 --max-tokens 128 -p "$prompt" "$@" \
        >"$out/$name.out" 2>"$out/$name.log" || true
    local pred dec
    pred=$(grep -o 'predicted [0-9.]* tok/s' "$out/$name.log" | head -1 | awk '{print $2}' || true)
    dec=$(grep -o 'decode [0-9]* tokens, [0-9.]* tok/s' "$out/$name.log" | awk '{print $4}' || true)
    echo "$name: load $la | predicted ${pred:-?} | decode ${dec:-?} tok/s |" \
        "error $(awk -v p="${pred:-0}" -v d="${dec:-0}" 'BEGIN { if (p > 0 && d > 0) printf "%+.1f %%", 100 * (p / d - 1); else print "-" }') |" \
        "$(grep -o 'weights [0-9.]* MB' "$out/$name.log" | tail -1)" \
        "rss $(grep 'Maximum resident' "$out/$name.log" | awk '{print $NF}') kB" \
        "wall $(grep 'Elapsed (wall' "$out/$name.log" | awk '{print $NF}')"
}
load() { # NAME MODEL [ARGS...]: open (and plan) the model, one token; wall time and the plan's
    local name="$1" model="$2" la
    shift 2
    la=$(loadavg)
    /usr/bin/time -f "wall %e s" "$bin" run "$model" --device cpu -c 512 --max-tokens 1 -p "Hi" "$@" \
        >/dev/null 2>"$out/$name.log" || true
    echo "$name: load $la | $(grep -o 'plan: made in [0-9.]* s; [0-9]* of [0-9]* launches re-formed in [0-9.]* s' "$out/$name.log" || echo unplanned) |" \
        "$(grep -o 'wall [0-9.]* s' "$out/$name.log" || true)"
}
for round in $(seq "$rounds"); do
    for m in gguf container; do
        model="$gguf"
        [[ $m == container ]] && model="$container"
        # Planned and unplanned loads alternate which goes first.
        if (( round % 2 )); then
            load "$m-load-default-r$round" "$model"
            load "$m-load-unplanned-r$round" "$model" --decode-at-load
        else
            load "$m-load-unplanned-r$round" "$model" --decode-at-load
            load "$m-load-default-r$round" "$model"
        fi
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
# A BF16 checkpoint: the default plan beside the dense model (--budget 3x its file: every form
# fits), `bench`'s decode protocol; its load time with the plan's own share.
s1b="${S1B:-${TMPDIR:-/tmp}/llama-3.2-1b-bf16}"
[[ -d "$s1b" ]] || "$bin" synth --shape llama-3.2-1b --dtype bf16 -o "$s1b" >"$out/synth-1b.log" 2>&1
size=$(stat -L -c %s "$s1b/model.safetensors")
bench() { # NAME [ARGS...]
    local name="$1" la
    shift
    la=$(loadavg)
    /usr/bin/time -v "$bin" bench "$s1b" --device cpu --prompt-len 32 --repeats 1 "$@" \
        >"$out/$name.out" 2>"$out/$name.log" || true
    local pred dec
    pred=$(grep -o 'predicted [0-9.]* tok/s' "$out/$name.log" | head -1 | awk '{print $2}' || true)
    dec=$(grep -ho 'decode *[0-9.]* tok/s' "$out/$name.out" "$out/$name.log" | head -1 | awk '{print $(NF-1)}' || true)
    echo "$name: load $la | predicted ${pred:-?} | decode ${dec:-?} tok/s |" \
        "error $(awk -v p="${pred:-0}" -v d="${dec:-0}" 'BEGIN { if (p > 0 && d > 0) printf "%+.1f %%", 100 * (p / d - 1); else print "-" }') |" \
        "$(grep -o 'plan: made in [0-9.]* s; [0-9]* of [0-9]* launches re-formed in [0-9.]* s' "$out/$name.log") |" \
        "$(grep -ho 'loaded in [0-9.]* s' "$out/$name.out" "$out/$name.log" | head -1) |" \
        "$(grep -ho 'weights [0-9.]* MB' "$out/$name.out" "$out/$name.log" | head -1)" \
        "rss $(grep 'Maximum resident' "$out/$name.log" | awk '{print $NF}') kB"
}
bench 1b-default
bench 1b-budget-3x --budget "$((3 * size))B"
