#!/bin/bash
# The GPU engine on the form seam (issue 24), one prepared run that builds nothing on the device:
#   PART=check: `selftest --gpu` of the refactored engine (decode step walked from its plan, graphs
#     checked against it, every launch configuration end to end), then the regression set against
#     the previous release binary in the same call: synthetic Llama-3.1-8B BF16 decode, coded
#     prefill of 4096 tokens against dense, the 2.1-bit FP8 checkpoint palette-packed against its
#     codes as stored, and `--bf16 palette` (NOST=1: no selftest; NOBENCH=1: selftest only;
#     SHORT=1: BF16 decode and FP8 palette-packed against the previous binary, FP8 as stored).
#   PART=tune: `entrollm tune --device cuda` on the 2.1-bit FP8 checkpoint (palette forms among the
#     candidates), plans from the tune file (fastest, smallest, $MID), served and measured beside
#     the checkpoint served dense and palette-packed at load.
#   PART=bf16: synthetic Llama-3.1-8B BF16 tuned (--synth: layer 0 in every layer), planned under a
#     13 GB budget ($BUDGET) and served, beside dense (PLANFILE=FILE: that plan, no tuning).
#   PART=b70: synthetic Llama-3.3-70B BF16 tuned (one layer's launches timed, reused for all),
#     served under the largest budget that fits beside its 131,072-token KV cache ($B70, a share of
#     free device memory; a list: tried in turn until one serves), beside every layer dtANS-coded
#     with the same cache (NOCODED=1: not; TUNEFILE=FILE: that tune file, no tuning).
#   PART=... bash bench/h200-seam.sh DIR   DIR: entrollm.xz (this commit), entrollm-old.xz (the
#   release before the seam). The log and everything else, packed as out.tgz, in $OUT.
D=${1:-.dev/seam}; W=/tmp/seam; mkdir -p $W
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $1 $2; chmod +x $2; }
unxz $D/entrollm.xz $W/entrollm; unxz $D/entrollm-old.xz $W/old
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
B=$W/entrollm; O=$W/old; T0=$(date +%s); L=$OUT/log
el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a $L
keys='"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"prefill_tok_s": [0-9.e+]+|"weights": [0-9]+|"palette_matrices": [0-9]+'
b() { # tag, binary, args...: one bench run, its key figures on one line
  local t=$1 bin=$2; shift 2
  el "== bench $t: $*"; timeout ${BT:-150} $bin bench "$@" --json > $OUT/$t.json 2> $OUT/$t.err; el "rc $?"
  { grep -oE "$keys" $OUT/$t.json; tr -d ' \n' < $OUT/$t.json | grep -oE '"first_tokens":\[[0-9,]+\]'; } | tr '\n' ' ' | tee -a $L; echo | tee -a $L
  grep -iE "error|plan:|budget" $OUT/$t.err | head -12 | tee -a $L
}
fp8() { [ -d $W/m8 ] || { el "== synth FP8 8B 2.1 bits"; timeout 200 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 --entropy 2.1 -o $W/m8 > $OUT/synth8.log 2>&1; el "rc $?"; }; }
if [ "${PART:-check}" = check ]; then
  if [ -z "$NOST" ]; then
  el "== selftest --gpu (new)"; timeout ${ST:-300} $B selftest --gpu ${SP:+--part $SP} > $OUT/selftest.log 2>&1; el "rc $?"
  grep -vE "^  ok " $OUT/selftest.log | tail -30 | tee -a $L
  grep -E "launch config" $OUT/selftest.log | tail -12 | tee -a $L
  fi
  [ -n "$NOBENCH" ] || {
  for v in new old; do bin=$B; [ $v = old ] && bin=$O
    b bf16_$v $bin --synth llama-3.1-8b
    [ -n "$SHORT" ] || b coded_prefill_$v $bin --synth llama-3.1-8b --coded --prefill-len 4096 --repeats 1
  done
  [ -n "$SHORT" ] || b dense_prefill_new $B --synth llama-3.1-8b --prefill-len 4096 --repeats 1
  fp8
  for v in new old; do bin=$B; [ $v = old ] && bin=$O
    [ -n "$SHORT" ] && [ $v = old ] || b fp8_dense_$v $bin $W/m8 --fp8 dense
    b fp8_palette_$v $bin $W/m8 --fp8 palette
  done
  [ -n "$SHORT" ] || b bf16_palette_new $B --synth llama-3.1-8b --bf16 palette
  }
elif [ "$PART" = bf16 ]; then
  if [ -n "$PLANFILE" ]; then cp $PLANFILE $W/b13.json  # a plan made here from an earlier call's tune file
  else
    el "== tune --device cuda BF16 8B"; timeout 330 $B tune --synth llama-3.1-8b --device cuda --max-variants ${MV:-2} -o $OUT/tune-bf16-8b.json > $OUT/tune_bf16.log 2>&1; el "rc $?"; tail -3 $OUT/tune_bf16.log | tee -a $L
    $B plan $OUT/tune-bf16-8b.json --budget ${BUDGET:-13GB} -o $W/b13.json --plot $OUT/fronts-bf16-8b.svg 2>&1 | tail -12 | tee -a $L
  fi
  b bf16_plan_13gb $B --synth llama-3.1-8b --plan $W/b13.json
  b bf16_dense_ref $B --synth llama-3.1-8b
elif [ "$PART" = b70 ]; then
  if [ -n "$SP" ]; then el "== selftest --gpu --part $SP"; timeout ${ST:-200} $B selftest --gpu --part $SP > $OUT/selftest.log 2>&1; el "rc $?"; grep -vE "^  ok " $OUT/selftest.log | tail -12 | tee -a $L; fi
  T70=${TUNEFILE:-$OUT/tune-bf16-70b.json}
  if [ -z "$TUNEFILE" ]; then
    el "== tune --device cuda BF16 70B"; timeout ${TT:-300} $B tune --synth llama-3.3-70b --device cuda --max-variants ${MV:-2} -o $T70 > $OUT/tune_70b.log 2>&1; el "rc $?"; tail -3 $OUT/tune_70b.log | tee -a $L
    $B plan $T70 --plot $OUT/fronts-bf16-70b.svg 2>&1 | tail -3 | tee -a $L
  fi
  BT=${BT:-240}
  for p in ${B70:-97%}; do  # budgets in turn, until one serves (a list: the largest first)
    b b70_plan_${p%\%} $B --synth llama-3.3-70b --tune $T70 --budget $p --context 131072 --prompt-len 128
    grep -q decode_tok_s $OUT/b70_plan_${p%\%}.json && break
  done
  [ -n "$NOCODED" ] || b b70_coded $B --synth llama-3.3-70b --coded --context 131072 --prompt-len 128
else
  fp8
  el "== tune --device cuda FP8 8B"; timeout ${TT:-300} $B tune $W/m8 --device cuda --max-variants ${MV:-3} -o $OUT/tune-fp8-8b.json > $OUT/tune_fp8.log 2>&1; el "rc $?"; tail -3 $OUT/tune_fp8.log | tee -a $L
  $B plan $OUT/tune-fp8-8b.json -o $W/fast.json --plot $OUT/fronts-fp8-8b.svg 2>&1 | tail -12 | tee -a $L
  b fp8_plan_fastest $B $W/m8 --fp8 dense --plan $W/fast.json
  min=$(python3 -c "import json;t=json.load(open('$OUT/tune-fp8-8b.json'));print(sum(min(p['bytes'] for p in l['points']) for l in t['launches']))")
  $B plan $OUT/tune-fp8-8b.json --budget $min -o $W/small.json 2>&1 | tail -12 | tee -a $L
  b fp8_plan_smallest $B $W/m8 --fp8 dense --plan $W/small.json
  $B plan $OUT/tune-fp8-8b.json --budget ${MID:-6.5GB} -o $W/mid.json 2>&1 | tail -12 | tee -a $L
  b fp8_plan_mid $B $W/m8 --fp8 dense --plan $W/mid.json
  b fp8_dense_ref $B $W/m8 --fp8 dense
  b fp8_palette_ref $B $W/m8 --fp8 palette
fi
el done
(cd $OUT && tar czf /tmp/out.tgz --exclude log . && find . -type f ! -name log -delete && mv /tmp/out.tgz .)
