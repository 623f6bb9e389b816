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
#   bash bench/h200-ggml.sh DIR   DIR: entrollm.xz, ggml_gpu.xz, cache.tar.xz, llama-quantize.xz,
#   gguf-*.whl, smol-tokenizer.gguf (tools/gguf_tokenizer_only.py of SmolLM2's GGUF), libgomp.so.1
#   (llama-quantize's, where the machine lacks it). Outputs in $OUT. STAGE=kernels (selftest: PARTS, default all;
#   timing; the test model) | models (the 7B) | all (default).
D=${1:-.dev/ggml}; W=/tmp/ggml
. "$(dirname "$0")/h200-setup.sh"
unxz $D/ggml_gpu.xz $W/ggml_gpu
unxz $D/llama-quantize.xz $W/llama-quantize; mkdir -p $W/lib && cp $D/libgomp.so.1 $W/lib/
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
if [ "$STAGE" != models ]; then
  el "== selftest --gpu ${PARTS:+--part $PARTS}"; timeout 300 $B selftest --gpu ${PARTS:+--part $PARTS} --gguf crates/model/tests/data/gguf_kquants.gguf > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "kernels|cases|FAIL|passed|failed|served|prompt" $OUT/selftest.log | tail -40 | tee -a $OUT/log
  el "== ggml_gpu_timing"; timeout ${TIMING_S:-300} $W/ggml_gpu --ignored --nocapture --test-threads=1 --exact ggml_gpu_timing > $OUT/timing.log 2>&1; el "rc $?"
  grep -E "x[0-9]+ |^shape|FAIL|panicked" $OUT/timing.log | tee -a $OUT/log
  greedy crates/model/tests/data/gguf_kquants.gguf tiny-kquants
fi
if [ "$STAGE" != kernels ]; then
  el "== synthetic Qwen2-7B F16 GGUF"
  python3 -m pip install -q --no-deps --no-compile --target /tmp/site $D/gguf-*.whl > $OUT/pip.log 2>&1
  PYTHONPATH=/tmp/site timeout 400 python3 tools/gen_qwen2_gguf.py --tokenizer-from $D/smol-tokenizer.gguf -o $W/f16.gguf > $OUT/gen.log 2>&1; el "rc $?"
  for q in Q4_K_M Q6_K; do
    el "== llama-quantize $q"; LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$W/lib timeout 300 $W/llama-quantize $W/f16.gguf $W/$q.gguf $q 16 > $OUT/quantize-$q.log 2>&1; el "rc $? $(stat -c %s $W/$q.gguf 2>/dev/null) bytes"
  done
  el "== selftest --gpu --part ggml --gguf Q4_K_M"; timeout 400 $B selftest --gpu --part ggml --gguf $W/Q4_K_M.gguf > $OUT/selftest-7b.log 2>&1; el "rc $?"
  grep -E "cases|FAIL|passed|failed|served|prompt" $OUT/selftest-7b.log | tail -20 | tee -a $OUT/log
  for q in Q4_K_M Q6_K; do bench $W/$q.gguf qwen7b-$q; done
  bench $W/f16.gguf qwen7b-F16
fi
el done
