#!/bin/bash
# entrollm gpu-engine device run: selftest, decode bench, prefill bench vs PyTorch, GEMV vs cuBLAS, peers.
cd "$(dirname "$0")/../.."
B=.dev/gpu/entrollm
chmod +x $B .dev/gpu/gpu_test
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=~/.cache/entrollm/smollm2
mkdir -p $S
ok() { [ "$(sha256sum $S/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null | cut -d' ' -f1)" = "$(cat .dev/gpu/smol.sha256)" ]; }
ok || cat $S/smol.part00 .dev/gpu/smol.part01 > $S/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null
if [ "$(sha256sum $S/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .dev/gpu/smol.sha256)" ]; then echo "smollm2: ok"; else echo "smollm2: MISSING/CORRUPT"; rm -f $S/SmolLM2-135M-Instruct.Q4_1.gguf; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== selftest"; $B selftest --gpu > $OUT/selftest.log 2>&1; echo "rc $?"; grep -E "FAIL|passed|failed|prompt|e2e|smollm2_greedy|synth_fill" $OUT/selftest.log | tail -24
echo "== bench decode"; $B bench --synth llama-3.1-8b > $OUT/bench_decode.txt 2>&1; cat $OUT/bench_decode.txt
for A in fused split; do for N in fused split; do echo "-- attention $A, norm $N"; ENTROLLM_DECODE_ATTN=$A ENTROLLM_DECODE_NORM=$N $B bench --synth llama-3.1-8b --json > $OUT/bd_${A}_${N}.json 2>&1; grep -E "decode_tok_s|error" $OUT/bd_${A}_${N}.json; done; done
for C in 16x4 32x4 128x16 256x4; do echo "-- chunk $C"; ENTROLLM_DECODE_CHUNK=$C $B bench --synth llama-3.1-8b --json > $OUT/bd_c$C.json 2>&1; grep -E "decode_tok_s|error" $OUT/bd_c$C.json; done
tar czf $OUT/bd.tgz -C $OUT $(cd $OUT && ls bd_*.json) && rm -f $OUT/bd_*.json
echo "== bench prefill 4096"; $B bench --synth llama-3.1-8b --prefill-len 4096 --json > $OUT/bench_prefill.json 2>&1; grep -E "prefill_s|prefill_tok_s|decode_tok_s|weights|kv_cache|workspace|error" $OUT/bench_prefill.json
echo "== torch prefill 4096"; python3 .dev/gpu/torch_prefill.py --tokens 4096 --json $OUT/torch_prefill.json 2>&1 | grep -E "median|tok_s|torch|runs" -A0
echo "== gemv cold vs cublas"; .dev/gpu/gpu_test --ignored --nocapture --test-threads=1 gpu_gemv_cold_timing > $OUT/gemv.log 2>&1; tail -8 $OUT/gemv.log
echo "== peers (bandwidth + cuBLAS GEMV; HF part cut by the timeout)"; (cd .peer/anchors && OUT=$OUT timeout ${PEERS_S:-40} python3 peers.py static 2>&1 | tail -12); ls $OUT
