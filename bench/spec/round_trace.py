#!/usr/bin/env python3
"""Where a draft round's time goes: reads a load-example log run with
RUST_LOG=tandem::engine::drafting=debug,tandem::model=debug on stdin and
prints, per event ("draft round", "head round", "graph replay") and per
value of its flags, the count and the median of every *_us field
(session 35's traces also had "graph pass planned" and "draft rounds
ended", which measured 0.1-1.5 us and were dropped; they are still read)."""
import re
import statistics
import sys
from collections import defaultdict

EVENTS = ("draft round", "head round", "graph replay", "graph pass planned", "draft rounds ended")
FIELD = re.compile(r"(\w+)=([-\d.]+|true|false)")
groups = defaultdict(lambda: defaultdict(list))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
for line in sys.stdin:
    line = ANSI.sub("", line)
    event = next((e for e in EVENTS if f"DEBUG {e} " in line or f": {e} " in line), None)
    if event is None:
        continue
    tail = line.split(event, 1)[1]
    fields = dict(FIELD.findall(tail))
    flags = tuple((k, v) for k, v in fields.items() if not k.endswith("_us") and k != "round")
    if "round" in fields:
        flags = (("round", min(int(fields["round"]), 1)),) + flags
    for k, v in fields.items():
        if k.endswith("_us"):
            groups[(event, flags)][k].append(float(v))
for (event, flags), fields in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
    n = len(next(iter(fields.values())))
    medians = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in fields.items())
    label = " ".join(f"{k}={v}" for k, v in flags)
    print(f"{event:20s} {label:40s} n={n:6d}  {medians}")
