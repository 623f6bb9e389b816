#!/bin/bash
# One device call that checks and measures issues 4 and 5 together (nothing is built there):
#   bash bench/h200-final.sh DIR   with DIR holding a stripped `entrollm` and, optionally, a cubin
#   cache (`cache/`), the lead's `.dev/final` carried; peers from `.peer/anchors` (carried).
# Order: what decides most first (PDL decode vs plain, selftest), then the coded 70B and 8B, peers.
D=${1:-.dev/final}
B=$D/entrollm; chmod +x $B
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
if [ -d $D/cache ]; then mkdir -p /tmp/ec && cp -r $D/cache/. /tmp/ec/ && export ENTROLLM_CACHE=/tmp/ec; fi
L=$OUT/log; T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a $L
b8() { # name, env...: the decode protocol on the synthetic 8B
  local n=$1; shift
  el "== bench 8b $n"
  env "$@" timeout 60 $B bench --synth llama-3.1-8b --json "${EXTRA[@]}" > $OUT/b8_$n.json 2>$OUT/b8_$n.err; el "rc $?"
  grep -E '"decode_tok_s"|"tokens|decode_step|consistent|"bits_per_weight"|"weights"|"kv_cache"|"workspace"|error' $OUT/b8_$n.json $OUT/b8_$n.err | head -12 | tee -a $L
}
EXTRA=(); b8 pdl ENTROLLM_DECODE_PDL=on
b8 plain ENTROLLM_DECODE_PDL=off
el "== selftest --gpu"
timeout ${ST_S:-100} $B selftest --gpu > $OUT/selftest.log 2>&1; el "selftest rc $?"
grep -vE "^  ok " $OUT/selftest.log | tail -30 | tee -a $L
el "== 70b coded (bench/plans/single-m8.json), context 131072"
timeout ${C70_S:-170} $B bench --synth llama-3.3-70b --coded --coding-file bench/plans/single-m8.json --context 131072 --repeats 1 --long-prefill ${LONG:-32768} --json > $OUT/b70.json 2>$OUT/b70.err; el "rc $?"
cat $OUT/b70.json; tail -5 $OUT/b70.err | tee -a $L
EXTRA=(--coded --coding-file bench/plans/single-m8.json); b8 coded_single_m8 ENTROLLM_DECODE_PDL=on
el "== peers: bandwidth + cuBLAS GEMV (HF part cut by the timeout)"
(cd .peer/anchors && OUT=$OUT timeout ${PEERS_S:-45} python3 peers.py static 2>&1 | tail -9 | tee -a $L)
el done
