#!/bin/bash
# A lossy 8B container tuned and planned on the H200: each lossy launch's coded form (`lossy`,
# lossy_mv) timed beside the lossless forms of its reconstruction (dense BF16, dtANS-coded, palette),
# then `bench` of the container served coded and under budgets that the plan meets by mixing them.
# Steps are skipped where their output is on the machine already (the calls of one warm lease):
#   STEP=make  bash bench/h200-lossy-plan.sh DIR   synth 8B BF16, compress --bits $BITS (e8, tiles 8192)
#   STEP=tune  bash bench/h200-lossy-plan.sh DIR   tune --device cuda
#   STEP=serve bash bench/h200-lossy-plan.sh DIR   bench: coded, and --tune --budget each of $BUDGETS
# DIR: entrollm.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/lossy}; W=/tmp/lp; BITS=${BITS:-4}; C=/tmp/lp/c$BITS
. "$(dirname "$0")/h200-setup.sh"
bj() { grep -oE '"decode_tok_s": [0-9.]+|"prompt_prefill_tok_s": [0-9.]+|"weights": [0-9]+|"load_s": [0-9.]+|"tokens_consistent": [a-z]+' $1 | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log; }
case ${STEP:-make} in
make)
  el "== synth 8B BF16"; timeout 240 $B synth --shape llama-3.1-8b -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"
  el "== compress --bits $BITS --quantizer e8 --tile-weights 8192"
  RAYON_NUM_THREADS=16 timeout 330 $B compress $W/m8 -o $C --bits $BITS --quantizer e8 --tile-weights 8192 > $OUT/compress.log 2>&1; el "rc $?"
  tail -4 $OUT/compress.log | tee -a $OUT/log; rm -rf $W/m8; du -sb $C | tee -a $OUT/log ;;
tune)
  el "== tune --device cuda"; RAYON_NUM_THREADS=16 timeout 560 $B tune $C --device cuda -o $OUT/tune.json > $OUT/tune.log 2>&1; el "rc $?"
  tail -4 $OUT/tune.log | tee -a $OUT/log; cp $OUT/tune.json $W/tune.json ;;
serve)
  el "== bench coded"; timeout 150 $B bench $C --json > $OUT/coded.json 2> $OUT/coded.err; el "rc $?"; bj $OUT/coded.json
  for b in ${BUDGETS:-6GB 8GB 12GB 100%}; do
    el "== bench --tune --budget $b"; timeout 150 $B bench $C --tune $W/tune.json --budget $b --json > $OUT/b$b.json 2> $OUT/b$b.err; el "rc $?"; bj $OUT/b$b.json
    grep -E "^(qkv|o|gate_up|down|lm_head|embed) |^plan:" $OUT/b$b.err | tee -a $OUT/log
  done ;;
esac
el done
