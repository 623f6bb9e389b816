#!/usr/bin/env bash
# Scenario plans: `entrollm tune` times every launch's forms on this device, `plan` picks the
# fastest plan within each budget, and `bench --tune --budget` serves it: predicted against
# measured decode tok/s (the plan's line in each run's stderr beside its JSON), then `compress
# --plan` at the middle budget and the planned container served as it is.
#   Inputs:  MODEL (a checkpoint, GGUF or container; default on the GPU `--synth $SHAPE`, SHAPE
#            llama-3.1-8b; on the CPU SmolLM2 Q4_1 from scripts/fetch-smollm2; --tiny: the tiny
#            synthetic checkpoint), BUDGETS (default: 100% and, on the CPU, 175MB 300MB 450MB; on
#            the GPU 13GB), TUNE (an existing tune file: no tuning), TUNE_SECONDS (CPU, default 10),
#            MAX_VARIANTS (default 2), ALLOW_LOSSY=1 (lossy launches as candidates).
#   Peers:   the default plan of the same model in the same run (`bench` without --budget) and the
#            plans' own predictions.
#   Outputs: $OUT/tune.json, fronts.svg, plan-BUDGET.json, summary.tsv (tok/s and the prediction
#            error of each plan), each run's JSON and stderr, $OUT.tar.xz.
#   Run:     bash bench/scenarios/plans.sh [--dry-run | --tiny]   (D=DIR on a device)
. "$(dirname "$0")/lib.sh"
setup
SHAPE=${SHAPE:-llama-3.1-8b}
if [ $TINY = 1 ]; then synth_model tiny; model=("${MODEL[@]}")
elif [ -n "${MODEL:-}" ]; then model=("$MODEL")
elif [ "$DEVICE" = cuda ]; then model=(--synth "$SHAPE")
else model=("$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1)"); fi
BUDGETS=${BUDGETS:-$([ "$DEVICE" = cuda ] && echo "100% 13GB" || echo "100% 175MB 300MB 450MB")}
[ $TINY = 1 ] && BUDGETS="100%"
tune=${TUNE:-$OUT/tune.json}
if [ -z "${TUNE:-}" ]; then
    targs=(--device "$DEVICE" --max-variants "${MAX_VARIANTS:-2}" -o "$tune")
    [ "$DEVICE" = cpu ] && targs+=(--seconds "${TUNE_SECONDS:-$([ $TINY = 1 ] && echo 0.2 || echo 10)}")
    [ $DRY = 1 ] || rm -f "$tune"  # an existing -o file would be resumed
    run tune "$B" tune "${model[@]}" "${targs[@]}"
fi
run fronts "$B" plan "$tune" --plot "$OUT/fronts.svg"
bench default "${model[@]}"
lossy=(); [ "${ALLOW_LOSSY:-0}" = 1 ] && lossy=(--allow-lossy)
for b in $BUDGETS; do
    tag=budget-${b//%/pct}
    bench "$tag" "${model[@]}" --tune "$tune" --budget "$b" "${lossy[@]}"
    [ $DRY = 1 ] && continue
    pred=$(grep -o 'predicted [0-9.]* tok/s' "$OUT/$tag.err" | head -1 | awk '{print $2}')
    peer_row "$tag-predicted" "$pred" "$tag" "the plan's prediction (ratio: measured / predicted)"
    peer_row "$tag-vs-default" "$(decode_of default)" "$tag" "the default plan, same run"
done
# compress --plan: the plan of the middle budget given as a size (else the fastest plan) written
# into a container (a model path only); `plan` takes sizes, not shares of a device's memory.
mid=$(echo $BUDGETS | tr ' ' '\n' | grep -v '%' | awk '{ b[NR] = $0 } END { if (NR) print b[int((NR + 1) / 2)] }')
if [ "${model[0]}" != --synth ]; then
    pf=$OUT/plan-${mid:-fastest}.json
    run plan-mid "$B" plan "$tune" ${mid:+--budget "$mid"} -o "$pf"
    run compress-planned "$B" compress "${model[@]}" -o "$W/planned" --plan "$pf" --overwrite
    bench planned-container "$W/planned"
else not_run compress-planned "--synth has no checkpoint to compress"; fi
finish
