#!/bin/bash
# The families beyond Llama on the GPU (Qwen3, Phi-3 with heads of 64 and 96, Gemma 2, Gemma 3,
# Mixtral and Qwen3-MoE with dense and Q8_0 experts): `selftest --gpu` (every kernel against its
# CPU reference, the families' kernels, the mixture of experts' gathered products and attention
# masks included, then each family's synthetic model, GPU engine against CPU engine: prefill and
# decode logits, greedy tokens). PARTS=families runs only `selftest --gpu --part families`. Builds nothing on the device: D holds the release build as the other bench scripts take
# it (entrollm.xz; cache.tar.xz, the precompiled kernels, if present: NVRTC compiles the rest).
#   D=DIR bash bench/gpu-families.sh        (on the device machine; the logs go to $OUT)
D=${D:-.dev/families}; W=/tmp/families; OUT=${OUT:-/tmp/families-out}; mkdir -p $W $OUT
python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $D/entrollm.xz $W/entrollm
chmod +x $W/entrollm
mkdir -p $W/ec; [ -f $D/cache.tar.xz ] && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) \
    -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
B=$W/entrollm; T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/log
el "== selftest --gpu ${PARTS:+--part $PARTS}"
timeout 540 $B selftest --gpu ${PARTS:+--part $PARTS} > $OUT/selftest.log 2>&1; el "rc $?"
# The families' cases (their kernels, the masked attention, each family end to end), failures first.
grep -E "FAIL" $OUT/selftest.log | head -40 | tee -a $OUT/log
grep -cE "rope_heads|add_rmsnorm|geglu|scale_f32|softcap|window=" $OUT/selftest.log | sed 's/^/family kernel cases: /' | tee -a $OUT/log
grep -cE "moe_|_experts" $OUT/selftest.log | sed 's/^/mixture-of-experts kernel cases: /' | tee -a $OUT/log
grep -cE "x96|/96|96x" $OUT/selftest.log | sed 's/^/head-96 kernel cases: /' | tee -a $OUT/log
grep -E "synthetic " $OUT/selftest.log | tee -a $OUT/log
tail -4 $OUT/selftest.log | tee -a $OUT/log
el done
