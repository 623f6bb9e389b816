#!/usr/bin/env bash
# Scenario decode-lossy: lossy containers (`compress --bits R --quantizer Q`) served, beside the
# dense source in the same run: on the GPU by `entrollm bench` (lossy tiles by lossy_mv, int/fp8
# codes by the dtANS and int forms; a 4096-token prefill too); on the CPU by `bench` (the default
# plan) and by `run` kept coded (--keep-coded) and decoded at load (--decode-at-load), which
# `bench` does not take.
#   Inputs:  SOURCE (a BF16/F32 checkpoint or GGUF; default: `synth --shape $SHAPE`, SHAPE
#            llama-3.1-8b, --tiny: tiny), BITS (default "4 3"), QUANTIZERS (default "int fp8
#            tcq32"), TILE (--tile-weights for tcq32/e8, default 8192), CALIB (a text: --calib);
#            CPU: THREADS (2), TOKENS (64), ROUNDS (2, modes alternating).
#   Peers:   dense BF16 of the same source, same run (the ratio); GPU: EntroPack 0.1.5's lossy
#            decode and CompressedLinear ($ANCHORS/entropack_peer.py, wheel ENTROPACK_WHEEL); CPU:
#            llama.cpp's Q4_K_M of the same F32 GGUF (LLAMA: llama-quantize and llama-bench; with
#            SOURCE a GGUF).
#   Outputs: $OUT/summary.tsv (tok/s, weights, ratio to dense), compress logs with the rates met,
#            each run's JSON, $OUT.tar.xz.
#   Run:     D=DIR bash bench/scenarios/decode-lossy.sh [--dry-run | --tiny]
. "$(dirname "$0")/lib.sh"
setup
SHAPE=${SHAPE:-$([ $TINY = 1 ] && echo tiny || echo llama-3.1-8b)}
BITS=${BITS:-$([ $TINY = 1 ] && echo 4 || echo "4 3")}; QUANTIZERS=${QUANTIZERS:-int fp8 tcq32}
src=${SOURCE:-$W/synth-$SHAPE-bf16}
if [ -z "${SOURCE:-}" ]; then [ $DRY = 0 ] && [ -f "$src/config.json" ] || run synth "$B" synth --shape "$SHAPE" -o "$src"; fi
gpu_prefill=(); [ "$DEVICE" = cuda ] && gpu_prefill=(--prefill-len 4096)
bench dense "$src" "${gpu_prefill[@]}"
t=${THREADS:-2}
for q in $QUANTIZERS; do
    for b in $BITS; do
        c=$W/lossy-$(basename "$src")-$q-$b
        flags=(--bits "$b" --quantizer "$q")
        case $q in tcq*|e8) flags+=(--tile-weights "${TILE:-8192}") ;; esac
        [ -n "${CALIB:-}" ] && flags+=(--calib "$CALIB")
        run "compress-$q-$b" "$B" compress "$src" -o "$c" "${flags[@]}" --overwrite
        bench "$q-$b" "$c" "${gpu_prefill[@]}"
        [ $DRY = 1 ] || peer_row "$q-$b-vs-dense" "$(decode_of dense)" "$q-$b" "dense source, same run"
        if [ "$DEVICE" = cpu ] && [ $TINY = 1 ]; then not_run "$q-$b-run" "the tiny synthetic model has no tokenizer for run"
        elif [ "$DEVICE" = cpu ]; then
            for r in $(seq "${ROUNDS:-$([ $TINY = 1 ] && echo 1 || echo 2)}"); do
                for how in --keep-coded --decode-at-load; do
                    run "$q-$b-run$how-r$r" "$B" run "$c" -p "Once upon a time" -n "${TOKENS:-64}" --device cpu -t "$t" -c 1024 --temperature 0 "$how"
                    [ $DRY = 1 ] || el "  $q-$b $how r$r: $(grep -hE '^\[ prompt|^plan:' "$OUT/$q-$b-run$how-r$r.err" | tr '\n' ' ')"
                done
            done
        fi
    done
done
if [ "$DEVICE" = cuda ]; then
    if [ -f "$ANCHORS/entropack_peer.py" ] && [ -n "${ENTROPACK_WHEEL:-}" ]; then
        run entropack-pip python3 -m pip install --no-deps --target "$W/site" "$ENTROPACK_WHEEL"
        run entropack env OUT="$OUT" PYTHONPATH="$W/site" python3 "$ANCHORS/entropack_peer.py"
    else not_run entropack "needs $ANCHORS/entropack_peer.py and ENTROPACK_WHEEL"; fi
elif [[ "$src" == *.gguf ]]; then
    q4=$W/q4km-$(basename "$src")
    if lq=$(llama_bin llama-quantize); then
        [ $DRY = 0 ] && [ -f "$q4" ] || run llama-quantize "$lq" "$src" "$q4" Q4_K_M "$t"
        bench q4km "$q4" -t "$t"
        if [ $DRY = 1 ]; then llama_tg "$q4" llama-q4km -t "$t" -n "${TOKENS:-64}" -p 0 -r 1
        else tg=$(llama_tg "$q4" llama-q4km -t "$t" -n "${TOKENS:-64}" -p 0 -r 1) && peer_row llama-q4km "$tg" q4km "llama-bench, Q4_K_M of the same F32"; fi
    else not_run llama.cpp-q4km "no llama-quantize: set LLAMA"; fi
else not_run llama.cpp-q4km "SOURCE is not a GGUF"; fi
finish
