#!/bin/bash
# Each GGUF's logits on the CPU engine (its quantised blocks, the ggml form) against the engine's
# f32 path over the same weights dequantised by the gguf package (tools/gguf_f32_reference.py):
#   bash bench/cpu-reference-logits.sh ENTROLLM TEXT A.gguf [B.gguf ...]
# One line per file: perplexities, KL divergence, same top token, largest logit difference.
set -euo pipefail
bin=$1; text=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
for g in "$@"; do
    ref="${g%.gguf}.f32-reference.gguf"
    [ -f "$ref" ] || python3 "$here/tools/gguf_f32_reference.py" "$g" "$ref"
    echo "== $(basename "$g"): $(python3 -c "
import gguf,collections,sys
r=gguf.GGUFReader(sys.argv[1]); print(dict(collections.Counter(t.tensor_type.name for t in r.tensors)))" "$g")"
    "$bin" eval ppl "$g" --reference "$ref" --file "$text" --window 128 --stride 64 --max-tokens 512 --device cpu -t 2 2>&1 | grep -v "^note:"
done
