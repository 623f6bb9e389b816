#!/usr/bin/env python3
"""Reference tokenizations and chat renderings for crates/model/tests/tokenizer*.rs and chat*.rs,
recorded with implementations independent of ours:

  * llama.cpp's own tokenizer (llama-cpp-python, `Llama(vocab_only=True).tokenize(special=True)`),
    the authority for GGUF vocabularies, when `llama_cpp` is installed; the script checks that it
    agrees with the reference below wherever both apply.
  * Hugging Face `tokenizers` (Python) assembled the way the original tokenizer.json files are
    (SmolLM2: Digits(individual) + ByteLevel; Llama 3 / Qwen2: Split(regex) + ByteLevel), from the
    vocabulary and merges read with gguf-py.
  * sentencepiece for the SentencePiece test vocabulary.
  * transformers' `render_jinja_template` (jinja2, as `apply_chat_template` runs it) for templates.

    python3 -m pip install gguf==0.19.0 tokenizers==0.23.3 sentencepiece==0.2.3 transformers==5.24.0 jinja2
    python3 -m pip install llama-cpp-python   # optional, builds llama.cpp
    python3 tools/gen_tokenizer_testdata.py "$(scripts/fetch-smollm2 | tail -n1)"

Writes into crates/model/tests/data/:
  tok_smollm2_ref.json        SmolLM2-135M-Instruct GGUF vocabulary: ids and decoded text of tricky
                              strings, and chat template renderings
  tok_gpt2_tiny.gguf          a small byte-level BPE vocabulary (trained here) as GGUF metadata
  tok_gpt2_tiny/              the same tokenizer as tokenizer.json + tokenizer_config.json
  tok_gpt2_tiny_ref.json      its reference ids under several `tokenizer.ggml.pre` values
  tok_spm_tiny.gguf           a small SentencePiece BPE vocabulary (trained here) as GGUF metadata
  tok_spm_tiny_ref.json       its reference ids
"""

import json
import os
import sys
import tempfile

import gguf
import numpy as np
import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.utils.chat_template_utils import render_jinja_template

try:
    import llama_cpp
except ImportError:  # the HF / sentencepiece references still apply
    llama_cpp = None

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "model", "tests", "data")

# Strings that exercise pre-tokenizers: spaces, newlines, digits, unicode, emoji, specials.
TEXTS = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "  two leading spaces and trailing   ",
    "line1\nline2\n\n\nline3\r\nline4",
    "tabs\tand\t\tspaces    mixed \t\n end",
    "numbers 1 12 123 1234 12345 3.14159 -42 1,000,000",
    "unicode: café naïve résumé Ünïcödé ß",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    'code: fn main() { println!("hi {}", x[0]); } // done',
    "contractions: don't I'm we're they've you'll he'd it's DON'T WE'LL",
    "URL: https://example.com/path?q=1&x=2#frag",
    "mixedCASE camelCaseIdentifiers snake_case_names SCREAMING_CASE",
    "nbsp\u00a0and zero\u200bwidth and em—dash",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "",
    " ",
    "\n",
    "   \n\n  ",
]

# Texts with the SmolLM2 / tiny-vocabulary special tokens in them.
SMOLLM2_SPECIAL_TEXTS = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special<|endoftext|>inside<|im_end|>text",
    "<|im_start|><|im_end|>",
    "not special: <|im_start and |im_end|>",
]

CONVERSATIONS = [
    ([{"role": "system", "content": "You are a concise assistant."},
      {"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "user", "content": "Hi there!"}], True),
    ([{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Name a colour."},
      {"role": "assistant", "content": "Blue."},
      {"role": "user", "content": "Another one, with ünïcödé and\nnewlines."}], False),
]

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (pre-tokenizer as in the model's tokenizer.json, ignore_merges)
PRE_TOKENIZERS = {
    "llama-bpe": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), True),
    "qwen2": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False),
    "smollm": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False),
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
}

CORPUS = """The quick brown fox jumps over the lazy dog. Hello world, hello there!
It's a truth universally acknowledged that we're all learning; they've said you'll see.
Numbers like 1, 12, 123, 2024 and 3.14159 appear in text; so do dates such as 2026-11-29.
def main():\n    print("hello")\n    return 0\n
Café, naïve, résumé and Ünïcödé are words with accents. 日本語 and 中文 are scripts too.
    Indented lines, tabs\tand multiple   spaces matter for tokenizers.
Emoji 😀 and 👍 show up in chats. URLs: https://example.com/path?q=1&x=2.
The model answered: "Paris is the capital of France." The user said thanks.
camelCase snake_case SCREAMING_CASE kebab-case identifiers are common in code.
"""


def gguf_tokenizer_fields(path):
    r = gguf.GGUFReader(path)
    f = r.fields
    tokens = [str(t) for t in f["tokenizer.ggml.tokens"].contents()]
    merges = [str(m) for m in f["tokenizer.ggml.merges"].contents()] if "tokenizer.ggml.merges" in f else None
    types = list(f["tokenizer.ggml.token_type"].contents()) if "tokenizer.ggml.token_type" in f else None
    template = f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else None
    return tokens, merges, types, template, r


def hf_bpe(tokens, merges, types, pre, ignore_merges):
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok


def llama_cpp_ids(path, text):
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def check_llama_cpp(path, records, label):
    """Adds llama.cpp's ids to each record and reports disagreements with the HF reference."""
    if llama_cpp is None:
        print(f"{label}: llama_cpp not installed, no llama.cpp cross-check", file=sys.stderr)
        return
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    bad = 0
    for rec in records:
        ids = llm.tokenize(rec["text"].encode("utf-8"), add_bos=False, special=True)
        if ids != rec["ids"]:
            bad += 1
            print(f"{label}: llama.cpp differs on {rec['text']!r}:\n  ref {rec['ids']}\n  cpp {ids}", file=sys.stderr)
            rec["llama_cpp_ids"] = ids
    print(f"{label}: llama.cpp agrees on {len(records) - bad}/{len(records)} texts", file=sys.stderr)


def write_json(name, obj):
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


def smollm2(path):
    tokens, merges, types, template, _ = gguf_tokenizer_fields(path)
    pre, ignore = PRE_TOKENIZERS["smollm"]
    tok = hf_bpe(tokens, merges, types, pre(), ignore)
    records = []
    for text in TEXTS + SMOLLM2_SPECIAL_TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        records.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    check_llama_cpp(path, records, "smollm2")
    chats = []
    for messages, gen in CONVERSATIONS:
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=gen, bos_token=tokens[1], eos_token=tokens[2])
        chats.append({"messages": messages, "add_generation_prompt": gen, "rendered": rendered[0]})
    write_json("tok_smollm2_ref.json", {"source": os.path.basename(path), "texts": records, "chats": chats})


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|eot_id|>"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama_hparams(w):
    """Minimal llama hyperparameters so llama.cpp loads a vocabulary-only file."""
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)


def tiny_gpt2():
    pre, _ = PRE_TOKENIZERS["llama-bpe"]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]

    path = os.path.join(OUT, "tok_gpt2_tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    llama_hparams(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|end_of_text|>"))
    w.add_eot_token_id(tokens.index("<|eot_id|>"))
    w.add_add_bos_token(True)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)

    texts = TEXTS + ["<|begin_of_text|>Hello<|eot_id|> world<|end_of_text|>"]
    refs = {}
    for name, (make_pre, ignore) in PRE_TOKENIZERS.items():
        ref = hf_bpe(tokens, merges, types, make_pre(), ignore)
        refs[name] = [{"text": t, "ids": ref.encode(t, add_special_tokens=False).ids} for t in texts]
    # llama.cpp reads this file with pre "llama-bpe".
    check_llama_cpp(path, refs["llama-bpe"], "tiny gpt2 (llama-bpe)")

    # The same tokenizer as tokenizer.json + tokenizer_config.json, with BOS added on encode.
    full = hf_bpe(tokens, merges, types, PRE_TOKENIZERS["llama-bpe"][0](), True)
    from tokenizers import processors
    full.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tokens.index("<|begin_of_text|>"))])
    d = os.path.join(OUT, "tok_gpt2_tiny")
    os.makedirs(d, exist_ok=True)
    full.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>",
                   "eos_token": {"content": "<|eot_id|>", "special": True},
                   "chat_template": TINY_CHAT_TEMPLATE}, f, indent=1)
    with_bos = [{"text": t, "ids": full.encode(t, add_special_tokens=True).ids} for t in texts]
    chats = []
    for messages, gen in CONVERSATIONS:
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=TINY_CHAT_TEMPLATE,
                                            add_generation_prompt=gen, bos_token="<|begin_of_text|>",
                                            eos_token="<|eot_id|>")
        chats.append({"messages": messages, "add_generation_prompt": gen, "rendered": rendered[0]})
    write_json("tok_gpt2_tiny_ref.json", {"by_pre": refs, "with_bos": with_bos, "chats": chats})


def tiny_spm():
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write(CORPUS * 3)
        prefix = os.path.join(tmp, "spm")
        spm.SentencePieceTrainer.train(
            input=corpus, model_prefix=prefix, model_type="bpe", vocab_size=400, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            character_coverage=1.0, num_threads=1, user_defined_symbols=["<|user|>"], minloglevel=2,
            bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif tokens[-1] == "<|user|>":
            types.append(4)
        else:
            types.append(1)
    path = os.path.join(OUT, "tok_spm_tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    llama_hparams(w)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([float(s) for s in scores])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)
    # Plain texts: sentencepiece, cross-checked with llama.cpp.
    records = [{"text": t, "ids": sp.encode(t)} for t in TEXTS if t.strip()]
    check_llama_cpp(path, records, "tiny spm")
    # Special and user-defined tokens in the text: llama.cpp only. It matches them before
    # SentencePiece sees the text and puts a space prefix after each, which sentencepiece itself
    # (a user-defined piece inside the normalized text) does not do.
    special = []
    if llama_cpp is not None:
        for t in ["<|user|>hello <|user|> x", "a</s>b<s> c", "<unk>x"]:
            special.append({"text": t, "ids": llama_cpp_ids(path, t)})
    write_json("tok_spm_tiny_ref.json", {"texts": records, "special_texts_llama_cpp": special})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    os.makedirs(OUT, exist_ok=True)
    smollm2(sys.argv[1])
    tiny_gpt2()
    tiny_spm()
