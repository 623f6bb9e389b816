#!/usr/bin/env bash
# Scenario kernels: every kernel against its CPU reference, then the batch-1 products per weight
# form, cold cache, beside our dense BF16 GEMV and cuBLAS in the same call.
#   Inputs:  D (entrollm.xz, cache.tar.xz, the test binaries as BINARY.xz), PARTS, SMOLLM2,
#            TIMINGS, NCU on the GPU; CPU_BENCH on the CPU; as below.
#   GPU:  `entrollm selftest --gpu` (PARTS: its parts, e.g. "ggml families"; SMOLLM2=FILE adds
#         SmolLM2's GPU-against-CPU logits and greedy tokens), then each test binary of TIMINGS
#         (BINARY:TEST ..., each D/BINARY.xz, run `--ignored --exact TEST`; default: gpu:
#         gpu_gemv_cold_timing (ours against cuBLAS), ggml_gpu: ggml_gpu_timing, int_gpu:
#         int_gpu_timing, dtans_gpu: dtans_gpu_cold_timing, fp8_gpu: fp8_gpu_cold_timing,
#         lossy_gpu: lossy_gpu_timing; those absent from D are logged as not run); their
#         environment passes through (GGML_TYPES, GGML_SHAPES, DTANS_MODEL, FP8_CODINGS, ...).
#         NCU="BINARY:TEST:KERNEL-REGEX ...": Nsight Compute on those kernels (SpeedOfLight,
#         occupancy, launch, warp-state, memory sections; one launch after six).
#   CPU:  the codec's kernel benches: `cargo bench -p entrollm-codec --bench dtans_cpu` (CPU_BENCH
#         arguments, default "4 21") and `--bench df11`.
#   Peers:   cuBLAS (gpu_gemv_cold_timing) and our dense BF16 GEMV in each timing's table.
#   Outputs: $OUT/selftest.log, one log a timing, $OUT/log (failures first, each table's rows),
#            $OUT.tar.xz.
#   Run:     D=DIR bash bench/scenarios/kernels.sh [--dry-run | --tiny]
. "$(dirname "$0")/lib.sh"
setup
if [ "$DEVICE" = cpu ]; then
    run dtans-cpu cargo bench --manifest-path "$REPO/Cargo.toml" -p entrollm-codec --bench dtans_cpu -- ${CPU_BENCH:-$([ $TINY = 1 ] && echo "4 3" || echo "4 21")}
    [ $TINY = 1 ] || run df11-cpu cargo bench --manifest-path "$REPO/Cargo.toml" -p entrollm-codec --bench df11
    finish; exit 0
fi
parts=(); for p in ${PARTS:-}; do parts+=(--part "$p"); done
run selftest "$B" selftest --gpu "${parts[@]}" ${SMOLLM2:+--smollm2 "$SMOLLM2"}
[ $DRY = 1 ] || { grep -E "FAIL|panicked" "$OUT/selftest.out" | head -40 | tee -a "$OUT/log"; grep -E "synthetic |passed|failed" "$OUT/selftest.out" | tail -20 | tee -a "$OUT/log"; }
bin_of() { # the test binary NAME, unpacked from D
    local b=$1
    [ $DRY = 1 ] && { echo "$W/$b"; return 0; }
    [ -x "$W/$b" ] && { echo "$W/$b"; return 0; }
    [ -n "${D:-}" ] && [ -f "$D/$b.xz" ] && { unxz_to "$D/$b.xz" "$W/$b"; echo "$W/$b"; return 0; }
    return 1
}
for t in ${TIMINGS:-gpu:gpu_gemv_cold_timing ggml_gpu:ggml_gpu_timing int_gpu:int_gpu_timing dtans_gpu:dtans_gpu_cold_timing fp8_gpu:fp8_gpu_cold_timing lossy_gpu:lossy_gpu_timing}; do
    b=${t%%:*}; test=${t#*:}
    if exe=$(bin_of "$b"); then
        run "timing-$test" "$exe" --ignored --nocapture --test-threads=1 --exact "$test"
        [ $DRY = 1 ] || grep -E "^\||^[0-9]+ ?x ?[0-9]+|FAIL|panicked" "$OUT/timing-$test.out" | tee -a "$OUT/log"
    else not_run "$test" "no $b.xz in D"; fi
done
for n in ${NCU:-}; do
    IFS=: read -r b test k <<< "$n"
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    { [ -n "$ncu" ] || [ $DRY = 1 ]; } && exe=$(bin_of "$b") || { not_run "ncu-$test" "no ncu or no $b"; continue; }
    run "ncu-$b-$test" "${ncu:-ncu}" --kernel-name "regex:$k" --launch-skip 6 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        "$exe" --ignored --nocapture --test-threads=1 --exact "$test"
done
finish
