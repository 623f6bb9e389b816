#!/usr/bin/env python3
"""Reference renderings of the model families' real chat templates, for
crates/model/tests/chat_templates.rs (`every_family_template_renders_like_transformers`).

Each template in crates/model/tests/data/chat_templates/ (copied from llama.cpp's
models/templates/ and tests/test-chat-template.cpp; see the README there) is rendered by Hugging
Face transformers exactly as a model's tokenizer renders it: a `PreTrainedTokenizerFast` (built
from a tiny tokenizer.json; the vocabulary does not matter to the text) with `chat_template=` and
the model's real special-token strings, then
`tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`. A chat the
template refuses (`raise_exception`, e.g. Gemma's "System role not supported") is recorded with
the message transformers raises instead of a rendering.

`strftime_now` is pinned to FIXED_NOW (UTC) while rendering, and the JSON records it; the Rust test
maps the date entrollm renders (its real clock) onto that one.

    HF_HUB_OFFLINE=1 /root/.cache/entrollm-dev/venv/bin/python tools/gen_chat_template_refs.py

(transformers 5.25, jinja2 3.1.6; no torch or network needed.) Writes
crates/model/tests/data/chat_template_refs.json:
  {"transformers": version, "jinja2": version, "fixed_now": unix seconds,
   "templates": [{"file", "families", "bos_token", "eos_token", "strftime_formats",
                  "chats": [{"messages", "add_generation_prompt", "rendered" | "error"}]}],
   "probe_messages": [...], "probes": [{"template", "rendered"}]}
The probes are small templates checking what every template sees (tools/documents, tojson, Python
value printing, string methods, loop controls, namespace), rendered with bos "<s>", eos "</s>".
"""

import datetime as dt
import json
import os
import re
import sys

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "crates", "model", "tests", "data")
TEMPLATES = os.path.join(DATA, "chat_templates")
TOKENIZER = os.path.join(DATA, "families", "qwen3", "tokenizer.json")

# 2025-03-14 09:26:53 UTC: not a date any template hard-codes (Llama 3.1's is 26 Jul 2024).
FIXED_NOW = 1741944413

# template file -> (entrollm families it is the real template of, bos_token, eos_token); the tokens
# are the strings the model's tokenizer_config.json gives (None: the model has none).
TEMPLATE_SPECS = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": (["llama"], "<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (["llama"], "<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": (["mistral", "mixtral"], "<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": (["mistral"], "<s>", "</s>"),
    "mistralai-v1-Mistral-7B-Instruct-v0.2.jinja": (["mistral", "mixtral"], "<s>", "</s>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": (["qwen2"], None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": (["qwen3", "qwen3_moe"], None, "<|im_end|>"),
    "google-gemma-2-2b-it.jinja": (["gemma2", "gemma3"], "<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": (["phi3"], "<s>", "<|endoftext|>"),
    "openai-gpt-oss-120b.jinja": (["gpt_oss"], "<|startoftext|>", "<|return|>"),
}


def sys_(c):
    return {"role": "system", "content": c}


def user(c):
    return {"role": "user", "content": c}


def asst(c):
    return {"role": "assistant", "content": c}


def tool(c):
    return {"role": "tool", "content": c}


WEATHER = '{"temp_c": 21, "sky": "<sunny> & \'warm\' — très beau", "path": "C:\\\\x"}'


# Every chat is rendered with and without add_generation_prompt.
CHATS = [
    [user("What is the capital of France?")],
    [sys_("You are a concise assistant."), user("What is the capital of France?")],
    [user("Name a colour."), asst("Blue."), user("Another one?")],
    [sys_("Be brief."), user("Name a colour."), asst("Blue."), user("Another one?")],
    [user("Name a colour."), asst("Blue.")],
    [user("Grüße aus Köln — ünïcödé, 日本語のテキスト, emoji 😀👍🏽 and\nnewlines\n\nhere.")],
    [sys_("Réponds en français, s'il te plaît. ✨"), user("Ça va ? 你好"), asst("Très bien, merci ! 😊"),
     user("Et toi ?")],
    [user("  leading and trailing spaces  "), asst("\n  Blue, with spaces around.  \n\n"),
     user("\tTabbed\t")],
    [user("Think first."), asst("<think>\nSome reasoning.\n</think>\n\nThe answer."), user("Again?")],
    # Tool results as plain string content (templates without tool support skip or refuse them).
    [user("Weather in Paris?"), tool(WEATHER)],
    [user("Weather in Paris?"), asst("Checking."), tool(WEATHER), tool("second result"), asst("21 °C.")],
]

# Small templates that probe what every template sees (tools/documents defined as None, Python
# value printing, transformers' tojson, string methods), rendered over PROBE_MESSAGES.
PROBE_MESSAGES = [user(" hé llo "), asst("ok")]
PROBES = [
    "{{ tools is defined }}|{{ tools is none }}|{{ documents is none }}|{{ tools }}|{{ bos_token }}{{ eos_token }}",
    "{{ true }}|{{ none }}|{{ 'a' ~ true }}|{{ messages[0] }}|{{ messages[1].items()|list }}",
    "{{ messages|tojson }}|{{ {'b': 1, 'a': [1, 2.5, 'x<y>&\\'z\\\\'], 'c': none, 'd': true}|tojson }}",
    "{{ {'b': 1, 'a': [1, {}], 'c': []}|tojson(indent=2) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
    "{{ 'ünï\\n\\t\\x01\\x7f😀'|tojson }}|{{ 'ünï😀'|tojson(ensure_ascii=true) }}|{{ [1, {'a': 2}]|tojson(separators=(',', ':')) }}",
    "{{ messages[0].content.split() }}|{{ messages[0].nope is defined }}|{{ messages[0].content|trim }}|"
    "{{ messages[0].content.strip() }}|{{ ' x '.lstrip() }}|{{ 'a,b'.split(',') }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}",
    "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% break %}{% endfor %}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "|{{ messages[::-1]|map(attribute='role')|join(',') }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
]


class FixedDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return dt.datetime.fromtimestamp(FIXED_NOW, tz=tz or dt.timezone.utc).replace(tzinfo=tz)


def render_all(file, families, bos, eos):
    with open(os.path.join(TEMPLATES, file), encoding="utf-8") as f:
        template = f.read()
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, chat_template=template, **specials)
    chats = []
    for messages in CHATS:
        for gen in (True, False):
            rec = {"messages": messages, "add_generation_prompt": gen}
            try:
                rec["rendered"] = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            except jinja2.exceptions.TemplateError as e:
                rec["error"] = str(e)
            chats.append(rec)
    ok = sum("rendered" in c for c in chats)
    print(f"{file}: {ok}/{len(chats)} chats render, {len(chats) - ok} raise", file=sys.stderr)
    formats = sorted(set(re.findall(r"""strftime_now\(\s*["']([^"']*)["']""", template)))
    return {"file": file, "families": families, "bos_token": bos, "eos_token": eos,
            "strftime_formats": formats, "chats": chats}


def render_probes():
    probes = []
    for template in PROBES:
        tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, chat_template=template, bos_token="<s>",
                                      eos_token="</s>")
        probes.append({"template": template, "rendered": tok.apply_chat_template(PROBE_MESSAGES, tokenize=False)})
    return probes


def main():
    chat_template_utils.datetime = FixedDatetime  # what transformers' strftime_now calls
    out = {
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "fixed_now": FIXED_NOW,
        "templates": [render_all(f, *spec) for f, spec in TEMPLATE_SPECS.items()],
        "probe_messages": PROBE_MESSAGES,
        "probes": render_probes(),
    }
    path = os.path.join(DATA, "chat_template_refs.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
