#!/bin/bash
# SmolLM2-135M-Instruct on the GPU, the call after bench/h200-issue4.sh (which stashed the GGUF's
# first part; this call carries the rest): `selftest --gpu` with SmolLM2 (GPU vs CPU logits and
# greedy tokens, every kernel), then the GGUF compressed to a container and served on the GPU
# (fused mvm for its coded matrices) vs the same container decoded at load (dense GPU path) vs the
# GGUF, greedy tokens on five prompts.  bash bench/h200-smollm2.sh DIR PART2
D=${1:-.dev/final2}; P2=${2:-.dev/smolB/smol.b}; W=/tmp/final; mkdir -p $W
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"; }
[ -x $W/entrollm ] || { unxz $D/entrollm.xz $W/entrollm; chmod +x $W/entrollm; }
[ -d $W/ec ] || { mkdir -p $W/ec && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1; }
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$W/entrollm; L=$OUT/log; T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
G=/tmp/smol.gguf
cat ~/.cache/entrollm/smollm2/smol.a $P2 > $G
if [ "$(sha256sum $G | cut -d' ' -f1)" = "$(cat $D/smol.sha256)" ]; then el "smollm2: ok"; else el "smollm2: MISSING/CORRUPT"; exit 1; fi
el "== selftest --gpu --smollm2"; timeout 150 $B selftest --gpu --smollm2 $G > $OUT/selftest.log 2>&1; el "rc $?"
grep -vE "^  ok " $OUT/selftest.log | tail -12 | tee -a $L; grep -E "smollm2|SmolLM2" $OUT/selftest.log | head -12 | tee -a $L
el "== compress"; rm -rf /tmp/smol.etl; timeout 60 $B compress $G -o /tmp/smol.etl > $OUT/compress.log 2>&1; el "rc $?"; tail -2 $OUT/compress.log | tee -a $L
i=0; same=0
for p in "The capital of France is" "def fibonacci(n):" "Water boils at" "The three primary colors are" "Once upon a time"; do
  i=$((i+1))
  timeout 30 $B run --device cuda --max-tokens 32 -p "$p" /tmp/smol.etl > /tmp/served_$i.txt 2>/dev/null
  timeout 30 $B run --device cuda --max-tokens 32 --decode-at-load -p "$p" /tmp/smol.etl > /tmp/decoded_$i.txt 2>/dev/null
  timeout 30 $B run --device cuda --max-tokens 32 -p "$p" $G > /tmp/gguf_$i.txt 2>/dev/null
  s=$(cmp -s /tmp/served_$i.txt /tmp/decoded_$i.txt && echo same || echo DIFFERENT)
  g=$(cmp -s /tmp/served_$i.txt /tmp/gguf_$i.txt && echo same || echo DIFFERENT)
  [ $s = same ] && same=$((same+1))
  el "prompt $i: served vs decoded-at-load $s, served vs GGUF $g: $(head -c 160 /tmp/served_$i.txt | tr '\n' ' ')"
  [ $s = same ] || el "   decoded: $(head -c 160 /tmp/decoded_$i.txt | tr '\n' ' ')"
done
el "served container == dense GPU path on $same of 5 prompts"
el done
