#!/bin/bash
# Lossy-coded matrices on the H200 (issue: lossy tiles on the GPU): `selftest --gpu --part lossy`
# (tile decode bit-exact against the codec's CPU decoder at BF16/F16/F32 over ragged shapes, rates
# and quantisers; the fused batch-1 product against the CPU's; damaged tiles raise the error word),
# then the cold-cache decode (GB/s of BF16 written) and batch-1 product on the Llama-3.1-8B
# matrices at 2/3/4/6 bpp for E8 and TCQ32 beside our dense BF16 GEMV and cuBLAS (lossy_gpu
# timing), then EntroPack 0.1.5 on the same kinds of matrices (its own wheel, the shared anchor
# script, PyTorch of the machine).
#   bash bench/h200-lossy.sh DIR   DIR: entrollm.xz, lossy_gpu.xz, cache.tar.xz,
#   entropack-0.1.5-py3-none-any.whl, entropack_peer.py. Outputs in $OUT.
D=${1:-.dev/lossy}; W=/tmp/lossy
. "$(dirname "$0")/h200-setup.sh"
unxz $D/lossy_gpu.xz $W/lossy_gpu
el "== selftest --gpu --part lossy"; timeout 240 $B selftest --gpu --part lossy > $OUT/selftest.log 2>&1; el "rc $?"
grep -E "lossy kernels|FAIL|passed|failed" $OUT/selftest.log | tail -24 | tee -a $OUT/log
el "== lossy_gpu_timing"; RAYON_NUM_THREADS=16 timeout ${TIMING_S:-300} $W/lossy_gpu --ignored --nocapture --test-threads=1 --exact lossy_gpu_timing > $OUT/timing.log 2>&1; el "rc $?"
grep -E "x[0-9]+ |^shape|FAIL|panicked" $OUT/timing.log | tee -a $OUT/log
[ -n "${SKIP_PEER:-}" ] || {
  el "== EntroPack 0.1.5"; python3 -m pip install -q --no-deps --no-compile --target /tmp/site $D/entropack-0.1.5-py3-none-any.whl > $OUT/pip.log 2>&1
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OUT=$OUT timeout ${PEER_S:-240} python3 $D/entropack_peer.py > $OUT/entropack.log 2>&1; el "rc $?"
  grep -E "lossy|dense_ms" $OUT/entropack.log | tee -a $OUT/log; }
el done
