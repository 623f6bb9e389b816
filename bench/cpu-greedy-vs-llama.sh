#!/bin/bash
# Greedy text of entrollm and llama.cpp on the same GGUF files and prompts (CPU):
#   bash bench/cpu-greedy-vs-llama.sh ENTROLLM LLAMA_CPP_SRC TOKENS A.gguf[:A2.gguf] [B.gguf ...]
# (A:A2: entrollm runs A, llama.cpp A2, e.g. a quantised file and its F32 dequantisation by
# `llama-quantize --allow-requantize A A2 F32`, which llama.cpp multiplies in f32 as entrollm's f32
# activations multiply A.)
# llama.cpp's side is its examples/simple/simple.cpp (greedy sampler, the prompt tokenized with its
# special tokens) built against LLAMA_CPP_SRC/build's libraries, with `use_extra_bufts` off: on a
# CPU with AMX, ggml's AMX repack of the weights faults in a prompt's batched product on VMs that
# advertise AMX without enabling its tile state. Both print the prompt and its continuation; the
# lines are compared as text. LLAMA_KV=F32: llama.cpp's KV cache in f32 and flash attention off
# (its defaults: F16, flash attention on), as entrollm keeps it. The prompt is printed without its
# special tokens (a BOS that Gemma adds would otherwise lead llama.cpp's text), as `entrollm run`
# prints it. ENTROLLM_ARGS: more flags for `entrollm run` (e.g. "--activations q8").
set -euo pipefail
bin=$1; src=$2; n=$3; shift 3
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
sed -e 's/llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true)/llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, false)/' \
    -e 's/model_params.n_gpu_layers = ngl;/model_params.n_gpu_layers = ngl; model_params.use_extra_bufts = false;/' \
    -e "s/ctx_params.no_perf = false;/ctx_params.no_perf = false; ${LLAMA_KV:+ctx_params.type_k = ctx_params.type_v = GGML_TYPE_$LLAMA_KV; ctx_params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;}/" \
    -e 's|new_token_id = llama_sampler_sample(smpl, ctx, -1);|&\n{ const float * lg = llama_get_logits_ith(ctx, -1); int nv = llama_vocab_n_tokens(vocab); float a = -1e30f, b = -1e30f; for (int k = 0; k < nv; k++) { if (lg[k] > a) { b = a; a = lg[k]; } else if (lg[k] > b) b = lg[k]; } char pc[128]; int pn = llama_token_to_piece(vocab, new_token_id, pc, sizeof(pc), 0, true), nl = 0; for (int k = 0; k < pn; k++) nl += pc[k] != 10; fprintf(stderr, "GAP %d %g %d\\n", new_token_id, a - b, nl); }|' \
    "$src/examples/simple/simple.cpp" > "$w/greedy.cpp"
grep -q use_extra_bufts "$w/greedy.cpp" && grep -q "buf, sizeof(buf), 0, false)" "$w/greedy.cpp" ||
    { echo "simple.cpp changed: the patch did not apply" >&2; exit 1; }
[ -z "${LLAMA_KV:-}" ] || grep -q type_k "$w/greedy.cpp" || { echo "simple.cpp changed: the KV patch did not apply" >&2; exit 1; }
g++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" "$w/greedy.cpp" -o "$w/greedy" \
    -L"$src/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$src/build/bin"
echo "date $(date -u +%FT%TZ); $(lscpu | grep -m1 'Model name'); entrollm args: ${ENTROLLM_ARGS:-none}; llama.cpp KV: ${LLAMA_KV:-default}; $n tokens"
same=0; all=0
for pair in "$@"; do
    g=${pair%%:*}; h=${pair#*:}; label=$(basename "$g"); [ "$h" = "$g" ] || label="$label / $(basename "$h")"
    while IFS= read -r p; do
        theirs=$("$w/greedy" -m "$h" -n "$n" "$p" 2>"$w/err" | tr -d '\n')
        ours="$p$("$bin" run "$g" --device cpu -q -n "$n" --prompt "$p" ${ENTROLLM_ARGS:-} 2>/dev/null | tr -d '\n')"
        all=$((all + 1))
        if [ "$theirs" = "$ours" ]; then same=$((same + 1)); echo "same  $label | $ours"
        else
            # The generated token where the texts part, and llama.cpp's logit gap between its
            # first and second choice there (a near-tie where small); the texts are compared
            # without their newlines, which the pieces' lengths leave out too.
            at=$(python3 -c 'import os,sys
a,b,p=sys.argv[1:4]; i=next((k for k in range(min(len(a),len(b))) if a[k]!=b[k]),min(len(a),len(b)))
pos=len(p.encode()); tok=0
for l in open(sys.argv[4]):
    if l.startswith("GAP "):
        _,t,gap,n=l.split(); 
        if pos+int(n)>len(a[:i].encode()): print("token %d, llama.cpp logit gap %s"%(tok,gap)); break
        pos+=int(n); tok+=1' "$theirs" "$ours" "$p" "$w/err")
            echo "DIFF  $label at $at"; echo "  llama.cpp: $theirs"; echo "  entrollm:  $ours"
        fi
    done <<'PROMPTS'
The history of the city begins
Once upon a time
The capital of France is
def fibonacci(n):
In 1905, Albert Einstein published
PROMPTS
done
echo "identical: $same of $all"
