#!/bin/bash
# BF16 checkpoints palette-packed losslessly (`--bf16 palette`, session 10): `selftest --gpu`, then a
# synthetic Llama-3.1-8B BF16 checkpoint written on the device and benchmarked end to end with its
# matrices as stored and palette-packed, in the variants BENCHES lists (tag:--bf16 form:ENV%value,...).
# SKIP_SELFTEST: leave out the selftest; BENCH_TIMEOUT (s).
#   bash bench/h200-bf16-palette.sh DIR   DIR: entrollm.xz, cache.tar.xz. Outputs in $OUT.
D=${1:?build directory}; W=/tmp/b16p
. "$(dirname "$0")/h200-setup.sh"
if [ -z "${SKIP_SELFTEST:-}" ]; then
  el "== selftest --gpu"; timeout 240 $B selftest --gpu > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "passed|failed|FAIL|bf16_palette|pal4_bf16_rows|BF16 palette" $OUT/selftest.log | grep -vE "^  ok +gemv" | tail -16 | tee -a $OUT/log
fi
el "== synth BF16 8B"; rm -rf $W/m16; timeout 300 $B synth --shape llama-3.1-8b -o $W/m16 > $OUT/synth.log 2>&1; el "rc $?"; tail -1 $OUT/synth.log | tee -a $OUT/log
for v in ${BENCHES:-dense:dense: palette:palette: dense2:dense: palette2:palette:}; do
  IFS=: read -r tag form envs <<< "$v"
  el "== bench BF16 8B $tag: --bf16 $form ${envs:-}"
  env $(echo "${envs:-}" | tr ',' ' ' | tr '%' '=') timeout ${BENCH_TIMEOUT:-240} $B bench $W/m16 --bf16 $form --json > $OUT/b16_$tag.json 2> $OUT/b16_$tag.err; el "rc $?"
  { grep -oE '"decode_tok_s": [0-9.]+|"prefill_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"weights": [0-9]+|"bf16_palette_matrices": [0-9]+|"load_s": [0-9.]+' $OUT/b16_$tag.json; tr -d ' \n' < $OUT/b16_$tag.json | grep -oE '"first_tokens":\[[0-9,]+\]'; grep -E "^bf16:" $OUT/b16_$tag.err; } | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
  tail -2 $OUT/b16_$tag.err | tee -a $OUT/log
done
el done
cd $OUT && tar czf raw.tgz --exclude=log --exclude=raw.tgz * && find . -type f ! -name log ! -name raw.tgz -delete
