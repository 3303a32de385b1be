#!/usr/bin/env python3
"""Session 55 (issue 18): how often the target's token was among the head's first 1-4 choices at each
verified draft position, from RUST_LOG=tandem::draft_top=debug (bench/spec/confidence_gate_s55.patch).
python3 bench/spec/draft_top.py TRACE"""
import ast,sys,collections
from trace_lines import matches
steps=[(ast.literal_eval(m.group(1)),[int(x) for x in m.group(3).split(',')],int(m.group(4)))
       for m in matches(sys.argv[1],r"top=(\[\[.*?\]\]) confidence=\[(.*?)\] kept=\[(.*?)\] accepted=(\d+)")]
print(len(steps),"steps")
# hit by rank per position (given prefix accepted)
hits=collections.defaultdict(lambda:[0]*5); tried=collections.Counter()
for top,kept,a in steps:
    for j in range(min(a+1,len(top))):
        t=kept[j]; r=top[j].index(t) if t in top[j] else 4
        hits[j][r]+=1; tried[j]+=1
for j in sorted(tried):
    n=tried[j]; c=0; s=[]
    for r in range(4):
        c+=hits[j][r]; s.append(f"top{r+1} {c/n:.3f}")
    print(f"pos {j}: n={n} "+", ".join(s))
