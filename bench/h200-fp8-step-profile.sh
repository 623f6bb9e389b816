#!/bin/bash
# Where the palette-packed FP8 decode step spends its time (session 7): the synthetic 2.1-bit
# Llama-3.1-8B FP8 checkpoint's decode graph under Nsight Compute, every kernel node timed on its own
# (gpu__time_duration, clocks and caches as they are), then the same benchmark with the attention
# chunking of ENTROLLM_DECODE_CHUNK in CHUNKS beside the default.
#   bash bench/h200-fp8-step-profile.sh DIR   DIR: entrollm.xz, cache.tar.xz. Outputs in $OUT.
D=${1:-.dev/final16}; W=/tmp/f8p
. "$(dirname "$0")/h200-setup.sh"
[ -d $W/m8 ] || { el "== synth FP8 8B, 2.1 bits"; timeout 200 $B synth --shape llama-3.1-8b --dtype fp8-e4m3 --entropy 2.1 -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"; }
el "== ncu: decode graph kernel nodes"
timeout 300 ncu --clock-control none --cache-control none --graph-profiling node \
  -k regex:'gemv_pal4|rope_append_f32q|attn_decode|embedding_gather|argmax|finish_step' \
  --launch-count ${COUNT:-700} --metrics gpu__time_duration.sum -o $OUT/step \
  $B bench $W/m8 --fp8 ${FORM:-palette} --repeats 1 --json > $OUT/ncu_bench.log 2>&1; el "rc $?"
ncu -i $OUT/step.ncu-rep --page raw --csv --metrics gpu__time_duration.sum > $OUT/step.csv 2>&1; rm -f $OUT/step.ncu-rep
python3 - $OUT/step.csv <<'PY' | tee -a $OUT/log
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
h = rows[0]; data = rows[2:]
ki, ti = h.index('Kernel Name'), h.index('gpu__time_duration.sum')
seq = [(r[ki], float(r[ti].replace(',', ''))) for r in data]
# One decode step: from an embedding_gather to the next one (the last complete step).
starts = [i for i, (k, _) in enumerate(seq) if k.startswith('embedding_gather')]
if len(starts) >= 3:
    a, b = starts[-3], starts[-2]
    step = seq[a:b]
    tot = collections.OrderedDict()
    for k, t in step:
        c = tot.setdefault(k, [0, 0.0]); c[0] += 1; c[1] += t
    s = sum(t for _, t in step)
    print(f"one step: {len(step)} kernels, {s/1e3:.1f} us summed (ns units in the csv)")
    for k, (n, t) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:<28} x{n:<4} {t/1e3:9.1f} us  {t/n/1e3:7.2f} us each  {100*t/s:5.1f} %")
else:
    print("fewer than 3 steps profiled:", len(seq), "kernels")
PY
for c in ${CHUNKS:-64x8 32x4 128x8 32x8}; do
  el "== bench palette, ENTROLLM_DECODE_CHUNK=$c"; ENTROLLM_DECODE_CHUNK=$c timeout 120 $B bench $W/m8 --fp8 palette --json > $OUT/b8_chunk$c.json 2>&1; el "rc $?"
  tr -d ' \n' < $OUT/b8_chunk$c.json | grep -oE '"decode_tok_s":[0-9.]+|"first_tokens":\[[0-9,]+\]|"decode_step":"[^"]*"' | tr '\n' ' ' | tee -a $OUT/log; echo | tee -a $OUT/log
done
el done
cd $OUT && tar czf raw.tgz --exclude=log --exclude=raw.tgz * && find . -type f ! -name log ! -name raw.tgz -delete
