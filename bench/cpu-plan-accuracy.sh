#!/usr/bin/env bash
# CPU plan accuracy: `entrollm tune --device cpu` on SmolLM2 (the GGUF, and a container compressed
# from it), `run --budget` at several budgets against each tune file, interleaved and repeated,
# each run's predicted and measured decode tok/s and whether its greedy text is the source's; then
# `compress --plan` and the planned container served as it is.
#
#   bench/cpu-plan-accuracy.sh OUT_DIR [REPEATS] [BUDGET...]
#
# Writes OUT_DIR/log.tsv (one line a run: model, budget, repeat, predicted, measured, same text,
# load before, and `foreign`: the cores other processes kept busy during the run — all CPU time
# /proc/stat counts less the run's own, over its wall time), the tune files, plots, plans and
# every run's stderr. The machine is shared: each tune and run starts once other processes have
# left it idle for 5 s, and one during which they kept more than 0.1 core busy is logged to
# discarded.tsv and done again (at most 8 times).
# ENTROLLM (default target/release/entrollm) is the binary; TUNE_SECONDS (default 10) the tune's
# --seconds and MAX_TOKENS (default 192) each run's: windows of several seconds average this
# machine's phases (its speed moves by a fifth within seconds). The containers go to a temporary
# directory (100 MB each), not OUT_DIR.
set -euo pipefail
out=$1
repeats=${2:-3}
shift $(($# >= 2 ? 2 : $#))
budgets=("$@")
[ ${#budgets[@]} -gt 0 ] || budgets=(175MB 300MB 450MB 600MB)
bin=${ENTROLLM:-target/release/entrollm}
gguf=$(scripts/fetch-smollm2 | tail -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
prompt="Once upon a time"
seconds=${TUNE_SECONDS:-10}
common=(--device cpu -p "$prompt" --max-tokens "${MAX_TOKENS:-192}" --context 256)

load() { cut -d' ' -f1 /proc/loadavg; }
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
# `measured CMD...`: runs CMD, then sets $foreign to the cores other processes used meanwhile.
measured() {
    local b0 t0 own
    b0=$(busy)
    t0=$(date +%s.%N)
    /usr/bin/time -f '%U %S' -o "$work/time" "$@"
    own=$(awk '{print $1+$2}' "$work/time")
    foreign=$(echo "scale=2; (($(busy) - $b0) / $(getconf CLK_TCK) - $own) / ($(date +%s.%N) - $t0)" | bc)
}
note() { echo "$*" | tee -a "$out/notes.txt"; }
quiet() { # waits until others use under 0.1 core over 5 s
    local b0
    while :; do
        b0=$(busy)
        sleep 5
        [ "$(echo "($(busy) - $b0) / $(getconf CLK_TCK) / 5 < 0.1" | bc)" = 1 ] && return
    done
}
# `clean OUT ERR CMD...`: `measured CMD... >OUT 2>ERR` on a quiet machine, again while others
# were busy meanwhile.
clean() {
    local try o=$1 e=$2
    shift 2
    for try in 1 2 3 4 5 6 7 8; do
        quiet
        measured "$@" >"$o" 2>"$e"
        [ "$(echo "$foreign < 0.1" | bc)" = 1 ] && return
        printf '%s\t%s\t%s\n' "$(date -u +%T)" "$foreign" "$*" >>"$out/discarded.tsv"
    done
}

note "date $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) threads $(nproc)"
"$bin" run "$gguf" "${common[@]}" >"$work/ref.txt" 2>"$out/ref.err"
note "reference: $(grep -o 'decode [0-9.]* tok/s' "$out/ref.err")"

# A fresh tune each attempt (an existing -o file would be resumed).
tune() { # model output stderr
    clean /dev/null "$3" sh -c 'rm -f "$3" && exec "$0" tune "$1" --device cpu --seconds "$2" -o "$3"' \
        "$bin" "$1" "$seconds" "$2"
}
tune "$gguf" "$out/tune-gguf.json" "$out/tune-gguf.err"
note "$(tail -1 "$out/tune-gguf.err"); foreign cores $foreign, load $(load)"
"$bin" compress "$gguf" -o "$work/smol-c" 2>&1 | tail -1 | tee -a "$out/notes.txt"
tune "$work/smol-c" "$out/tune-container.json" "$out/tune-container.err"
note "$(tail -1 "$out/tune-container.err"); foreign cores $foreign, load $(load)"
"$bin" plan "$out/tune-gguf.json" --plot "$out/fronts-gguf.png" >/dev/null 2>&1
"$bin" plan "$out/tune-container.json" --plot "$out/fronts-container.png" >/dev/null 2>&1

printf 'model\tbudget\trepeat\tpredicted\tmeasured\tsame_text\tload\tforeign\n' >"$out/log.tsv"
one() { # model tune budget repeat tag
    local err="$out/run-$5-$3-$4.err" before
    before=$(load)
    clean "$work/out.txt" "$err" "$bin" run "$1" "${common[@]}" --tune "$2" --budget "$3"
    local p m same=no
    p=$(grep -o 'predicted [0-9.]* tok/s' "$err" | awk '{print $2}')
    m=$(grep -o 'decode [0-9.]* tok/s' "$err" | awk '{print $2}')
    cmp -s "$work/out.txt" "$work/ref.txt" && same=yes
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$5" "$3" "$4" "$p" "$m" "$same" "$before" \
        "$foreign" | tee -a "$out/log.tsv"
}
for r in $(seq 1 "$repeats"); do
    for b in "${budgets[@]}"; do
        one "$gguf" "$out/tune-gguf.json" "$b" "$r" gguf
        one "$work/smol-c" "$out/tune-container.json" "$b" "$r" container
    done
done

# compress --plan: the plan of the middle budget written into a container, served as it is.
mid=${budgets[$((${#budgets[@]} / 2))]}
"$bin" plan "$out/tune-gguf.json" --budget "$mid" -o "$out/plan-$mid.json" >"$out/plan-$mid.txt" 2>&1
"$bin" compress "$gguf" -o "$work/planned" --plan "$out/plan-$mid.json" 2>&1 | tail -2 |
    tee -a "$out/notes.txt"
"$bin" inspect "$work/planned" --json >"$out/inspect-planned.json"
for r in $(seq 1 "$repeats"); do
    clean "$work/out.txt" "$out/run-planned-$r.err" "$bin" run "$work/planned" "${common[@]}"
    same=no
    cmp -s "$work/out.txt" "$work/ref.txt" && same=yes
    note "planned container ($mid plan, predicted $(grep -o '"predicted_tok_s": [0-9.]*' \
        "$out/plan-$mid.json" | awk '{print $2}')): $(grep -o 'decode [0-9.]* tok/s' \
        "$out/run-planned-$r.err"), same text $same, load $(load), foreign cores $foreign"
done
"$bin" decompress "$work/planned" -o "$work/back" >/dev/null 2>&1
cmp "$work/back/$(basename "$gguf")" "$gguf" && note "planned container decompresses to the GGUF bit for bit"
