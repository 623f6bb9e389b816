#!/bin/bash
# Integer codes on the H200 (issues: quantised checkpoints; their device run): `selftest --gpu
# --part int` (every width's dequantisation bit for bit and batch-1 product against the CPU form,
# scaled/offset/signed/mins, groups 32..whole rows, act order, ragged shapes; the test GPTQ, AWQ
# and compressed-tensors checkpoints served as codes against the CPU engine), the cold-cache
# batch-1 product on the Llama-3.1-8B matrices beside our dense BF16 GEMV (int_gpu timing), then
# a synthetic Llama-3.1-8B: BF16 (entrollm synth, seed 0), its GPTQ int4 g128 made here by
# tools/gen_gptq_checkpoint.py, and its FP8 twin (synth --dtype fp8-e4m3), decode tok/s of each;
# the GPTQ checkpoint compressed (its packed codes and scales coded, tools/quant_sizes.py's
# summary) and served from the container.
# STAGE=tune: `tune --device cuda` of that GPTQ checkpoint (each launch's int codes beside their
# dtANS-coded form and the other forms that hold them), then `bench --tune` at the fastest plan
# (--budget 100%) and at $BUDGETS. Models are kept in $MODELS between the calls of one warm lease.
#   bash bench/h200-int.sh DIR   DIR: entrollm.xz, int_gpu.xz, cache.tar.xz. Outputs in $OUT.
#   STAGE=kernels | models | tune | all (default: kernels and models).
D=${1:-.dev/int}; W=/tmp/int
. "$(dirname "$0")/h200-setup.sh"
unxz $D/int_gpu.xz $W/int_gpu
STAGE=${STAGE:-all}
bench() {  # bench MODEL TAG
  el "== bench $2"; timeout 400 $B bench $1 --json > $OUT/bench-$2.json 2> $OUT/bench-$2.err; el "rc $?"
  tail -c 1500 $OUT/bench-$2.json | tee -a $OUT/log; echo | tee -a $OUT/log; tail -n 3 $OUT/bench-$2.err | tee -a $OUT/log
}
if [ "$STAGE" = all ] || [ "$STAGE" = kernels ]; then
  el "== selftest --gpu --part int"; timeout 300 $B selftest --gpu --part int > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "kernels|cases|FAIL|passed|failed|served|launches" $OUT/selftest.log | tail -30 | tee -a $OUT/log
  el "== int_gpu_timing"; timeout ${TIMING_S:-300} $W/int_gpu --ignored --nocapture --test-threads=1 --exact int_gpu_timing > $OUT/timing.log 2>&1; el "rc $?"
  grep -E "x[0-9]+ |^shape|FAIL|panicked" $OUT/timing.log | tee -a $OUT/log
fi
M=${MODELS:-/tmp/int-models}
gptq() {  # the BF16 8B and its GPTQ int4 g128, where not made yet
  mkdir -p $M
  [ -f $M/bf16/config.json ] || { el "== synth llama-3.1-8b bf16"; timeout 300 $B synth --shape llama-3.1-8b -o $M/bf16 > $OUT/synth.log 2>&1; el "rc $?"; }
  [ -f $M/gptq/config.json ] || { el "== gen_gptq_checkpoint int4 g128"; timeout 400 python3 tools/gen_gptq_checkpoint.py $M/bf16 $M/gptq > $OUT/gptq.log 2>&1; el "rc $? $(du -sb $M/gptq | cut -f1) bytes"; tail -n 2 $OUT/gptq.log | tee -a $OUT/log; }
}
if [ "$STAGE" = all ] || [ "$STAGE" = models ]; then
  gptq
  bench $M/gptq gptq-int4-g128
  [ -f $M/gptq.c/entrollm.json ] || { el "== compress gptq"; RAYON_NUM_THREADS=16 timeout 300 $B compress $M/gptq -o $M/gptq.c > $OUT/compress-gptq.log 2>&1; el "rc $?"; tail -n 2 $OUT/compress-gptq.log | tee -a $OUT/log; }
  $B inspect $M/gptq.c --json > $OUT/inspect-gptq.json && python3 tools/quant_sizes.py $OUT/inspect-gptq.json | tee -a $OUT/log
  bench $M/gptq.c gptq-container
  bench $M/bf16 bf16
  if [ -n "${FP8-1}" ]; then
    [ -f $M/fp8/config.json ] || { el "== synth llama-3.1-8b fp8"; timeout 300 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 -o $M/fp8 > $OUT/synth-fp8.log 2>&1; el "rc $?"; }
    bench $M/fp8 fp8
  fi
fi
if [ "$STAGE" = tune ]; then
  gptq
  el "== tune gptq --device cuda"; RAYON_NUM_THREADS=16 timeout ${TUNE_S:-300} $B tune $M/gptq --device cuda -o $OUT/tune.json > $OUT/tune.log 2>&1; el "rc $?"
  tail -n 6 $OUT/tune.log | tee -a $OUT/log
  for b in 100% ${BUDGETS:-}; do
    el "== bench gptq --tune --budget $b"; timeout 200 $B bench $M/gptq --tune $OUT/tune.json --budget $b --json > $OUT/plan-${b//%/pct}.json 2> $OUT/plan-${b//%/pct}.err; el "rc $?"
    tail -c 1500 $OUT/plan-${b//%/pct}.json | tee -a $OUT/log; echo | tee -a $OUT/log
    grep -E "^(qkv|o|gate_up|down|lm_head|embed) |^plan:" $OUT/plan-${b//%/pct}.err | tee -a $OUT/log
  done
fi
el done
