#!/bin/bash
# decode-perf device run of 2026-11-29 (binary of commit 9221940, PDL on by default there):
# PDL on/off benches, selftest, PDL + one-launch attention.
cd "$(dirname "$0")/../.." 2>/dev/null || true
B=.dev/perf/entrollm
chmod +x $B
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
b() { # name, env...
  local n=$1; shift
  echo "-- $n"; env "$@" timeout 45 $B bench --synth llama-3.1-8b --json > $OUT/bd_$n.json 2>&1
  grep -E '"decode_tok_s"|decode_step|error|Error' $OUT/bd_$n.json | head -3
}
b pdl X=1
b nopdl ENTROLLM_DECODE_PDL=off
echo "== selftest"; timeout 55 $B selftest --gpu > $OUT/selftest.log 2>&1; echo "rc $?"
grep -E "FAIL|passed|failed|e2e" $OUT/selftest.log | tail -8
b pdl_attnfused ENTROLLM_DECODE_ATTN=fused
b pdl2 X=1
