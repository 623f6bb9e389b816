#!/usr/bin/env python3
"""Reference greedy generations of SmolLM2-135M-Instruct (GGUF) from Hugging Face transformers.

Loads the GGUF with transformers on the CPU in float32 (transformers dequantises the Q4_1 weights
and un-permutes the llama Q/K rows), runs greedy decoding on fixed prompts, raw and chat-formatted
with the GGUF's chat template, and writes for each prompt: the prompt token ids, the generated ids,
and the top logits at every step (step 0 = after the prompt, step s = after generated token s-1).
`crates/model/tests/engine_vs_transformers.rs` replays the ids through the entrollm engine and
compares.

Needs: torch, transformers, gguf, accelerate (pip install torch transformers gguf accelerate).
    scripts/fetch-smollm2            # puts the GGUF into ~/.cache/entrollm/smollm2/
    python3 tools/compare_transformers.py
"""

import argparse
import json
import os
import sys

DEFAULT_GGUF = os.path.join(
    os.environ.get("ENTROLLM_CACHE", os.path.expanduser("~/.cache/entrollm")),
    "smollm2",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
DEFAULT_OUT = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
        "crates",
        "model",
        "tests",
        "data",
        "smollm2_transformers.json",
    )
)

# (name, text, chat): chat prompts go through the GGUF chat template with a generation prompt.
PROMPTS = [
    ("raw_capital", "The capital of France is", False),
    ("raw_story", "Once upon a time, in a small village by the sea,", False),
    ("raw_code", "def fibonacci(n):\n", False),
    ("chat_capital", "What is the capital of France?", True),
    ("chat_haiku", "Write a haiku about the ocean.", True),
    ("chat_explain", "Explain in one sentence what a neural network is.", True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the GGUF file (default: %(default)s)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON to write (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--top", type=int, default=20, help="logits recorded per step (the largest)")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(args.gguf):
        sys.exit(f"{args.gguf}: no such file (run scripts/fetch-smollm2 first)")
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    directory, name = os.path.split(os.path.abspath(args.gguf))
    # transformers >= 4.56 calls the dtype argument `dtype`, earlier versions `torch_dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, **{dtype_arg: torch.float32})
    model.eval()
    if tokenizer.chat_template is None:
        sys.exit(f"{args.gguf}: transformers found no chat template in the GGUF")

    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])
    eos_ids.add(tokenizer.eos_token_id)

    cases = []
    for case_name, text, chat in PROMPTS:
        if chat:
            prompt_text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        else:
            prompt_text = text
            prompt_ids = tokenizer(text)["input_ids"]
        generated, steps = [], []
        past = None
        ids = torch.tensor([prompt_ids])
        for _ in range(args.new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            top = torch.topk(logits, args.top)
            steps.append({"top_ids": top.indices.tolist(), "top_logits": top.values.tolist()})
            token = int(torch.argmax(logits))
            generated.append(token)
            if token in eos_ids:
                break
            ids = torch.tensor([[token]])
        cases.append(
            {
                "name": case_name,
                "chat": chat,
                "prompt": prompt_text,
                "prompt_ids": prompt_ids,
                "generated_ids": generated,
                "generated_text": tokenizer.decode(generated),
                "steps": steps,
            }
        )
        print(f"{case_name}: {len(prompt_ids)} prompt tokens -> {tokenizer.decode(generated)!r}", file=sys.stderr)

    result = {
        "model": "SmolLM2-135M-Instruct",
        "gguf_file": name,
        "gguf_bytes": os.path.getsize(args.gguf),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "new_tokens": args.new_tokens,
        "top": args.top,
        "eos_token_ids": sorted(eos_ids),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
