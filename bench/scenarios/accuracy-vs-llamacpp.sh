#!/usr/bin/env bash
# Scenario accuracy-vs-llamacpp: the same GGUF files' outputs in entrollm and in llama.cpp (CPU).
# PARTS (default "greedy logits"):
#   greedy  greedy text of each file on five prompts, TOKENS each (default 32), entrollm `run`
#           beside llama.cpp's examples/simple/simple.cpp (greedy sampler, built here against
#           LLAMA_SRC/build's libraries, patched: `use_extra_bufts` off — ggml's AMX repack faults
#           on VMs that advertise AMX without its tile state — pieces printed without special
#           tokens, and its top-2 logit gap printed at each token); where the texts part, the token
#           and llama.cpp's gap there (a near-tie where small). PAIRS: A.gguf[:A2.gguf] ... (entrollm
#           runs A, llama.cpp A2, e.g. A's F32 dequantisation by `llama-quantize
#           --allow-requantize A A2 F32`); LLAMA_KV=F32: llama.cpp's KV cache in f32 and flash
#           attention off, as entrollm keeps it; ENTROLLM_ARGS: more `run` flags ("--activations q8")
#   logits  each file's logits (its quantised blocks, the ggml form) against the engine's f32 path
#           over the same weights dequantised by the gguf package (tools/gguf_f32_reference.py):
#           perplexities, KL divergence, same top token, on TEXT (default GPL-3), 512 tokens
#   Inputs:  FILES (GGUF paths; default SmolLM2 Q4_1 from scripts/fetch-smollm2), LLAMA_SRC (a
#            llama.cpp source tree built in LLAMA_SRC/build; greedy only).
#   Peers:   llama.cpp's greedy text (greedy); the gguf package's dequantisation (logits).
#   Outputs: $OUT/log ("same"/"DIFF" a prompt, "identical: N of M"; one eval line a file), $OUT.tar.xz.
#   Run:     LLAMA_SRC=DIR bash bench/scenarios/accuracy-vs-llamacpp.sh [--dry-run]   (CPU)
. "$(dirname "$0")/lib.sh"
setup
PARTS=${PARTS:-greedy logits}; n=${TOKENS:-32}
files=${FILES:-$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1)}
[ $TINY = 1 ] && { not_run "$SCEN" "needs real GGUF files and llama.cpp; no tiny mode"; finish; exit 0; }
prompts=("The history of the city begins" "Once upon a time" "The capital of France is" "def fibonacci(n):" "In 1905, Albert Einstein published")
greedy() {
    [ -n "${LLAMA_SRC:-}" ] || { not_run greedy "set LLAMA_SRC to a built llama.cpp tree"; return; }
    local src=$LLAMA_SRC g=$W/greedy.cpp
    if [ $DRY = 1 ]; then echo "+ sed (patch) $src/examples/simple/simple.cpp > $g; g++ … -o $W/greedy"; else
    sed -e 's/llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true)/llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, false)/' \
        -e 's/model_params.n_gpu_layers = ngl;/model_params.n_gpu_layers = ngl; model_params.use_extra_bufts = false;/' \
        -e "s/ctx_params.no_perf = false;/ctx_params.no_perf = false; ${LLAMA_KV:+ctx_params.type_k = ctx_params.type_v = GGML_TYPE_$LLAMA_KV; ctx_params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;}/" \
        -e 's|new_token_id = llama_sampler_sample(smpl, ctx, -1);|&\n{ const float * lg = llama_get_logits_ith(ctx, -1); int nv = llama_vocab_n_tokens(vocab); float a = -1e30f, b = -1e30f; for (int k = 0; k < nv; k++) { if (lg[k] > a) { b = a; a = lg[k]; } else if (lg[k] > b) b = lg[k]; } char pc[128]; int pn = llama_token_to_piece(vocab, new_token_id, pc, sizeof(pc), 0, true), nl = 0; for (int k = 0; k < pn; k++) nl += pc[k] != 10; fprintf(stderr, "GAP %d %g %d\\n", new_token_id, a - b, nl); }|' \
        "$src/examples/simple/simple.cpp" > "$g"
    grep -q use_extra_bufts "$g" && grep -q "buf, sizeof(buf), 0, false)" "$g" ||
        { echo "simple.cpp changed: the patch did not apply" >&2; exit 1; }
    [ -z "${LLAMA_KV:-}" ] || grep -q type_k "$g" || { echo "simple.cpp changed: the KV patch did not apply" >&2; exit 1; }
    g++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" "$g" -o "$W/greedy" \
        -L"$src/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$src/build/bin"
    fi
    local same=0 all=0 pair h label p theirs ours at
    for pair in ${PAIRS:-$files}; do
        g=${pair%%:*}; h=${pair#*:}; label=$(basename "$g"); [ "$h" = "$g" ] || label="$label / $(basename "$h")"
        for p in "${prompts[@]}"; do
            if [ $DRY = 1 ]; then x "$W/greedy" -m "$h" -n "$n" "$p"; x "$B" run "$g" --device cpu -q -n "$n" --prompt "$p" ${ENTROLLM_ARGS:-}; continue; fi
            theirs=$("$W/greedy" -m "$h" -n "$n" "$p" 2>"$W/err" | tr -d '\n')
            ours="$p$("$B" run "$g" --device cpu -q -n "$n" --prompt "$p" ${ENTROLLM_ARGS:-} 2>/dev/null | tr -d '\n')"
            all=$((all + 1))
            if [ "$theirs" = "$ours" ]; then same=$((same + 1)); el "same  $label | $ours"
            else
                # The generated token where the texts part, and llama.cpp's logit gap between its
                # first and second choice there (the texts compared without their newlines).
                at=$(python3 - "$theirs" "$ours" "$p" "$W/err" <<'PY'
import sys
a, b, p = sys.argv[1:4]
i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
pos = len(p.encode())
tok = 0
for line in open(sys.argv[4]):
    if line.startswith("GAP "):
        _, t, gap, n = line.split()
        if pos + int(n) > len(a[:i].encode()):
            print("token %d, llama.cpp logit gap %s" % (tok, gap))
            break
        pos += int(n)
        tok += 1
PY
)
                el "DIFF  $label at $at"; el "  llama.cpp: $theirs"; el "  entrollm:  $ours"
            fi
        done
    done
    [ $DRY = 1 ] || el "identical: $same of $all (entrollm args: ${ENTROLLM_ARGS:-none}; llama.cpp KV: ${LLAMA_KV:-default}; $n tokens)"
}
logits() {
    local g ref
    for g in $files; do
        ref=$W/$(basename "${g%.gguf}").f32-reference.gguf
        [ $DRY = 0 ] && [ -f "$ref" ] || x python3 "$REPO/tools/gguf_f32_reference.py" "$g" "$ref"
        run "logits-$(basename "$g" .gguf)" "$B" eval ppl "$g" --reference "$ref" --file "${TEXT:-/usr/share/common-licenses/GPL-3}" \
            --window 128 --stride 64 --max-tokens 512 --device cpu -t 2
        [ $DRY = 1 ] || el "$(basename "$g"): $(grep -hv '^note:' "$OUT/logits-$(basename "$g" .gguf)".{out,err} | tail -2 | tr '\n' ' ')"
    done
}
for part in $PARTS; do "$part"; done
finish
