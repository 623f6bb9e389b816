#!/usr/bin/env bash
# Scenario defaults: the default rule (no flags: the fastest plan within the source's own size)
# against `--budget` at 1.0x, 1.5x and 3x the file, and planned against unplanned loads
# (--decode-at-load serves the same forms), back to back: decode tok/s, the plan's prediction
# error, weights, peak RSS and load time of each.
#   Inputs:  MODELS (default: SmolLM2 Q4_1 GGUF from scripts/fetch-smollm2 and its lossless
#            container, and a synthetic Llama-3.2-1B BF16 checkpoint; --tiny: the tiny synthetic
#            checkpoint and its container), ROUNDS (default 2; the order alternates).
#   Peers:   the same model served by default in the same round (the ratio of each budget's
#            decode to it) and the plans' own predictions.
#   Outputs: $OUT/summary.tsv (bench's JSON figures and the ratios), load-*.err (the plan's
#            line: made in, launches re-formed), $OUT.tar.xz.
#   Run:     bash bench/scenarios/defaults.sh [--dry-run | --tiny]   (DEVICE=cuda on a GPU)
. "$(dirname "$0")/lib.sh"
setup
if [ -n "${MODELS:-}" ]; then models=($MODELS)
elif [ $TINY = 1 ]; then synth_model tiny; models=("${MODEL[0]}" "$W/tiny-container")
    [ $DRY = 0 ] && [ -f "$W/tiny-container/entrollm.json" ] || run compress-tiny "$B" compress "${MODEL[0]}" -o "$W/tiny-container" --overwrite
else
    g=$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1)
    [ $DRY = 0 ] && [ -f "$W/smollm2-container/entrollm.json" ] || run compress-smollm2 "$B" compress "$g" -o "$W/smollm2-container" --overwrite
    [ "$DEVICE" = cpu ] && { s1b=$W/synth-llama-3.2-1b-bf16; [ $DRY = 0 ] && [ -f "$s1b/config.json" ] || run synth-1b "$B" synth --shape llama-3.2-1b -o "$s1b"; }
    models=("$g" "$W/smollm2-container" ${s1b:+"$s1b"})
fi
size() { [ $DRY = 1 ] && { echo 100000000; return; }; du -sbL "$1" | cut -f1; }
for r in $(seq "${ROUNDS:-$([ $TINY = 1 ] && echo 1 || echo 2)}"); do
    for m in "${models[@]}"; do
        n=$(basename "$m"); n=${n%.gguf}; file=$(size "$m")
        # Loads: planned (the default) and unplanned, alternating which goes first.
        if [ $TINY = 1 ]; then not_run "$n-loads" "run needs a tokenizer; the tiny model has none"
        else
            for how in $( (( r % 2 )) && echo "default unplanned" || echo "unplanned default"); do
                flags=(); [ $how = unplanned ] && flags=(--decode-at-load)
                run "$n-load-$how-r$r" /usr/bin/time -f "wall %e s" "$B" run "$m" --device "$DEVICE" -c 512 --max-tokens 1 -p Hi "${flags[@]}"
                [ $DRY = 1 ] || el "  $n load $how r$r: $(grep -ho 'plan: made in [0-9.]* s; [0-9]* of [0-9]* launches re-formed in [0-9.]* s' "$OUT/$n-load-$how-r$r.err") $(grep -ho 'wall [0-9.]* s' "$OUT/$n-load-$how-r$r.err")"
            done
        fi
        bench "$n-default-r$r" "$m"
        for x in 1.0 1.5 3.0; do
            tag=$n-budget-${x}x-r$r
            bench "$tag" "$m" --budget "$(python3 -c "print(int($file * $x))")B"
            [ $DRY = 1 ] && continue
            # A budget too small names the least that fits (the KV cache is in it): that one too.
            least=$(grep -o 'pass --budget [0-9]*' "$OUT/$tag.err" | awk '{print $3}')
            [ -n "$least" ] && bench "$n-budget-least-r$r" "$m" --budget "${least}B"
            [ -f "$OUT/$tag.json" ] && peer_row "$tag-vs-default" "$(decode_of "$n-default-r$r")" "$tag" "the default, same round"
        done
    done
done
finish
