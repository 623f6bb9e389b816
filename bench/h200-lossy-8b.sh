#!/bin/bash
# A synthetic Llama-3.1-8B coded lossy and served on the H200: `synth` (BF16, kept on the machine
# between calls), `compress --bits B --quantizer Q` for each B in BITS (default 4), then per
# container (tiles of TILE weights, default 32768) `bench` (decode tok/s, 512-token prompt, prefill of 4096 tokens; lossy matrices served
# coded by lossy_mv / lossy_decode + GEMM) and the greedy tokens of the GPU against the CPU engine
# on the same container (lossy_gpu lossy_e2e_greedy); beside them `bench` of the BF16 source (unless
# SKIP_DENSE is set) and, with WITH_FP8=1, of a synthetic FP8 8B (--fp8 dense). REPEATS (default 1)
# timed runs per measurement.
#   bash bench/h200-lossy-8b.sh DIR   DIR: entrollm.xz, lossy_gpu.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/lossy}; W=/tmp/l8; BITS=${BITS:-4}; Q=${Q:-tcq32}; TILE=${TILE:-32768}
. "$(dirname "$0")/h200-setup.sh"
unxz $D/lossy_gpu.xz $W/lossy_gpu
bj() { grep -oE '"decode_tok_s": [0-9.]+|"prompt_prefill_tok_s": [0-9.]+|"prefill_tok_s": [0-9.]+|"weights": [0-9]+|"load_s": [0-9.]+|"tokens_consistent": [a-z]+|"stream_errors": [a-z0-9]+' $1 | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log; }
if [ ! -f $W/m8/config.json ]; then
  el "== synth 8B BF16"; rm -rf $W/m8; timeout 300 $B synth --shape llama-3.1-8b -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"
fi
for b in $BITS; do
  c=$W/c$b-$Q-$TILE
  if [ ! -f $c/entrollm.json ]; then
    el "== compress --bits $b --quantizer $Q --tile-weights $TILE"; rm -rf $c
    RAYON_NUM_THREADS=16 timeout ${COMPRESS_S:-420} $B compress $W/m8 -o $c --bits $b --quantizer $Q --tile-weights $TILE > $OUT/compress$b.log 2>&1; el "rc $?"
    tail -4 $OUT/compress$b.log | tee -a $OUT/log
  fi
  du -sb $c | tee -a $OUT/log
  el "== bench $b bpp $Q"; timeout 200 $B bench $c --prefill-len 4096 --repeats ${REPEATS:-1} --json > $OUT/b$b.json 2> $OUT/b$b.err; el "rc $?"; bj $OUT/b$b.json; tail -2 $OUT/b$b.err | tee -a $OUT/log
  el "== greedy GPU vs CPU, $b bpp"; LOSSY_MODEL=$c timeout ${GREEDY_S:-200} $W/lossy_gpu --ignored --nocapture --exact lossy_e2e_greedy > $OUT/greedy$b.log 2>&1; el "rc $?"
  grep -E "^gpu|^cpu|identical|diverge|panicked" $OUT/greedy$b.log | tee -a $OUT/log
done
if [ -z "${SKIP_DENSE:-}" ]; then
  el "== bench BF16 source"; timeout 120 $B bench $W/m8 --prefill-len 4096 --repeats ${REPEATS:-1} --json > $OUT/bbf16.json 2> $OUT/bbf16.err; el "rc $?"; bj $OUT/bbf16.json
fi
if [ -n "${WITH_FP8:-}" ]; then
  el "== synth FP8 8B"; rm -rf $W/f8; timeout 200 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 -o $W/f8 > $OUT/synthf8.log 2>&1; el "rc $?"
  el "== bench FP8 dense"; timeout 120 $B bench $W/f8 --fp8 dense --prefill-len 4096 --repeats ${REPEATS:-1} --json > $OUT/bfp8.json 2> $OUT/bfp8.err; el "rc $?"; bj $OUT/bfp8.json
  rm -rf $W/f8
fi
el done
