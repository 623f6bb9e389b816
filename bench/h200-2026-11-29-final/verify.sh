#!/bin/bash
# Full selftest --gpu of the merged main (cubins precompiled here) and the default decode path.
D=.dev/final; B=$D/entrollm; chmod +x $B
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/ec && cp -r $D/cache/. /tmp/ec/ && export ENTROLLM_CACHE=/tmp/ec
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*"; }
el "== selftest --gpu"; timeout 170 $B selftest --gpu > $OUT/selftest.log 2>&1; el "selftest rc $?"
grep -vE "^  ok " $OUT/selftest.log | tail -40
el "== bench 8b (defaults)"; timeout 40 $B bench --synth llama-3.1-8b --json > $OUT/b8_default.json 2>&1; el "rc $?"
grep -E '"decode_tok_s"|decode_step|consistent' $OUT/b8_default.json
