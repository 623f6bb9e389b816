#!/usr/bin/env bash
# Scenario lossy-quality: what lossy coding costs in accuracy at a rate. PARTS (default "rd model"):
#   rd     rate–distortion on matrices: `cargo bench -p entrollm-codec --bench lossy_rd` (relative
#          L2 error at the achieved rate, every stored byte counted) for RD_QUANTIZERS (default
#          int,fp8,tcq32,e8) at RD_BITS (2,3,4,5,6) on RD_SOURCES (gauss, and file:minilm: the
#          all-MiniLM-L6-v2 BF16 matrices) and RD_SHAPES (1024x4096)
#   model  a real model coded at several rates, each scored against its F32 source on the same
#          windows (`eval ppl --reference`: perplexity, KL divergence, same top token), beside
#          llama.cpp's k-quant mixes of the same F32 weights; one chat at 4 bits
#   Inputs:  F32 (the source; default: SmolLM2's Q4_1 GGUF dequantised to F32 by
#            tools/gguf_f32_reference.py), TEXT (default /usr/share/common-licenses/GPL-3),
#            TOKENS (scored tokens, default 1536; --tiny: 128), SPECS (entrollm codings, each
#            NAME=compress flags after the source, ';'-separated; default tcq32 at 3, 4, 5 bits, e8,
#            int and fp8 at 4; a calibration text goes in the flags, --calib FILE, not TEXT),
#            QUANTS (llama.cpp mixes, default "Q3_K_M Q4_K_M Q5_K_M"; needs LLAMA).
#   Peers:   llama.cpp's llama-quantize mixes of the same F32 (token embedding and output kept F32
#            on both sides, so only the decoder matrices differ); EntroPack's error at its rate is in
#            decode-lossy.sh's GPU peer.
#   Outputs: $OUT/eval.txt (bits a weight of the decoder matrices, perplexity, KL, same top token),
#            compress.txt, rd-*.txt, $OUT.tar.xz.
#   Run:     bash bench/scenarios/lossy-quality.sh [--dry-run | --tiny]   (CPU)
. "$(dirname "$0")/lib.sh"
setup
PARTS=${PARTS:-$([ $TINY = 1 ] && echo model || echo "rd model")}
tokens=${TOKENS:-$([ $TINY = 1 ] && echo 128 || echo 1536)}; text=${TEXT:-/usr/share/common-licenses/GPL-3}
eval_one() { # NAME MODEL
    run "$1-inspect" "$B" inspect "$2" --json
    [ $DRY = 1 ] || el "== $1: $(python3 - "$OUT/$1-inspect.out" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["tensors"]
m = [r for r in t if len(r["shape"]) == 2 and "token_embd" not in r["name"] and "embed_tokens" not in r["name"]]
n = sum(r["numel"] for r in m); b = sum(r["stored_bytes"] for r in m)
print(f"decoder matrices: {len(m)}, {n} weights, {8 * b / n:.3f} bits a weight")
PY
)"
    run "$1-eval" "$B" eval ppl "$2" --reference "$f32" --file "$text" --window 512 --stride 256 \
        --max-tokens "$tokens" --device cpu
    [ $DRY = 1 ] || grep -v "^note:" "$OUT/$1-eval.err" "$OUT/$1-eval.out" 2>/dev/null | tee -a "$OUT/eval.txt" | tail -3 | sed 's/^/  /'
}
for part in $PARTS; do case $part in
rd)
    for src in ${RD_SOURCES:-gauss file:minilm}; do
        run "rd-${src//:/-}" cargo bench --manifest-path "$REPO/Cargo.toml" -p entrollm-codec --bench lossy_rd -- \
            --bits "${RD_BITS:-2,3,4,5,6}" --quantizers "${RD_QUANTIZERS:-int,fp8,tcq32,e8}" \
            --shapes "${RD_SHAPES:-1024x4096}" --sources "$src"
    done ;;
model)
    if [ -n "${F32:-}" ]; then f32=$F32
    elif [ $TINY = 1 ]; then synth_model tiny; f32=${MODEL[0]}
    else
        g=$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1); f32=$W/smol-f32.gguf
        [ $DRY = 0 ] && [ -f "$f32" ] || x python3 "$REPO/tools/gguf_f32_reference.py" "$g" "$f32"
    fi
    if [ $TINY = 1 ]; then
        not_run model-eval "eval ppl --file needs a tokenizer; the tiny model has none"
        specs="int-4=--bits 4 --quantizer int"
    else specs=${SPECS:-tcq32-3=--bits 3;tcq32-4=--bits 4;tcq32-5=--bits 5;e8-4=--bits 4 --quantizer e8;int-4=--bits 4 --quantizer int;fp8-4=--bits 4 --quantizer fp8}; fi
    IFS=';' read -ra specs <<< "$specs"
    for spec in "${specs[@]}"; do
        name=${spec%%=*}; read -ra flags <<< "${spec#*=}"
        run "compress-$name" /usr/bin/time -f "compress $name: %e s, peak RSS %M KB" "$B" compress "$f32" -o "$W/lossy-$name" "${flags[@]}" --overwrite
        [ $DRY = 1 ] || tail -5 "$OUT/compress-$name.err" >> "$OUT/compress.txt"
        [ $TINY = 1 ] || eval_one "$name" "$W/lossy-$name"
    done
    [ $TINY = 1 ] && continue
    if lq=$(llama_bin llama-quantize); then
        for t in ${QUANTS:-Q3_K_M Q4_K_M Q5_K_M}; do
            run "quantize-$t" "$lq" --token-embedding-type f32 --output-tensor-type f32 "$f32" "$W/llama-$t.gguf" "$t" 2
            eval_one "llama.cpp-$t" "$W/llama-$t.gguf"
        done
    else not_run llama.cpp-kquants "no llama-quantize: set LLAMA"; fi
    run chat-tcq32-4 bash -c 'echo "What is the capital of France?" | "$0" chat "$1" --max-tokens 40 --device cpu' "$B" "$W/lossy-tcq32-4" ;;
*) echo "unknown part $part" >&2; exit 2 ;;
esac; done
finish
