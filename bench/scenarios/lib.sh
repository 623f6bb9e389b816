# The shared part of the scenario scripts (sourced, never run): flags, the binary, the device,
# logging, `entrollm bench` runs with their key figures, peers, and the run's archive.
#
# Flags every scenario takes:
#   --dry-run   print each command (binary, peers, files) without running anything; needs no binary,
#               GPU or model (the smoke test, scripts/bench-smoke, runs every scenario so)
#   --tiny      a CPU smoke run on tiny synthetic models (`synth --shape tiny`) where the scenario
#               has one; peers that need a GPU or a download are skipped and logged as not run
#   --help      the script's header
# Environment every scenario reads:
#   ENTROLLM   the binary (default: $D/entrollm.xz unpacked to $W, else target/release/entrollm)
#   D          a folder carried to a device: entrollm.xz, cache.tar.xz (precompiled kernels), test
#              binaries (*.xz), peers' files; optional
#   DEVICE     cuda | cpu (default: cuda where nvidia-smi lists a GPU, else cpu)
#   OUT        logs and JSON (default /tmp/entrollm-bench/SCENARIO); W the work folder for models
#   ANCHORS    the peers' scripts (peers.py, df11.py, entropack_peer.py; default shared/anchors)
#   LLAMA      a folder with llama.cpp's binaries (llama-bench, llama-quantize) for the llama.cpp peer
#   OLD        a second entrollm binary: every `entrollm bench` is repeated with it (a regression A/B)
#   REPEATS    timed runs per `bench` measurement (default 3; --tiny: 1)
#   QUIET=1    each run waits until other processes leave the machine idle (shared CPUs); every
#              run's log line has the load and the cores busy during it either way
# Output: $OUT/log (every step, timed), $OUT/summary.tsv (one row a measurement: scenario, tag,
# device, decode tok/s, weights bytes, tokens consistent, and the peer's figure and ratio where one
# ran), each run's JSON and stderr, and $OUT.tar.xz of all of it: the raw archive to keep as
# bench/runs/NAME.tar.xz beside the figures in bench/RESULTS.md.
set -uo pipefail
SCEN=$(basename "$0" .sh)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY=0; TINY=0; ARGS=()
for a in "$@"; do
    case $a in
        --dry-run) DRY=1 ;;
        --tiny) TINY=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) ARGS+=("$a") ;;
    esac
done
[ $TINY = 1 ] && DEVICE=cpu
if [ -z "${DEVICE:-}" ]; then
    if [ $DRY = 0 ] && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=${DRY_DEVICE:-cpu}; fi
fi
OUT=${OUT:-/tmp/entrollm-bench/$SCEN}; W=${W:-/tmp/entrollm-bench/work}
ANCHORS=${ANCHORS:-$REPO/shared/anchors}; REPEATS=${REPEATS:-$([ $TINY = 1 ] && echo 1 || echo 3)}
T0=$(date +%s)
mkdir -p "$OUT" "$W"
[ $DRY = 1 ] || printf '# scenario\ttag\tdevice\tdecode_tok_s\tweights_bytes\ttokens_consistent\tprompt_prefill_tok_s\tprefill_tok_s\tload_s (peer rows: peer FIGURE, ours FIGURE, ratio, what)\n' > "$OUT/summary.tsv"

# A timed line in the log (and on stdout).
el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log"; }
# `x CMD...`: CMD, or in a dry run the command printed (`+ CMD`).
x() {
    if [ $DRY = 1 ]; then printf '+'; printf ' %q' "$@"; echo; return 0; fi
    "$@"
}
# `run TAG CMD...`: CMD with stdout in $OUT/TAG.out and stderr in $OUT/TAG.err, under a timeout
# (TIMEOUT, default 600 s); its exit status logged.
run() {
    local tag=$1; shift
    if [ $DRY = 1 ]; then printf '+'; printf ' %q' "$@"; echo " > $tag.out 2> $tag.err"; return 0; fi
    [ "${QUIET:-0}" = 1 ] && quiet
    el "== $tag: $*"
    local b0 t0; b0=$(busy); t0=$(date +%s.%N)
    timeout "${TIMEOUT:-600}" "$@" > "$OUT/$tag.out" 2> "$OUT/$tag.err"
    local rc=$?
    el "rc $rc; load $(cut -d' ' -f1 /proc/loadavg), cores busy meanwhile $(foreign "$b0" "$t0")"
    return $rc
}
# The machine is shared: `busy` is the CPU time /proc/stat counts (ticks); `foreign B0 T0` the
# cores kept busy since (this run's own included); with QUIET=1 each run starts once the other
# processes have left the machine idle (under 0.1 core) for 5 s.
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
foreign() { python3 -c "import sys,time; print(f'{($(busy) - $1) / $(getconf CLK_TCK) / max(time.time() - $2, 1e-3):.2f}')"; }
quiet() {
    local b0 i
    for i in $(seq 120); do
        b0=$(busy); sleep 5
        [ "$(python3 -c "print(int(($(busy) - $b0) / $(getconf CLK_TCK) / 5 < 0.1))")" = 1 ] && return
    done
    el "QUIET: the machine did not fall idle in 10 minutes; running anyway"
}
# Writes what the scenario could not run, and why, to the log and the summary (never silent).
not_run() { # TAG WHY
    [ $DRY = 1 ] && { echo "# not run: $1 ($2)"; return 0; }
    el "not run: $1 ($2)"
    printf '%s\t%s\t%s\tnot run: %s\n' "$SCEN" "$1" "$DEVICE" "$2" >> "$OUT/summary.tsv"
}

# The binary: ENTROLLM, else D's entrollm.xz (and its kernel cache), else the release build.
unxz_to() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"; chmod +x "$2"; }
setup() {
    if [ $DRY = 1 ]; then B=${ENTROLLM:-entrollm}; return 0; fi
    if [ -n "${ENTROLLM:-}" ]; then B=$ENTROLLM
    elif [ -n "${D:-}" ] && [ -f "$D/entrollm.xz" ]; then
        [ -x "$W/entrollm" ] || unxz_to "$D/entrollm.xz" "$W/entrollm"; B=$W/entrollm
    else B=$REPO/target/release/entrollm; fi
    [ -x "$B" ] || { echo "no entrollm binary at $B (set ENTROLLM or D)" >&2; exit 2; }
    if [ -n "${OLD:-}" ] && [ "${OLD%.xz}" != "$OLD" ]; then unxz_to "$OLD" "$W/entrollm-old"; OLD=$W/entrollm-old; fi
    if [ -n "${D:-}" ] && [ -f "$D/cache.tar.xz" ] && [ ! -d "$W/ec" ]; then
        mkdir -p "$W/ec" && tar xJf "$D/cache.tar.xz" -C "$W/ec" --strip-components=1
    fi
    [ -d "$W/ec" ] && export ENTROLLM_CACHE=$W/ec
    if [ "$DEVICE" = cuda ]; then
        export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
        # NVRTC from the machine's CUDA or a pip wheel, found by its versioned name.
        local lib
        lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) \
            -name 'libnvrtc.so.1[0-9]*' -not -name '*builtins*' 2>/dev/null | head -1)
        [ -n "$lib" ] && { mkdir -p "$W/nvrtc"; ln -sf "$lib" "$W/nvrtc/libnvrtc.so"; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname "$lib"):$LD_LIBRARY_PATH; }
        el "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
    else
        el "machine: $(lscpu | grep -m1 'Model name' | sed 's/ \{2,\}/ /g'); $(nproc) threads; load $(cut -d' ' -f1-3 /proc/loadavg)"
    fi
    el "scenario $SCEN; binary $B ($("$B" --version 2>/dev/null)); commit ${COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}; $(date -u +%FT%TZ)"
}

# `synth_model SHAPE [DTYPE [ENTROPY]]`: sets MODEL to the synthetic checkpoint's arguments: on the
# GPU `--synth SHAPE` for BF16 (built in memory), else a checkpoint written to $W once.
synth_model() {
    local shape=$1 dtype=${2:-bf16} ent=${3:-}
    if [ "$DEVICE" = cuda ] && [ "$dtype" = bf16 ]; then MODEL=(--synth "$shape"); return 0; fi
    local dir=$W/synth-$shape-$dtype${ent:+-$ent}
    if [ $DRY = 1 ] || [ ! -f "$dir/config.json" ]; then
        run "synth-$shape-$dtype" "$B" synth --shape "$shape" --dtype "$dtype" ${ent:+--entropy "$ent"} -o "$dir" || return 1
    fi
    MODEL=("$dir")
}

# `bench TAG ARGS...`: `entrollm bench ARGS --json` on $DEVICE (and with $OLD as TAG-old), its
# key figures on one line and one summary row; BENCH_ENV=VAR=V,VAR=V sets the environment of the run.
bench() {
    local tag=$1; shift
    local extra=(--device "$DEVICE" --json)
    [[ " $* " == *" --repeats "* ]] || extra+=(--repeats "$REPEATS")
    [ $TINY = 1 ] && [[ " $* " != *" --prompt-len "* ]] && extra+=(--prompt-len 16)
    bench_one "$tag" "$B" "$@" "${extra[@]}"
    if [ -n "${OLD:-}" ]; then bench_one "$tag-old" "$OLD" "$@" "${extra[@]}"; fi
}
bench_one() {
    local tag=$1 bin=$2; shift 2
    local pre=()
    [ -n "${BENCH_ENV:-}" ] && pre=(env ${BENCH_ENV//,/ })
    run "$tag" "${pre[@]}" "$bin" bench "$@" || true
    [ $DRY = 1 ] && return 0
    mv -f "$OUT/$tag.out" "$OUT/$tag.json" 2>/dev/null
    python3 - "$OUT/$tag.json" "$SCEN" "$tag" "$DEVICE" "$OUT/$tag.err" <<'PY' | tee -a "$OUT/summary.tsv" | sed 's/^/  /' | tee -a "$OUT/log"
import json, sys
path, scen, tag, dev, err = sys.argv[1:6]
try:
    j = json.load(open(path))
except Exception:
    # No figure: a budget refused (it names the least that fits), or a failure and its last line.
    lines = [l.strip() for l in open(err, errors="replace") if l.strip()] or ["no output"]
    why = next((l for l in lines if "pass --budget" in l), None)
    print(f"{scen}\t{tag}\t{dev}\t" + (f"refused: {why}" if why else f"failed: {lines[-1][:300]}"))
    sys.exit()
m = j.get("memory", {})
w = m.get("weights") if isinstance(m, dict) else None
print("\t".join(str(v) for v in [scen, tag, dev, j.get("decode_tok_s"), w, j.get("tokens_consistent"),
      j.get("prompt_prefill_tok_s"), j.get("prefill_tok_s"), j.get("load_s")]))
PY
}
# `decode_of TAG`: the decode tok/s of a bench run (empty when none).
decode_of() {
    python3 -c 'import json,sys
try: print(json.load(open(sys.argv[1])).get("decode_tok_s") or "")
except Exception: print("")' "$OUT/$1.json" 2>/dev/null
}
# `peer_row TAG FIGURE OURS_TAG NOTE`: the peer's figure beside ours, with the ratio, in the summary.
peer_row() {
    local tag=$1 fig=$2 ours=$3 note=${4:-}
    [ $DRY = 1 ] && return 0
    local us ratio=""
    us=$(decode_of "$ours")
    [ -n "$fig" ] && [ -n "$us" ] && ratio=$(python3 -c "print(f'{$us / $fig:.2f}x')")
    printf '%s\t%s\t%s\tpeer %s\tours %s\tratio %s\t%s\n' "$SCEN" "$tag" "$DEVICE" "${fig:-?}" "${us:-?}" "${ratio:-?}" "$note" \
        | tee -a "$OUT/summary.tsv" | sed 's/^/  /' | tee -a "$OUT/log"
}
# The llama.cpp peer's binaries: $LLAMA/NAME or $LLAMA/bin/NAME or $LLAMA/build/bin/NAME.
llama_bin() {
    local n=$1 d
    [ -n "${LLAMA:-}" ] || return 1
    for d in "$LLAMA" "$LLAMA/bin" "$LLAMA/build/bin"; do [ -x "$d/$n" ] && { echo "$d/$n"; return 0; }; done
    [ $DRY = 1 ] && { echo "$LLAMA/$n"; return 0; }
    return 1
}
# `llama_tg FILE TAG [ARGS...]`: llama-bench's decode (tg) tok/s on FILE (its last tg row: tg128 @
# d512 with the GPU protocol), written to $OUT/TAG.md; echoes the figure.
llama_tg() {
    local f=$1 tag=$2 lb; shift 2
    # Only the figure on stdout (callers capture it); the log lines on stderr.
    lb=$(llama_bin llama-bench) || { not_run "$tag" "no llama-bench: set LLAMA" >&2; return 1; }
    run "$tag" "$lb" -m "$f" "$@" -o md >&2 || return 1
    [ $DRY = 1 ] && return 0
    mv -f "$OUT/$tag.out" "$OUT/$tag.md"
    grep -E '\| *tg[0-9]+' "$OUT/$tag.md" | tail -1 | awk -F'|' '{print $(NF-1)}' | awk '{print $1}'
}
# Ends the run: the archive of $OUT beside it.
finish() {
    [ $DRY = 1 ] && { echo "+ tar cJf $OUT.tar.xz -C $OUT ."; return 0; }
    el "done"
    tar cJf "$OUT.tar.xz" -C "$OUT" . && el "archive: $OUT.tar.xz ($(stat -c %s "$OUT.tar.xz") bytes)"
}
