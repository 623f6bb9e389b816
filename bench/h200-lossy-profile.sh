#!/bin/bash
# Nsight Compute on the lossy kernels (one decode and one product launch of each quantiser on a
# 4096 × 4096 matrix at 4 bpp: the first launch of each, outside the timed graphs): speed of light, warp states, memory.
#   bash bench/h200-lossy-profile.sh DIR   DIR: entrollm.xz, lossy_gpu.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/lossy}; W=/tmp/lossy
. "$(dirname "$0")/h200-setup.sh"
unxz $D/lossy_gpu.xz $W/lossy_gpu
for q in ${QS:-tcq32 e8}; do for k in lossy_mv lossy_decode; do
  el "== ncu $q $k"
  LOSSY_SHAPES=4096x4096 LOSSY_BITS=4 LOSSY_QUANTIZERS=$q timeout 200 ncu --target-processes all -k $k -c 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section SourceCounters \
    $W/lossy_gpu --ignored --nocapture --exact lossy_gpu_timing > $OUT/ncu_${q}_$k.txt 2>&1; el "rc $?"
  grep -E "Duration|Warp Cycles|L1/TEX Hit|L2 Hit|Achieved Occupancy|Issued Warp|No Eligible|Active Warps|Stall|stall" $OUT/ncu_${q}_$k.txt | head -30 | tee -a $OUT/log
done; done
el done
