#!/usr/bin/env bash
# Scenario decode-dense: batch-1 decode (and prefill) of dense weights, BF16 and FP8, by
# `entrollm bench`, beside the peers that run the same model shape.
#   Inputs:  SHAPE (synthetic shape, default llama-3.1-8b; --tiny: tiny) or MODELS (paths to
#            checkpoints, space-separated, instead); FP8=1 also the FP8 E4M3 twin (--fp8 dense);
#            PREFILL (default 4096: a long prefill timed too; 0: not); VARIANTS: extra runs of the
#            default one with environment settings, NAME:VAR=V,VAR=V ... (e.g.
#            "unfused:ENTROLLM_DECODE_NORM=split,ENTROLLM_DECODE_ROPE=split"); TRACE=1: one run
#            with --trace, summarised by bench/trace-summary.py; OLD: the previous binary (A/B).
#   Peers:   Hugging Face transformers, static cache + torch.compile, and PyTorch's batch-1 GEMVs
#            (the cuBLAS-GEMV decode bound) and HBM read bandwidth: $ANCHORS/peers.py static (GPU);
#            PyTorch prefill (cuBLAS + SDPA): bench/torch_prefill.py --tokens $PREFILL (GPU).
#   Outputs: $OUT/summary.tsv (decode tok/s, weights, token check; the peers' figures and ratios),
#            each run's JSON, $OUT.tar.xz.
#   Run:     bash bench/scenarios/decode-dense.sh [--dry-run | --tiny]
#            (on a device: D=DIR with entrollm.xz and cache.tar.xz; DEVICE=cpu for the CPU engine)
. "$(dirname "$0")/lib.sh"
setup
SHAPE=${SHAPE:-$([ $TINY = 1 ] && echo tiny || echo llama-3.1-8b)}
PREFILL=${PREFILL:-$([ $TINY = 1 ] || [ "$DEVICE" = cpu ] && echo 0 || echo 4096)}
if [ -n "${MODELS:-}" ]; then models=($MODELS); else synth_model "$SHAPE" bf16; models=("${MODEL[*]}"); fi
i=0
for m in "${models[@]}"; do
    i=$((i + 1)); tag=dense$i; read -ra margs <<< "$m"
    bench "$tag" "${margs[@]}"
    for v in ${VARIANTS:-}; do
        name=${v%%:*}; envs=${v#*:}
        BENCH_ENV=$envs bench "$tag-$name" "${margs[@]}"
    done
    [ "$PREFILL" -gt 0 ] && bench "$tag-prefill$PREFILL" "${margs[@]}" --prefill-len "$PREFILL" --repeats 1
done
if [ "${FP8:-0}" = 1 ]; then
    synth_model "$SHAPE" fp8-e4m3
    bench fp8 "${MODEL[@]}" --fp8 dense
fi
if [ "${TRACE:-0}" = 1 ] && [ "$DEVICE" = cuda ]; then
    read -ra margs <<< "${models[0]}"
    run trace "$B" bench "${margs[@]}" --trace "$OUT/trace.csv"
    run trace-summary python3 "$REPO/bench/trace-summary.py" "$OUT/trace.csv"
fi
if [ "$DEVICE" != cuda ]; then
    not_run hf-transformers "a GPU peer"; not_run torch-prefill "a GPU peer"
else
    if [ -f "$ANCHORS/peers.py" ]; then
        run peers-static env OUT="$OUT" python3 "$ANCHORS/peers.py" static
        for k in hf gemv_only_tok_s_est; do
            [ $DRY = 1 ] || peer_row "peer-$k" "$(python3 -c 'import json,sys
try:
    j = json.load(open(sys.argv[1])); v = j.get(sys.argv[2])
    print(v.get("decode_tok_s", "") if isinstance(v, dict) else (v or ""))
except Exception: print("")' "$OUT/peers_static.json" "$k")" dense1 \
                "$([ $k = hf ] && echo 'HF transformers, static cache + torch.compile' || echo 'PyTorch batch-1 GEMVs alone (decode bound)')"
        done
    else not_run hf-transformers "no $ANCHORS/peers.py"; fi
    [ "$PREFILL" -gt 0 ] && run torch-prefill python3 "$REPO/bench/torch_prefill.py" --tokens "$PREFILL" --json "$OUT/torch_prefill.json"
fi
finish
