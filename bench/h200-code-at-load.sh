#!/bin/bash
# Code at load on the H200: a synthetic Llama-3.1-8B BF16 checkpoint written to disk, then served
# dense and coded at load on the GPU (bench/plans/single-m8.json), greedy text compared, load time
# and memory from the CLI's report; then `bench MODEL --code-at-load` (decode tok/s).
#   bash bench/h200-code-at-load.sh DIR   DIR: entrollm.xz, cache.tar.xz, tokenizer.json and
#   tokenizer_config.json of a small BPE vocabulary (padded here to the model's 128,256 ids: the
#   synthetic checkpoint has no tokenizer of its own; the text is only compared, not read).
D=${1:-.dev/final4}; W=/tmp/cal; mkdir -p $W
python3 -c 'import lzma,sys;open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' $D/entrollm.xz $W/entrollm; chmod +x $W/entrollm
mkdir -p $W/ec && tar xJf $D/cache.tar.xz -C $W/ec --strip-components=1
export ENTROLLM_CACHE=$W/ec LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$W/entrollm; T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log; }
el "== synth 8B BF16 checkpoint"; timeout 120 $B synth --shape llama-3.1-8b -o $W/m8 > $OUT/synth.log 2>&1; el "rc $?"; tail -1 $OUT/synth.log | tee -a $OUT/log
python3 - $D/tokenizer.json $W/m8/tokenizer.json <<'PY'
import json, sys
t = json.load(open(sys.argv[1])); v = t["model"]["vocab"]
for i in range(len(v), 128256): v[f"<x{i}>"] = i
json.dump(t, open(sys.argv[2], "w"))
PY
cp $D/tokenizer_config.json $W/m8/
P="The quick brown fox"
el "== run dense"; timeout 90 $B run --device cuda --max-tokens 24 -p "$P" $W/m8 > $W/dense.txt 2>$OUT/dense.err; el "rc $?"
el "== run coded at load"; timeout 120 $B run --device cuda --max-tokens 24 --code-at-load auto --coding-file bench/plans/single-m8.json -p "$P" $W/m8 > $W/coded.txt 2>$OUT/coded.err; el "rc $?"
grep -iE "code at load|coded|error" $OUT/coded.err | tail -4 | tee -a $OUT/log
cmp -s $W/dense.txt $W/coded.txt && el "greedy text: coded at load == dense" || el "greedy text: DIFFERENT"
od -c $W/dense.txt | head -3 >> $OUT/log
el "== bench --code-at-load"; timeout 150 $B bench $W/m8 --code-at-load auto --coding-file bench/plans/single-m8.json --json > $OUT/bench.json 2>$OUT/bench.err; el "rc $?"
grep -oE '"decode_tok_s": [0-9.]+|"load_s": [0-9.]+|"bits_per_weight": [0-9.]+|"tokens_consistent": [a-z]+|"weights": [0-9]+' $OUT/bench.json | tee -a $OUT/log; tail -3 $OUT/bench.err | tee -a $OUT/log
el done
