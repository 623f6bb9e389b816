#!/bin/bash
# Palette-packed FP8 on the H200 (gemv_pal4): `selftest --gpu` (palette GEMV and BF16 copy against
# the CPU references, a palette-served FP8 model against the CPU engine), the per-launch table on
# the Llama-3.1-8B shapes at 2.1 bits of code entropy (dense FP8 GEMV vs palette, checked first),
# then a synthetic Llama-3.1-8B FP8 checkpoint at 2.1 bits written to disk and benchmarked end to
# end with its matrices as stored (--fp8 dense) and palette-packed (--fp8 palette), beside the
# BF16 decode of the same shape.
#   bash bench/h200-fp8-palette.sh DIR   DIR: entrollm.xz, fp8_gpu.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/final9}; W=/tmp/f8p
. "$(dirname "$0")/h200-setup.sh"
if [ -n "${FP8_ONLY:-}" ]; then  # the FP8 kernel cases only (fp8_gpu_selftest), not the whole selftest
  el "== fp8_gpu_selftest"; timeout 120 $W/fp8_gpu --ignored --nocapture --exact fp8_gpu_selftest > $OUT/selftest.log 2>&1; el "rc $?"
else
  el "== selftest --gpu"; timeout 240 $B selftest --gpu > $OUT/selftest.log 2>&1; el "rc $?"
fi
grep -E "passed|failed|FAIL|pal4|palette" $OUT/selftest.log | grep -vE "^ok" | tail -24 | tee -a $OUT/log
el "== per-launch timing (FP8 2.1 bits)"; FP8_CODINGS=none timeout 200 $W/fp8_gpu --ignored --nocapture --test-threads=1 --exact fp8_gpu_cold_timing > $OUT/timing.log 2>&1; el "rc $?"
grep -E "^[a-z_]+ +[0-9]+x|^\||32 decoder|FAIL|panicked" $OUT/timing.log | tee -a $OUT/log
el "== synth FP8 8B, 2.1 bits"; rm -rf $W/m8; timeout 200 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 --entropy 2.1 -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"; tail -1 $OUT/synth.log | tee -a $OUT/log
for f in dense palette; do
  el "== bench FP8 8B --fp8 $f"; timeout 120 $B bench $W/m8 --fp8 $f --json > $OUT/b8_$f.json 2> $OUT/b8_$f.err; el "rc $?"
  { grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"prompt_prefill_tok_s": [0-9.]+|"weights": [0-9]+|"load_s": [0-9.]+|"palette_matrices": [0-9]+' $OUT/b8_$f.json; tr -d ' \n' < $OUT/b8_$f.json | grep -oE '"first_tokens":\[[0-9,]+\]'; } | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
  tail -3 $OUT/b8_$f.err | tee -a $OUT/log
done
[ -n "${SKIP_BF16:-}" ] || { el "== bench BF16 8B (--synth)"; timeout 90 $B bench --synth llama-3.1-8b --json > $OUT/b8_bf16.json 2> $OUT/b8_bf16.err; el "rc $?"
grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"weights": [0-9]+' $OUT/b8_bf16.json | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log; }
el done
