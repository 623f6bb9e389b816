#!/bin/bash
# Issue 4's checks in one device call, beside the peers (nothing is built there):
#   bash bench/h200-issue4.sh DIR   DIR: entrollm.xz, gpu_test.xz (crates/cuda/tests/gpu.rs),
#   cache.tar.xz (precompiled cubins), torch_prefill.py; the peers' anchors in .peer/anchors.
# Decode (default and the unfused comparison), prefill 4096 vs PyTorch, our GEMV vs cuBLAS (cold),
# peers.py static (HBM bandwidth, PyTorch GEMVs, HF transformers static cache + torch.compile).
# Optional: SMOL_PART=FILE is stashed for the next call (the SmolLM2 GGUF travels in two parts).
D=${1:-.dev/final2}; W=/tmp/final; mkdir -p $W
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"; }
unxz $D/entrollm.xz $W/entrollm; unxz $D/gpu_test.xz $W/gpu_test; chmod +x $W/entrollm $W/gpu_test
mkdir -p $W/ec && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1 && export ENTROLLM_CACHE=$W/ec
cp $D/torch_prefill.py $W/
[ -n "$SMOL_PART" ] && mkdir -p ~/.cache/entrollm/smollm2 && cp "$SMOL_PART" ~/.cache/entrollm/smollm2/smol.a
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$W/entrollm; L=$OUT/log; T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a $L
b8() { local n=$1; shift
  env "$@" timeout 60 $B bench --synth llama-3.1-8b --json "${EXTRA[@]}" > $OUT/b8_$n.json 2>$OUT/b8_$n.err
  el "$n rc $? $(grep -oE '"decode_tok_s": [0-9.]+|"prefill_tok_s": [0-9.]+|"prefill_s": [0-9.]+|"tokens_consistent": [a-z]+|"(weights|kv_cache|workspace|device_used)": [0-9]+' $OUT/b8_$n.json | tr '\n' ' ')"; }
EXTRA=()
b8 default; b8 unfused ENTROLLM_DECODE_NORM=split ENTROLLM_DECODE_ROPE=split; b8 default_2
EXTRA=(--prefill-len 4096); b8 prefill4096
el "== torch prefill 4096"; timeout 90 python3 $W/torch_prefill.py --tokens 4096 --json $OUT/torch_prefill.json 2>&1 | tail -4 | tee -a $L
el "== our GEMV vs cuBLAS, cold"; timeout 60 $W/gpu_test --ignored --nocapture --test-threads=1 gpu_gemv_cold_timing > $OUT/gemv.log 2>&1; el "rc $?"; tail -9 $OUT/gemv.log | tee -a $L
el "== peers.py static"; (cd .peer/anchors && OUT=$OUT timeout ${PEERS_S:-250} python3 peers.py static 2>&1 | tail -14 | tee -a $L)
el done
