#!/usr/bin/env python3
"""Concurrent streaming clients against `entrollm serve` (loopback only; Python's standard library).

    bench/serve-load.py http://127.0.0.1:8080 [--clients 64] [--seconds 120] [--pid PID]

First each prompt's greedy answer is asked for alone (not streamed); then CLIENTS threads stream
the same prompts in turn until SECONDS have passed, each answer compared with its prompt's. Prints
a summary line, then one JSON line: answers, wrong (an answer not its prompt's), failed (an
error, a broken stream, a duplicate id), busy (503s), tok/s, and the server's resident memory
(PID's VmRSS) after the solo answers and after the run.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at",
    "The largest planet in the solar system is",
    "My favourite food is",
    "In 1969, humans",
]
MAX_TOKENS = 12


def request(base, prompt, stream):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        r.read()
        c.close()
        return r.status, None, None
    if not stream:
        v = json.loads(r.read())
        c.close()
        return 200, v["choices"][0]["text"], v["id"]
    text, ident, done = [], None, False
    for line in r:
        line = line.decode().rstrip("\n")
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        v = json.loads(data)
        if "error" in v:
            raise RuntimeError(v["error"]["message"])
        ident = ident or v["id"]
        if v["id"] != ident:
            raise RuntimeError("chunks of two answers in one stream")
        text.extend(ch["text"] for ch in v["choices"])
    c.close()
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return 200, "".join(text), ident


def rss_kb(pid):
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--pid", type=int)
    a = ap.parse_args()
    want = {}
    for p in PROMPTS:
        status, text, _ = request(a.base, p, False)
        assert status == 200, (p, status)
        want[p] = text
    rss_before = rss_kb(a.pid)
    lock = threading.Lock()
    stats = {"answers": 0, "wrong": 0, "failed": 0, "busy": 0, "tokens": 0}
    ids, errors = set(), []
    end = time.time() + a.seconds

    def client(k):
        i = k
        while time.time() < end:
            p = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                status, text, ident = request(a.base, p, True)
            except Exception as e:  # a broken stream or connection
                with lock:
                    stats["failed"] += 1
                    errors.append(repr(e))
                continue
            with lock:
                if status == 503:
                    stats["busy"] += 1
                elif status != 200:
                    stats["failed"] += 1
                    errors.append(f"HTTP {status}")
                elif ident in ids:
                    stats["failed"] += 1
                    errors.append(f"duplicate id {ident}")
                else:
                    ids.add(ident)
                    stats["answers"] += 1
                    stats["tokens"] += MAX_TOKENS
                    if text != want[p]:
                        stats["wrong"] += 1
                        errors.append(f"{p!r}: {text!r} is not {want[p]!r}")

    t0 = time.time()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    stats.update(
        clients=a.clients, seconds=round(wall, 1), tok_s=round(stats["tokens"] / wall, 1),
        rss_kb_before=rss_before, rss_kb_after=rss_kb(a.pid), errors=errors[:5],
    )
    print(f"{a.clients} clients, {wall:.1f} s: {stats['answers']} answers ({stats['tok_s']} tok/s), "
          f"{stats['wrong']} wrong, {stats['failed']} failed, {stats['busy']} busy; "
          f"server RSS {rss_before} -> {stats['rss_kb_after']} kB")
    print(json.dumps(stats))


main()
