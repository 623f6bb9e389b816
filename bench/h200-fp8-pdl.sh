#!/bin/bash
# Palette-packed FP8 decode under programmatic dependent launch (session 7): `selftest --gpu` (with
# the FP8 PDL-vs-plain decode cases), the per-launch table of the Llama-3.1-8B shapes at 2.1 bits
# (every palette configuration, dense FP8 beside it), then a synthetic Llama-3.1-8B FP8 checkpoint
# at 2.1 bits benchmarked end to end, `--fp8 dense` and `--fp8 palette`, in the variants BENCHES
# lists (tag:form:ENV%value,...[:old], old: the build in $OLD). ENTROLLM_TRACE%/tmp/f8p/trace_TAG.csv
# in a bench's envs: a traced build's decode-step timeline (bench/trace-summary.py reads it).
# SKIP_SELFTEST, SKIP_TIMING: leave out the selftest, the per-launch table; BENCH_TIMEOUT (s).
#   bash bench/h200-fp8-pdl.sh DIR   DIR: entrollm.xz, fp8_gpu.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/final14}; W=/tmp/f8p
. "$(dirname "$0")/h200-setup.sh"
if [ -n "${OLD:-}" ]; then  # another build (its own kernel cache) for benches tagged :old
  mkdir -p $W/old/ec && unxz $OLD/entrollm.xz $W/old/entrollm && tar xJf $OLD/cache.tar.xz -C $W/old/ec --strip-components=1
fi
if [ -n "${FP8_ONLY:-}" ]; then  # the FP8 kernel cases only (fp8_gpu_selftest), not the whole selftest
  el "== fp8_gpu_selftest"; timeout 120 $W/fp8_gpu --ignored --nocapture --exact fp8_gpu_selftest > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "passed|failed|FAIL|test result" $OUT/selftest.log | tail -6 | tee -a $OUT/log
elif [ -z "${SKIP_SELFTEST:-}" ]; then
  el "== selftest --gpu"; timeout 240 $B selftest --gpu > $OUT/selftest.log 2>&1; el "rc $?"
  grep -E "passed|failed|FAIL|pdl_vs_plain|palette-packed" $OUT/selftest.log | grep -vE "^  ok +gemv" | tail -16 | tee -a $OUT/log
fi
if [ -z "${SKIP_TIMING:-}" ]; then
  el "== per-launch timing (FP8 2.1 bits)"; FP8_CODINGS=none timeout 200 $W/fp8_gpu --ignored --nocapture --test-threads=1 --exact fp8_gpu_cold_timing > $OUT/timing.log 2>&1; el "rc $?"
  grep -E "^\||32 decoder|FAIL|panicked" $OUT/timing.log | tee -a $OUT/log
fi
if [ -n "${REUSE_MODEL:-}" ] && [ -f $W/m8/config.json ]; then el "== synth FP8 8B: reusing $W/m8 (a warm machine)"
else el "== synth FP8 8B, 2.1 bits"; rm -rf $W/m8; timeout 200 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 --entropy 2.1 -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"; tail -1 $OUT/synth.log | tee -a $OUT/log; fi
bench() {  # tag, --fp8 form, env assignments (a%b,c%d for a=b c=d), "old": OLD's build
  local b=$B c=$ENTROLLM_CACHE; [ "${4:-}" = old ] && b=$W/old/entrollm c=$W/old/ec
  el "== bench FP8 8B $1: --fp8 $2 ${3:-} ${4:-}"; env ENTROLLM_CACHE=$c $(echo "${3:-}" | tr ',' ' ' | tr '%' '=') timeout ${BENCH_TIMEOUT:-120} $b bench $W/m8 --fp8 $2 --json > $OUT/b8_$1.json 2> $OUT/b8_$1.err; el "rc $?"
  { grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"weights": [0-9]+|"palette_matrices": [0-9]+' $OUT/b8_$1.json; tr -d ' \n' < $OUT/b8_$1.json | grep -oE '"first_tokens":\[[0-9,]+\]|"decode_step":"[^"]*"'; } | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
}
for v in ${BENCHES:-dense:dense: palette:palette: palette_nopdl:palette:ENTROLLM_DECODE_PDL%off}; do
  IFS=: read -r tag form envs build <<< "$v"; bench $tag $form "$envs" "$build"
done
el done
cp $W/trace_*.csv $OUT/ 2>/dev/null
cd $OUT && tar czf raw.tgz --exclude=log --exclude=raw.tgz * && find . -type f ! -name log ! -name raw.tgz -delete
