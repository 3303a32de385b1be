#!/usr/bin/env python3
"""Medians of a bench/cpu/roofline_ab.sh log, per binary and format.

Slow-bus runs (streaming sum under 40 GB/s on the 2-core EPYC) are
summarised apart: the fast-bus spells move the roofline, not the kernels.
Usage: python3 bench/cpu/roofline_ab.py LOG [SLOW_GBPS]"""
import re, statistics as st, sys
from collections import defaultdict

slow_below = float(sys.argv[2]) if len(sys.argv) > 2 else 40.0
runs = defaultdict(list)  # (bin, fmt) -> [(round, gbps, tok, roof, att)]
key, order = None, []
for line in open(sys.argv[1]):
    m = re.match(r'# BINS="([^"]*)"', line)
    if m:
        order = [b.split("=", 1)[0] for b in m[1].split()]
        continue
    m = re.match(r"=== round (\d+) (\S+) (\S+)", line)
    if m:
        key, rnd = (m[2], m[3]), int(m[1])
        continue
    m = re.search(r"streaming sum ([\d.]+) GB/s, decode (\d+) tok/s.*: ([\d.]+) % of the roofline", line)
    if m and key:
        runs[key].append([rnd, float(m[1]), int(m[2]), float(m[3]), None])
    m = re.search(r"attention\s+([\d.]+) ms", line)
    if m and key and runs[key]:
        runs[key][-1][4] = float(m[1])
med = lambda xs: st.median(xs) if xs else float("nan")
for (b, f), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    slow = [r for r in rs if r[1] < slow_below]
    print(f"{f:10} {b:8} runs {len(rs):2} (slow {len(slow):2}): tok/s med {med([r[2] for r in rs]):.0f}"
          f" (slow {med([r[2] for r in slow]):.0f}), roofline slow med {med([r[3] for r in slow]):.1f} %"
          f" [{min((r[3] for r in slow), default=float('nan')):.1f}-{max((r[3] for r in slow), default=float('nan')):.1f}],"
          f" attention med {med([r[4] for r in rs]):.3f} ms (slow {med([r[4] for r in slow]):.3f})")
# Pairwise, per round: each binary against the first one BINS names.
bins = order or sorted({b for b, _ in runs})
for f in sorted({f for _, f in runs}):
    names = [b for b in bins if (b, f) in runs]
    for other in names[1:]:
        a = {r[0]: r for r in runs[(names[0], f)]}
        c = {r[0]: r for r in runs[(other, f)]}
        common = sorted(set(a) & set(c))
        faster = sum(c[r][2] > a[r][2] for r in common)
        lower = sum(c[r][4] < a[r][4] for r in common)
        ratio = med([c[r][2] / a[r][2] for r in common])
        print(f"{f:10} {other} vs {names[0]}: faster in {faster} of {len(common)} rounds, attention lower in {lower}, tok/s ratio med {ratio:.3f}")
