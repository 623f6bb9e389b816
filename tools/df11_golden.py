#!/usr/bin/env python3
"""Golden data for the DFloat11-layout coder (crates/codec/src/df11): runs DFloat11 0.5.0's own
`get_codec`, `get_32bit_codec`, `get_luts` and `encode_weights` (dfloat11_utils.py, unmodified) on
small deterministic inputs and writes their outputs to crates/codec/tests/data/df11_golden.json.

Needs numpy, tqdm and the dahuffman 0.4.2 wheel (pip install /work/shared/wheels/dahuffman-*.whl).
torch is replaced by a minimal numpy-backed stand-in providing only what those functions touch
(tensor views/casts, unique, cat, cumsum, from_numpy), so no 200 MB torch install is needed; the
reference code path itself runs as shipped.

Inputs come from integer-only generators (splitmix64) that the Rust test reproduces exactly:
  geometric: per weight r = next(); sign = r >> 63; mantissa = (r >> 48) & 0x7F;
             exponent = base - trailing_zeros(r | 1 << cap)
  histogram: the listed exponents repeated by count, Fisher-Yates shuffled (j = next() % (i + 1),
             i from the end), then `tail` appended; then per weight r = next() gives sign and
             mantissa as above.

usage: python3 tools/df11_golden.py [--wheel-dir DIR] [--out PATH]
"""
import argparse
import ast
import base64
import contextlib
import importlib.util
import io
import json
import os
import sys
import types
import zipfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------- torch stand-in
class FakeTensor(np.ndarray):
    """numpy array with the few torch.Tensor methods dfloat11_utils calls."""

    def to(self, dtype):
        return self.astype(dtype).view(FakeTensor)

    def numel(self):
        return self.size


def install_fake_torch():
    torch = types.ModuleType("torch")
    torch.int16 = np.int16
    torch.uint8 = np.uint8
    torch.from_numpy = lambda a: np.asarray(a).view(FakeTensor)
    torch.unique = lambda x, return_counts=False: np.unique(np.asarray(x), return_counts=return_counts)
    torch.cat = lambda xs: np.concatenate([np.asarray(x) for x in xs]).view(FakeTensor)
    torch.cumsum = lambda x, dim: np.cumsum(np.asarray(x), axis=dim).view(FakeTensor)
    torch.LongTensor = lambda xs: np.array(xs, dtype=np.int64).view(FakeTensor)
    sys.modules["torch"] = torch


def load_dfloat11(wheel_dir):
    """Import dfloat11_utils from the wheel and read the kernel constants from dfloat11.py."""
    wheel = os.path.join(wheel_dir, "dfloat11-0.5.0-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        utils_src = z.read("dfloat11/dfloat11_utils.py")
        main_src = z.read("dfloat11/dfloat11.py").decode()
    spec = importlib.util.spec_from_loader("dfloat11_utils", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(utils_src, wheel + "!/dfloat11/dfloat11_utils.py", "exec"), mod.__dict__)
    consts = {}
    for node in ast.parse(main_src).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("bytes_per_thread", "threads_per_block"):
                consts[node.targets[0].id] = ast.literal_eval(node.value)
    return mod, consts["bytes_per_thread"], consts["threads_per_block"][0]


# ---------------------------------------------------------------- deterministic inputs
class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def trailing_zeros(x):
    return (x & -x).bit_length() - 1


def sign_mantissa_bits(r):
    return ((r >> 63) << 15) | ((r >> 48) & 0x7F)


def generate(spec):
    rng = SplitMix64(spec["seed"])
    if spec["kind"] == "geometric":
        out = []
        for _ in range(spec["n"]):
            r = rng.next()
            e = spec["base"] - trailing_zeros(r | (1 << spec["cap"]))
            out.append(sign_mantissa_bits(r) | (e << 7))
        return np.array(out, dtype=np.uint16)
    if spec["kind"] == "histogram":
        exps = [e for e, c in spec["counts"] for _ in range(c)]
        for i in range(len(exps) - 1, 0, -1):
            j = rng.next() % (i + 1)
            exps[i], exps[j] = exps[j], exps[i]
        exps += spec.get("tail", [])
        return np.array([sign_mantissa_bits(rng.next()) | (e << 7) for e in exps], dtype=np.uint16)
    raise ValueError(spec["kind"])


# ---------------------------------------------------------------- running the reference
def b64(a):
    return base64.b64encode(np.asarray(a, dtype=np.uint8).tobytes()).decode()


def code_rows(table):
    """[symbol (-1 = EOF), bits, value] in the table's own order."""
    return [[k if isinstance(k, int) else -1, b, v] for k, (b, v) in table.items()]


def quiet(f, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return f(*args)


def run_encode(D, bpt, tpb, spec):
    w = generate(spec).view(FakeTensor)
    weight = w.view(np.int16).view(FakeTensor)
    case = {"input": spec, "n": int(w.size)}
    try:
        _, counter = D.get_codec(weight)
        codec, _, table = quiet(D.get_32bit_codec, counter)
        luts = quiet(D.get_luts, table)
        encoded, other, output_positions, gaps, _ = quiet(D.encode_weights, [weight], codec, bpt, tpb)
    except Exception as e:  # the reference's own failure, recorded for the Rust test
        case["reference_error"] = f"{type(e).__name__}: {e}"
        return case
    case.update(
        code=code_rows(table),
        luts=b64(luts),
        encoded_exponent=b64(encoded),
        gaps=b64(gaps),
        output_positions=[int(x) for x in output_positions],
    )
    return case


def run_code(D, counts):
    counter = {e: c for e, c in counts}
    case = {"counts": counts}
    _, _, table = quiet(D.get_32bit_codec, counter)
    case.update(code=code_rows(table), luts=b64(quiet(D.get_luts, table)))
    return case


def fibonacci(k):
    f = [1, 1]
    while len(f) < k:
        f.append(f[-1] + f[-2])
    return f


def no_eof_edge_spec(D):
    """A histogram input whose code bits T are a multiple of 8 just past one block (32768 bits), with
    its last, long code starting inside block 0: no EOF, and no code starts in block 1 (DFloat11
    then writes only one output position for two blocks)."""
    base = [[118, 11000], [119, 4800], [120, 2000], [121, 700], [122, 150], [123, 30], [124, 6],
            [125, 2], [126, 1], [127, 1]]
    for extra in range(0, 4000):
        counts = [list(x) for x in base]
        counts[0][1] += extra
        table = D.HuffmanCodec.from_frequencies(dict(counts)).get_code_table()
        total = sum(table[e][0] * c for e, c in counts)
        last = table[127][0]
        if total % 8 == 0 and 32768 < total and total - last < 32768:
            # the single 127 (a 9-bit code) goes last, unshuffled
            return {"kind": "histogram", "seed": 11, "counts": counts[:-1], "tail": [127]}
    raise RuntimeError("no edge case found")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel-dir", default="/work/shared/wheels")
    ap.add_argument("--out", default=os.path.join(REPO, "crates/codec/tests/data/df11_golden.json"))
    args = ap.parse_args()
    install_fake_torch()
    D, bpt, tpb = load_dfloat11(args.wheel_dir)

    # EOF plus Fibonacci counts 1, 2, 3, 5, ... make a chain-shaped tree (each merged node stays
    # lighter than the next-but-one count), so 25 counts give 25-bit codes and four LUT levels.
    chain = fibonacci(26)[1:]
    encode_specs = [
        {"kind": "geometric", "seed": 1, "n": 3000, "base": 124, "cap": 20},
        {"kind": "geometric", "seed": 2, "n": 20011, "base": 126, "cap": 30},
        {"kind": "geometric", "seed": 3, "n": 30011, "base": 122, "cap": 40},
        {"kind": "histogram", "seed": 4, "counts": [[100 + i, c] for i, c in enumerate(reversed(chain))]},
        no_eof_edge_spec(D),
        # DFloat11 cannot code these (recorded as reference errors): one exponent; EOF code all zeros.
        {"kind": "histogram", "seed": 5, "counts": [[120, 37]]},
        {"kind": "histogram", "seed": 6, "counts": [[5, 2], [9, 4]]},
    ]
    encode_cases = [run_encode(D, bpt, tpb, s) for s in encode_specs]

    # Code construction only (histograms too large to expand): the 32-bit limit and deep LUTs.
    # Fibonacci counts have no tie at the k-th smallest count beyond the first two 1s, so
    # np.argpartition's unspecified tie order cannot change the result.
    fib40 = fibonacci(40)
    code_cases = [
        run_code(D, [[80 + i, c] for i, c in enumerate(fib40)]),
        run_code(D, [[60 + i, c] for i, c in enumerate(reversed(fibonacci(34)))]),
        # An LLM-like histogram: exponent counts of 10^9 N(0, 0.02^2) weights.
        run_code(D, llm_like_counts()),
    ]
    golden = {
        "source": "dfloat11 0.5.0 dfloat11_utils (get_codec, get_32bit_codec, get_luts, encode_weights), "
        "dahuffman 0.4.2; made by tools/df11_golden.py",
        "bytes_per_thread": bpt,
        "threads_per_block": tpb,
        "encode_cases": encode_cases,
        "code_cases": code_cases,
    }
    with open(args.out, "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    for c in encode_cases + code_cases:
        longest = max((b for _, b, _ in c.get("code", [])), default=0)
        print(c.get("input", {}).get("kind", "code only"), c.get("n", ""), c.get("reference_error", "ok"),
              f"longest code {longest} bits, {len(base64.b64decode(c.get('luts', ''))) // 256} LUT rows")
    print("wrote", args.out, os.path.getsize(args.out), "bytes")


def llm_like_counts():
    """Expected exponent counts of 10^9 weights ~ N(0, 0.02^2), in integers (deterministic)."""
    from math import erf, sqrt

    n, sigma = 10**9, 0.02
    counts = []
    for e in range(1, 127):
        lo, hi = 2.0 ** (e - 127), 2.0 ** (e - 126)
        p = erf(hi / (sigma * sqrt(2))) - erf(lo / (sigma * sqrt(2)))
        c = int(round(p * n))
        if c > 0:
            counts.append([e, c])
    return counts


if __name__ == "__main__":
    main()
