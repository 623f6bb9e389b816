#!/bin/bash
# Next device call for decode-perf (not yet run): the PDL fix of 530e35c. A stripped
# target/release/entrollm of 730e791 and this script are staged in /work/main/.dev/perf: run
# `bash .dev/perf/verify.sh 2>&1 | tee $OUT/log` with carry [".dev/perf"], timeout ~200 s.
# PDL can become the default when e2e_decode_pdl_vs_plain (both shapes) and tokens_consistent pass.
cd "$(dirname "$0")/../.." 2>/dev/null || true
B=.dev/perf/entrollm
chmod +x $B
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
b() { # name, env...
  local n=$1; shift
  echo "-- $n"; env "$@" timeout 45 $B bench --synth llama-3.1-8b --json > $OUT/bd_$n.json 2>&1
  grep -E '"decode_tok_s"|decode_step|tokens_consistent|error|Error' $OUT/bd_$n.json | head -4
}
b pdl ENTROLLM_DECODE_PDL=on
b plain X=1
echo "== selftest"; timeout 70 $B selftest --gpu > $OUT/selftest.log 2>&1; echo "rc $?"
grep -E "FAIL|passed|failed|e2e" $OUT/selftest.log | tail -10
b pdl2 ENTROLLM_DECODE_PDL=on
