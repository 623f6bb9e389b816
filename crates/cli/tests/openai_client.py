"""The official `openai` Python client against `entrollm serve` (run by tests/serve.rs).

argv: BASE_URL. Checks what one client can check by itself (streamed equals whole, stop and
max_tokens honoured, errors raised as the client's exceptions) and prints one JSON object of what
the Rust test compares with the CPU engine and `entrollm run`/`chat`.
"""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=300)
model = client.models.list().data[0].id
out = {"model": model}

question = [{"role": "user", "content": "What is the capital of France?"}]
chat = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
out["chat"] = chat.choices[0].message.content
out["chat_finish"] = chat.choices[0].finish_reason
assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0, chat.usage

pieces, usage, finish = [], None, None
for c in client.chat.completions.create(
    model=model, messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if c.usage is not None:
        usage = c.usage
    for ch in c.choices:
        if ch.delta.content:
            pieces.append(ch.delta.content)
        finish = ch.finish_reason or finish
assert "".join(pieces) == out["chat"], (pieces, out["chat"])
assert finish == out["chat_finish"], finish
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
out["chat_stream_pieces"] = len(pieces)

prompt = "The capital of France is"
text = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
out["completion"] = text.choices[0].text
assert text.choices[0].finish_reason == "length", text.choices[0].finish_reason
assert text.usage.completion_tokens == 16, text.usage
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    if c.choices
)
assert streamed == out["completion"], (streamed, out["completion"])

# A stop string that begins inside the greedy answer ends it just before, streamed or not.
full = out["completion"]
stop = full[len(full) // 2 : len(full) // 2 + 3]
cut = full[: full.index(stop)]
for stream in (False, True):
    if stream:
        got = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True
            )
            if c.choices
        )
    else:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        got = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
    assert got == cut, (stream, stop, got, cut)
out["stop"] = stop

r = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", r

lp = client.chat.completions.create(
    model=model, messages=question, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
)
out["chat_logprobs"] = [
    {"token": t.token, "logprob": t.logprob, "top": [[a.token, a.logprob] for a in t.top_logprobs]}
    for t in lp.choices[0].logprobs.content
]
lp = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
out["completion_logprobs"] = lp.choices[0].logprobs.token_logprobs
out["completion_tokens"] = lp.choices[0].logprobs.tokens

# Seeded sampling is reproducible through the client.
a, b = (
    client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=7).choices[0].text
    for _ in range(2)
)
assert a == b, (a, b)

for bad, param in ((dict(n=2), "n"), (dict(temperature=-1), "temperature")):
    try:
        client.chat.completions.create(model=model, messages=question, max_tokens=2, **bad)
        raise AssertionError(f"{bad} was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == param, e.body

print(json.dumps(out))
