#!/usr/bin/env python3
"""Summarises a decode-step trace (`ENTROLLM_TRACE=FILE entrollm bench ...`, a diagnostic build:
thread 0 of every block records when it reached pdl_wait and when the wait returned).

Kernel launches are told apart by their launch shape (grid, threads) and by time: the blocks of one
launch are released together, launches of the same shape lie microseconds apart. For each launch in
step order it prints when its first block was released (the previous launch had ended), the time to
the next launch's release (this launch's critical path after its wait, plus the hand-over), and how
many of its blocks arrived at the wait only after the release began (their prologue — table fill,
first loads — was on the critical path). Then the same figures per position in the layer, averaged
over the layers.

    python3 bench/trace-summary.py FILE [STEP] [--layer-period N]

(STEP: 0, 1 or 2, default 1; --layer-period N: also the means per position in a layer of N
launches — 7 for the palette-packed FP8 decode step. A launch of more blocks than fit at once is
released in waves and may be counted as several launches.)
"""
import csv
import sys
from collections import defaultdict


def launches(rows, gap_ns=4000):
    by_shape = defaultdict(list)
    for r in rows:
        by_shape[(r["gx"], r["gy"], r["threads"])].append(r)
    out = []
    for shape, rs in by_shape.items():
        rs.sort(key=lambda r: r["released_ns"])
        cur = [rs[0]]
        for r in rs[1:]:
            if r["released_ns"] - cur[-1]["released_ns"] > gap_ns or any(
                (c["bx"], c["by"]) == (r["bx"], r["by"]) for c in cur
            ):
                out.append((shape, cur))
                cur = [r]
            else:
                cur.append(r)
        out.append((shape, cur))
    out.sort(key=lambda x: min(r["released_ns"] for r in x[1]))
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    period = None
    if "--layer-period" in sys.argv:
        period = int(sys.argv[sys.argv.index("--layer-period") + 1])
        args = [a for a in args if a != str(period)]
    path = args[0]
    step = int(args[1]) if len(args) > 1 else 1
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            r = {k: int(v) for k, v in r.items()}
            if r["step"] == step:
                rows.append(r)
    ls = launches(rows)
    t0 = min(r["released_ns"] for _, rs in ls for r in rs)
    table = []
    for i, (shape, rs) in enumerate(ls):
        rel = min(r["released_ns"] for r in rs)
        rel_max = max(r["released_ns"] for r in rs)
        arr_min = min(r["arrived_ns"] for r in rs)
        late = sum(1 for r in rs if r["arrived_ns"] > rel + 200)
        nxt = min(r["released_ns"] for r in ls[i + 1][1]) if i + 1 < len(ls) else None
        table.append((shape, len(rs), rel - t0, rel_max - rel, rel - arr_min, late, (nxt - rel) if nxt else None))
    print(f"step {step}: {len(ls)} launches, {len(rows)} blocks, "
          f"{(max(r['released_ns'] for r in rows) - t0) / 1e3:.1f} us from the first release to the last")
    print("  #  grid        thr  blocks  release_us  spread_us  early_us  late  to_next_us")
    for i, (shape, n, rel, spread, early, late, nxt) in enumerate(table):
        print(f"{i:3d}  {shape[0]:5d}x{shape[1]:<4d} {shape[2]:4d}  {n:6d}  {rel / 1e3:10.2f}  {spread / 1e3:9.2f}  "
              f"{early / 1e3:8.2f}  {late:4d}  {'' if nxt is None else f'{nxt / 1e3:10.2f}'}")
    if period:
        # The layers: from the first launch where the launch shapes repeat with this period.
        shapes = [t[0] for t in table]
        start = next((i for i in range(len(shapes) - 2 * period)
                      if shapes[i:i + period] == shapes[i + period:i + 2 * period]), None)
        if start is None:
            print(f"no run of launches repeats with period {period}")
            return
        layers = []
        i = start
        while i + period <= len(table) and shapes[i:i + period] == shapes[start:start + period]:
            layers.append(table[i:i + period])
            i += period
        print(f"per position in a layer ({len(layers)} layers of {period} launches from launch {start}; means):")
        for j in range(period):
            col = [layer[j] for layer in layers]
            mean = lambda k: sum(x[k] for x in col if x[k] is not None) / len(col) / 1e3
            shape = col[0][0]
            print(f"  {j}: {shape[0]}x{shape[1]}/{shape[2]}  to_next {mean(6):6.2f} us  early {mean(4):6.2f} us  "
                  f"late blocks {sum(x[5] for x in col) / len(col):5.1f} of {col[0][1]}")

if __name__ == "__main__":
    main()
