#!/bin/bash
# GGUF quantised blocks on the H200 (issues: quantised checkpoints; their device run): the whole
# `selftest --gpu` (the ggml part: every ggml type's dequantisation bit for bit and batch-1
# product against the CPU form, ragged shapes), the cold-cache batch-1 product of every type on
# the Llama-3.1-8B matrices beside our dense BF16 GEMV (ggml_gpu timing), then whole models: the
# llama-quantize test model of every k-quant type and a synthetic Qwen2-7B-shaped checkpoint (the
# CPU's 7B: tools/gen_qwen2_gguf.py, seed 7) quantised here by llama-quantize to Q4_K_M and Q6_K,
# logits and greedy tokens on the GPU against the CPU engine on the same file (selftest --gguf;
# `run`'s text compared as well for the test model, where a near-tie may part them), and GPU
# decode tok/s against the same checkpoint's F16 (served BF16).
#   bash bench/h200-ggml.sh DIR   DIR: entrollm.xz, cache.tar.xz, llama-quantize.xz and the shared
#   libraries it loads (libllama*, libggml*, libgomp.so.1), gguf-*.whl, smol-tokenizer.gguf
#   (tools/gguf_tokenizer_only.py of SmolLM2's GGUF); ggml_gpu.xz / int_gpu.xz where their cold-cache
#   timings are wanted. Outputs in $OUT. STAGE=kernels (selftest: PARTS, default all;
#   timing; the test model) | models (the 7B) | all (default: both) | tune (below).
# SHAPE=qwen2-7b | llama-3.1-8b (tools/gen_qwen2_gguf.py --shape), QUANTS="Q4_K_M Q6_K" (llama-quantize
# types; NVFP4: the decoder linears NVFP4 by --tensor-type, the rest Q8_0). Models are kept in
# $MODELS/$SHAPE between the calls of one warm lease (SELFTEST=0: the models stage without its
# selftest). STAGE=tune: `tune --device cuda` of each of $TUNE (default QUANTS), `bench` at its
# fastest plan; COMPRESS=1: the first compressed and served from the container; with
# FP8_SHAPE=llama-3.1-8b the same shape's FP8 twin (`synth --dtype fp8-e4m3`) beside.
D=${1:-.dev/ggml}; W=/tmp/ggml
. "$(dirname "$0")/h200-setup.sh"
unxz $D/llama-quantize.xz $W/llama-quantize; mkdir -p $W/lib && cp $D/lib*.so* $W/lib/
STAGE=${STAGE:-all}
PROMPT="The history of the city begins"
greedy() {  # greedy FILE TAG: the same prompt on the CPU engine and the GPU, tokens compared
  el "== greedy $2: cpu"; timeout 300 $B run $1 --device cpu --prompt "$PROMPT" -n ${N:-32} > $OUT/$2-cpu.txt 2> $OUT/$2-cpu.err; el "rc $?"
  el "== greedy $2: cuda"; timeout 300 $B run $1 --device cuda --prompt "$PROMPT" -n ${N:-32} > $OUT/$2-cuda.txt 2> $OUT/$2-cuda.err; el "rc $?"
  tail -n 2 $OUT/$2-cpu.err $OUT/$2-cuda.err | tee -a $OUT/log
  if cmp -s $OUT/$2-cpu.txt $OUT/$2-cuda.txt; then el "$2: GPU text identical to the CPU's"; else el "$2: GPU text DIFFERS from the CPU's"; fi
}
bench() {  # bench FILE TAG
  el "== bench $2"; timeout 300 $B bench $1 --json > $OUT/bench-$2.json 2> $OUT/bench-$2.err; el "rc $?"
  tail -c 1500 $OUT/bench-$2.json | tee -a $OUT/log; echo | tee -a $OUT/log
}
if [ "$STAGE" = all ] || [ "$STAGE" = kernels ]; then
  el "== selftest --gpu ${PARTS:+--part $PARTS}"; timeout 300 $B selftest --gpu ${PARTS:+--part $PARTS} --gguf crates/model/tests/data/gguf_kquants.gguf > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "kernels|cases|FAIL|passed|failed|served|prompt" $OUT/selftest.log | tail -40 | tee -a $OUT/log
  for t in ggml int; do  # each timing binary the bundle has
    [ -f $D/${t}_gpu.xz ] || continue; unxz $D/${t}_gpu.xz $W/${t}_gpu
    el "== ${t}_gpu_timing"; timeout ${TIMING_S:-300} $W/${t}_gpu --ignored --nocapture --test-threads=1 --exact ${t}_gpu_timing > $OUT/timing-$t.log 2>&1; el "rc $?"
    grep -E "x[0-9]+ |^shape|FAIL|panicked" $OUT/timing-$t.log | tee -a $OUT/log
  done
  greedy crates/model/tests/data/gguf_kquants.gguf tiny-kquants
fi
SHAPE=${SHAPE:-qwen2-7b}; QUANTS=${QUANTS:-Q4_K_M Q6_K}; M=${MODELS:-/tmp/ggml-models}/$SHAPE; mkdir -p $M
quant() {  # quant Q: $M/Q.gguf from the F16 file, where not made yet (NVFP4: the linears, Q8_0 beside)
  [ -f $M/$1.gguf ] && return
  local over="" ty=$1
  [ $1 = NVFP4 ] && { ty=Q8_0; over=$(for t in attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down; do printf -- '--tensor-type %s=nvfp4 ' $t; done); }
  el "== llama-quantize $1"; LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$W/lib timeout 300 $W/llama-quantize $over $M/f16.gguf $M/$1.gguf $ty 16 > $OUT/quantize-$1.log 2>&1; el "rc $? $(stat -c %s $M/$1.gguf 2>/dev/null) bytes"
}
models() {  # the F16 file and its quantisations, where not made yet
  python3 -m pip install -q --no-deps --no-compile --target /tmp/site $D/gguf-*.whl > $OUT/pip.log 2>&1
  if [ ! -f $M/f16.gguf ]; then
    el "== synthetic $SHAPE F16 GGUF"
    PYTHONPATH=/tmp/site timeout 400 python3 tools/gen_qwen2_gguf.py --shape $SHAPE --tokenizer-from $D/smol-tokenizer.gguf -o $M/f16.gguf > $OUT/gen.log 2>&1; el "rc $?"
  fi
  for q in $QUANTS; do quant $q; done
}
if [ "$STAGE" = all ] || [ "$STAGE" = models ]; then
  models
  q1=${QUANTS%% *}
  if [ "${SELFTEST:-1}" = 1 ]; then
    el "== selftest --gpu --part ggml --gguf $q1"; timeout 400 $B selftest --gpu --part ggml --gguf $M/$q1.gguf > $OUT/selftest-$q1.log 2>&1; el "rc $?"
    grep -E "cases|FAIL|passed|failed|served|prompt" $OUT/selftest-$q1.log | tail -20 | tee -a $OUT/log
  fi
  for q in $QUANTS; do bench $M/$q.gguf $SHAPE-$q; done
  bench $M/f16.gguf $SHAPE-F16
fi
if [ "$STAGE" = tune ]; then  # each of TUNE (default QUANTS) tuned and served at its fastest plan; COMPRESS=1: the first compressed and served from the container; FP8 twin
  TUNE=${TUNE:-$QUANTS}; QUANTS=$TUNE models
  for q in $TUNE; do
    el "== tune $q --device cuda"; RAYON_NUM_THREADS=16 timeout ${TUNE_S:-300} $B tune $M/$q.gguf --device cuda -o $OUT/tune-$q.json > $OUT/tune-$q.log 2>&1; el "rc $?"
    tail -n 3 $OUT/tune-$q.log | tee -a $OUT/log
    el "== bench $q --tune --budget 100%"; timeout 200 $B bench $M/$q.gguf --tune $OUT/tune-$q.json --budget 100% --json > $OUT/plan-$q.json 2> $OUT/plan-$q.err; el "rc $?"
    tail -c 600 $OUT/plan-$q.json | tee -a $OUT/log; echo | tee -a $OUT/log
    grep -E "^(qkv|o|gate_up|down|lm_head|embed) |^plan:" $OUT/plan-$q.err | tee -a $OUT/log
  done
  if [ "${COMPRESS:-0}" = 1 ]; then
    q=${TUNE%% *}
    el "== compress $q"; RAYON_NUM_THREADS=16 timeout 300 $B compress $M/$q.gguf -o $M/$q.c > $OUT/compress-$q.log 2>&1; el "rc $?"; tail -n 2 $OUT/compress-$q.log | tee -a $OUT/log
    bench $M/$q.c $SHAPE-$q-container
  fi
  if [ -n "${FP8_SHAPE:-}" ]; then
    [ -f $M/fp8/config.json ] || { el "== synth $FP8_SHAPE fp8"; timeout 300 $B synth --shape $FP8_SHAPE --dtype fp8-e4m3 -o $M/fp8 > $OUT/synth-fp8.log 2>&1; el "rc $?"; }
    bench $M/fp8 $FP8_SHAPE-fp8
  fi
fi
el done
