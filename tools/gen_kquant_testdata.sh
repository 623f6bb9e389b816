#!/usr/bin/env bash
# Makes crates/model/tests/data/gguf_kquants.gguf: a one-layer Qwen2 (tools/gen_qwen2_gguf.py
# --tiny, F32) quantised by llama.cpp's own llama-quantize, one ggml type a matrix, so that the
# k-quant, IQ4 and legacy readers are tested on what the reference quantiser writes.
#
#   tools/gen_kquant_testdata.sh LLAMA_BIN_DIR
set -euo pipefail
bin=${1:?usage: $0 LLAMA_BIN_DIR (holding llama-quantize)}
root=$(cd "$(dirname "$0")/.." && pwd)
data=$root/crates/model/tests/data
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$root/tools/gen_qwen2_gguf.py" --tiny --tokenizer-from "$data/tok_gpt2_tiny.gguf" \
    -o "$tmp/f32.gguf"
"$bin/llama-quantize" \
    --token-embedding-type q8_0 --output-tensor-type q4_k \
    --tensor-type attn_q=q2_k --tensor-type attn_k=q3_k --tensor-type attn_v=q4_k \
    --tensor-type attn_output=q5_k --tensor-type ffn_gate=q6_k --tensor-type ffn_up=iq4_nl \
    --tensor-type ffn_down=iq4_xs \
    "$tmp/f32.gguf" "$data/gguf_kquants.gguf" Q4_K_M 1
