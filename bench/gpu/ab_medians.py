#!/usr/bin/env python3
"""Medians per (model, setting) of an ab_env.sh log, and each setting's
ratio to a baseline setting, for decode at each batch size of $BATCHES
(ab_env.sh's, "1,16,64" unless set).

    BATCHES=4,16 python3 bench/gpu/ab_medians.py LOG [BASELINE]

BASELINE is a setting as the log writes it inside [...] ("default" unless
given). Lines: `round R MODEL [SETTING] | bf16 | decode tok/s a batch size
... | pp1 | ppmax |`.
"""
import os
import re
import statistics
import sys

LINE = re.compile(r"^round \d+ (\S+) \[(.*)\] \| \S+\s*\|(.*)$")


def main():
    log, base = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "default"
    batches = os.environ.get("BATCHES", "1,16,64").split(",")
    n = len(batches)
    runs = {}
    for line in open(log):
        m = LINE.match(line.strip())
        if not m:
            continue
        cells = [float(c) for c in m.group(3).split("|") if c.strip()][:n]
        if len(cells) == n:
            runs.setdefault((m.group(1), m.group(2)), []).append(cells)
    for (model, setting), rows in sorted(runs.items()):
        med = [statistics.median(r[i] for r in rows) for i in range(n)]
        ref = runs.get((model, base))
        ratio = ""
        if ref and setting != base:
            ref_med = [statistics.median(r[i] for r in ref) for i in range(n)]
            ratio = "  vs " + base + ": " + " / ".join(f"{a / b:.3f}x" for a, b in zip(med, ref_med))
        print(f"{model:22} [{setting}] n={len(rows)} B={'/'.join(batches)}: "
              + " / ".join(f"{v:.0f}" for v in med) + ratio)


if __name__ == "__main__":
    main()
