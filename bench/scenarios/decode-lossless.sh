#!/usr/bin/env bash
# Scenario decode-lossless: batch-1 decode of losslessly coded weights, each form beside the dense
# weights it restores bit for bit, by `entrollm bench`: BF16 coded by dtANS (`--coded`, codings
# from CODING_FILE, default bench/plans/single-m8.json, or the tuned table with CODING_FILE=tuned),
# BF16 palette-packed (`--bf16 palette`), coded at load from a checkpoint (`--code-at-load auto`),
# a `compress`ed container as `bench` serves it by default; an FP8 E4M3 checkpoint at FP8_ENTROPY
# bits of code entropy (default 2.1, EntQuant-like) as stored (`--fp8 dense`) and palette-packed;
# a GPTQ int4 g128 checkpoint of the same BF16 weights (round-to-nearest in GPTQ's packing,
# tools/gen_gptq_checkpoint.py) served as its integer codes, and its container.
#   Inputs:  SHAPE (default llama-3.1-8b; --tiny: tiny); FORMS (default: dense coded palette
#            code-at-load container fp8-dense fp8-palette; also gptq gptq-container); LONG=N: also decode after an N-token
#            prefill with a CONTEXT-token KV cache (e.g. the 70B: SHAPE=llama-3.3-70b FORMS=coded
#            CONTEXT=131072 LONG=32768); OLD: the previous binary (A/B).
#   Peers:   DFloat11 0.5.0's decode kernel and HF transformers with its hooks on the same shape
#            ($ANCHORS/df11.py, wheel DF11_WHEEL; GPU); the dense form of the same weights in
#            the same run (every ratio below is against it).
#   Outputs: $OUT/summary.tsv (tok/s, weights on the device, token check; ratios to dense),
#            each run's JSON, $OUT.tar.xz.
#   Run:     D=DIR bash bench/scenarios/decode-lossless.sh [--dry-run | --tiny]
. "$(dirname "$0")/lib.sh"
setup
SHAPE=${SHAPE:-$([ $TINY = 1 ] && echo tiny || echo llama-3.1-8b)}
FORMS=${FORMS:-dense coded palette code-at-load container fp8-dense fp8-palette}
CF=${CODING_FILE:-$REPO/bench/plans/single-m8.json}
coding=(--coding-file "$CF"); [ "$CF" = tuned ] && coding=()
long=(); [ -n "${LONG:-}" ] && long=(--long-prefill "$LONG" --repeats 1)
[ -n "${CONTEXT:-}" ] && long+=(--context "$CONTEXT")
gpu_only() { [ "$DEVICE" = cuda ] || { not_run "$1" "the GPU's form; bench --device cpu serves as run does"; return 1; }; }
for f in $FORMS; do
    case $f in
        dense) synth_model "$SHAPE"; bench dense "${MODEL[@]}" "${long[@]}" ;;
        coded) gpu_only coded && bench coded --synth "$SHAPE" --coded "${coding[@]}" "${long[@]}" ;;
        palette) gpu_only palette && bench palette --synth "$SHAPE" --bf16 palette ;;
        code-at-load)
            gpu_only code-at-load || continue
            dir=$W/synth-$SHAPE-bf16
            [ $DRY = 0 ] && [ -f "$dir/config.json" ] || run synth-ckpt "$B" synth --shape "$SHAPE" -o "$dir"
            bench code-at-load "$dir" --code-at-load auto "${coding[@]}" ;;
        container)
            synth_model "$SHAPE" bf16
            dir=$W/synth-$SHAPE-bf16; c=$W/container-$SHAPE
            [ "${MODEL[0]}" = --synth ] && { [ $DRY = 0 ] && [ -f "$dir/config.json" ] || run synth-ckpt "$B" synth --shape "$SHAPE" -o "$dir"; }
            [ $DRY = 0 ] && [ -f "$c/entrollm.json" ] || run compress "$B" compress "$dir" -o "$c" --overwrite
            bench container "$c" ;;
        fp8-dense|fp8-palette)
            synth_model "$SHAPE" fp8-e4m3 "${FP8_ENTROPY:-2.1}"
            if [ $f = fp8-palette ]; then gpu_only fp8-palette && bench fp8-palette "${MODEL[@]}" --fp8 palette
            else bench fp8-dense "${MODEL[@]}" --fp8 dense; fi ;;
        gptq|gptq-container)
            dir=$W/synth-$SHAPE-bf16; g=$W/gptq-$SHAPE
            [ $DRY = 0 ] && [ -f "$dir/config.json" ] || run synth-ckpt "$B" synth --shape "$SHAPE" -o "$dir"
            [ $DRY = 0 ] && [ -f "$g/config.json" ] || run gptq-make python3 "$REPO/tools/gen_gptq_checkpoint.py" "$dir" "$g"
            if [ $f = gptq ]; then bench gptq "$g"
            else
                [ $DRY = 0 ] && [ -f "$g.c/entrollm.json" ] || run compress-gptq "$B" compress "$g" -o "$g.c" --overwrite
                bench gptq-container "$g.c"
            fi ;;
        *) echo "unknown form $f" >&2; exit 2 ;;
    esac
done
if [ $DRY = 0 ]; then
    for t in coded palette code-at-load container gptq gptq-container; do
        [ -f "$OUT/$t.json" ] && peer_row "$t-vs-dense" "$(decode_of dense)" "$t" "dense BF16, same run"
    done
    [ -f "$OUT/fp8-palette.json" ] && peer_row fp8-palette-vs-dense "$(decode_of fp8-dense)" fp8-palette "dense FP8, same run"
fi
if [ "$DEVICE" = cuda ] && [ -f "$ANCHORS/df11.py" ]; then
    [ -n "${DF11_WHEEL:-}" ] && run df11-pip python3 -m pip install --no-deps --target "$W/site" "$DF11_WHEEL"
    run df11 env OUT="$OUT" PYTHONPATH="$W/site" python3 "$ANCHORS/df11.py"
else not_run dfloat11 "$([ "$DEVICE" = cuda ] && echo "no $ANCHORS/df11.py" || echo 'a GPU peer')"; fi
finish
