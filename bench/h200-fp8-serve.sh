#!/bin/bash
# FP8 checkpoints served in FP8 on the H200: `selftest --gpu` (the FP8 → BF16 copy bit for bit, an
# FP8 model against the CPU engine), then a synthetic Llama-3.1-8B FP8 E4M3 checkpoint (per-row
# scales, compressed-tensors style) written to disk and benchmarked (`bench MODEL`), beside the
# same shape's BF16 decode (`bench --synth`).
#   bash bench/h200-fp8-serve.sh DIR   DIR: entrollm.xz, cache.tar.xz (NVRTC 13.0 cubins). Outputs in $OUT.
D=${1:-.dev/final8}; W=/tmp/f8s
. "$(dirname "$0")/h200-setup.sh"
el "== selftest --gpu"; timeout 200 $B selftest --gpu > $OUT/selftest.log 2>&1; el "rc $?"
grep -E "passed|failed|FAIL|fp8_served|FP8 E4M3|fp8_rows" $OUT/selftest.log | tail -14 | tee -a $OUT/log
el "== synth FP8 8B"; rm -rf $W/m8; timeout 150 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"; tail -1 $OUT/synth.log | tee -a $OUT/log
el "== bench FP8 8B (served in FP8)"; timeout 150 $B bench $W/m8 --json > $OUT/b8_fp8.json 2> $OUT/b8_fp8.err; el "rc $?"
grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"prompt_prefill_tok_s": [0-9.]+|"weights": [0-9]+|"load_s": [0-9.]+' $OUT/b8_fp8.json | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
tail -2 $OUT/b8_fp8.err | tee -a $OUT/log
el "== bench BF16 8B (--synth)"; timeout 90 $B bench --synth llama-3.1-8b --json > $OUT/b8_bf16.json 2> $OUT/b8_bf16.err; el "rc $?"
grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"prompt_prefill_tok_s": [0-9.]+|"weights": [0-9]+' $OUT/b8_bf16.json | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
el done
