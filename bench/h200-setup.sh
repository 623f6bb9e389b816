#!/bin/bash
# The shared start of the H200 FP8 bench scripts (h200-fp8-*.sh; sourced, with D and W set): unpacks the release
# build in $D (entrollm.xz, fp8_gpu.xz where present, cache.tar.xz: the precompiled kernels) into
# $W, points ENTROLLM_CACHE at the kernel cache and the loader at the machine's libnvrtc, defines
# unxz, B (the entrollm binary) and el (a timed line in $OUT/log), and logs the GPU.
#   D=DIR W=/tmp/f8p; . "$(dirname "$0")/h200-setup.sh"
mkdir -p $W
unxz() { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $1 $2; chmod +x $2; }
unxz $D/entrollm.xz $W/entrollm
[ -f $D/fp8_gpu.xz ] && unxz $D/fp8_gpu.xz $W/fp8_gpu
rm -rf $W/ec && mkdir -p $W/ec && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
B=$W/entrollm; T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/log
