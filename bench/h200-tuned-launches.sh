#!/bin/bash
# The tuned mvm launches on the H200, end to end, beside the previous tuning and our dense path.
#   bash bench/h200-tuned-launches.sh DIR   DIR: entrollm.xz (this commit), entrollm_old.xz (the
#   binary before the tuning, optional), dtans_gpu.xz and fp8_gpu.xz (the test binaries),
#   cache.tar.xz (NVRTC 13.0 cubins: dtans_precompile_sweep_cubins, serve_precompile_cubins,
#   dtans_precompile_cubins, fp8_precompile_cubins with FP8_CODINGS as below). Builds nothing;
#   outputs in $OUT.
# Steps: `entrollm selftest --gpu` (SmolLM2 cases skipped: the GGUF does not travel here); the plan
# sweep of the compact plan's codings on the 8B and 70B launches; `bench --synth llama-3.1-8b`
# dense, coded (bench/plans/single-m8.json) twice, and coded with the old binary; the coded 70B with
# its full 131072-token KV cache, decode at a 512-token prompt and after a 32768-token prefill; the
# coded FP8 mvm (2.1-bit codes) with Pair codings against the dense FP8 GEMV, per launch.
D=${1:-.dev/final6}; W=/tmp/tl; mkdir -p $W
for b in entrollm entrollm_old dtans_gpu fp8_gpu; do
  [ -f $D/$b.xz ] && { python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $D/$b.xz $W/$b; chmod +x $W/$b; }
done
rm -rf $W/ec && mkdir -p $W/ec && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
lib=$(find /usr/local/cuda/lib64 $(python3 -c 'import site;print(" ".join(site.getsitepackages()))' 2>/dev/null) -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
[ -n "$lib" ] && { mkdir -p $W/nvrtc; ln -sf $lib $W/nvrtc/libnvrtc.so; export LD_LIBRARY_PATH=$W/nvrtc:$(dirname $lib):$LD_LIBRARY_PATH; }
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $OUT/log
el "== selftest --gpu"; timeout 200 $W/entrollm selftest --gpu > $OUT/selftest.log 2>&1; el "rc $?"
grep -E "passed|failed|FAIL" $OUT/selftest.log | tail -8 | tee -a $OUT/log
for m in 8b 70b; do
  el "== plan sweep $m"; DTANS_MODEL=$m timeout 240 $W/dtans_gpu --ignored --exact dtans_gpu_plan_sweep --nocapture > $OUT/plan_$m.log 2>&1; el "rc $?"
  grep -E "^\||FAIL" $OUT/plan_$m.log | tee -a $OUT/log
done
P=bench/plans/single-m8.json
for v in new:dense new:coded old:coded new:coded_again; do
  b=${v%%:*}; k=${v##*:}; bin=$W/entrollm; [ $b = old ] && bin=$W/entrollm_old
  [ -x $bin ] || continue
  a=(); [ $k != dense ] && a=(--coded --coding-file $P)
  el "== 8B $b $k"; timeout 120 $bin bench --synth llama-3.1-8b --json "${a[@]}" > $OUT/b8_${b}_$k.json 2> $OUT/b8_${b}_$k.err; el "rc $?"
  grep -oE '"decode_tok_s": [0-9.]+|"tokens_consistent": [a-z]+|"bits_per_weight": [0-9.]+' $OUT/b8_${b}_$k.json | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
done
el "== 70B coded, 131072-token cache"
timeout 300 $W/entrollm bench --synth llama-3.3-70b --coded --coding-file $P --context 131072 --repeats 1 --long-prefill 32768 --json > $OUT/b70.json 2> $OUT/b70.err; el "rc $?"
grep -oE '"decode_tok_s": [0-9.]+|"long_decode_tok_s": [0-9.]+|"long_prefill_s": [0-9.]+|"bits_per_weight": [0-9.]+|"kv_cache": [0-9]+|"weights": [0-9]+|"device_used": [0-9]+' $OUT/b70.json | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
el "== FP8 per launch"
FP8_CODINGS="auto,pair:8:1024:16,pair:9:1024:16,pair:10:1024:16,single:8:1024,pair:8:512:16,pair:8:2048:16" \
  timeout 300 $W/fp8_gpu --ignored --exact fp8_gpu_cold_timing --nocapture > $OUT/fp8.log 2>&1; el "rc $?"
grep -E "^\||coded vs|FAIL" $OUT/fp8.log | tee -a $OUT/log
el done
