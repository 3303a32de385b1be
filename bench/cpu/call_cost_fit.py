"""Per-call fixed cost and marginal rate of single-stream decode's layer
projections, from the forward bench's roofline lines (TANDEM_BENCH_ROOFLINE=1,
one line per run as in bench/cpu/q4_row_no_prefetch_ab_2026-12-06.log): per
run, a least-squares line through the four layer phases (time a call against
MB a call: 30 calls each a pass), split by the run's streaming sum (above 45
GB/s: the host's fast spells). python3 bench/cpu/call_cost_fit.py LOG [TAG]
(TAG: only lines containing it, e.g. ZZ=1)."""
import re
import statistics as st
import sys

fast, slow = [], []
tag = sys.argv[2] if len(sys.argv) > 2 else ""
for line in open(sys.argv[1]):
    m = re.search(r"streaming sum ([\d.]+) GB/s", line)
    if not m or tag not in line:
        continue
    phase = {}
    for name in ["qkv", "o_proj", "gate_up", "down", "lm_head"]:
        p = re.search(name + r" ([\d.]+) ms/step \(\s*[\d.]+ %\), ([\d.]+) MB", line)
        phase[name] = (float(p.group(1)) * 1000, float(p.group(2)))
    pts = [(phase[n][1] / 30, phase[n][0] / 30) for n in ["qkv", "o_proj", "gate_up", "down"]]
    mx = sum(x for x, _ in pts) / 4
    my = sum(y for _, y in pts) / 4
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    lm_ms, lm_mb = phase["lm_head"]
    run = (float(m.group(1)), my - slope * mx, 1000 / slope, lm_mb / lm_ms * 1000)
    (fast if run[0] > 45 else slow).append(run)
for name, runs in (("fast", fast), ("slow", slow)):
    if runs:
        med = [st.median(r[i] for r in runs) for i in range(4)]
        print(f"{name}: {len(runs)} runs, streaming sum {med[0]:.1f} GB/s, fixed {med[1]:.2f} us a call, "
              f"marginal {med[2]:.1f} GB/s, unembedding {med[3]:.1f} GB/s")
