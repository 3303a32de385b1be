#!/usr/bin/env python3
"""Session 55 (issue 18): a head's draft confidence against verification, from a trace of
RUST_LOG=tandem::draft_calibration=debug (bench/spec/confidence_gate_s55.patch; four drafts every step).
Prints acceptance by confidence bin, then replays the steps under fixed draft lengths and
confidence thresholds with the step costs set below (not measured by this script).
python3 bench/spec/draft_confidence.py TRACE"""
import sys
from trace_lines import matches
rows=[([float(x) for x in m.group(1).split(',')],int(m.group(2)))
      for m in matches(sys.argv[1],r"confidence\S*=\S*\[([^\]]*)\].*accepted=(\d+)")]
print(len(rows),"steps")
bins=[0,.1,.2,.3,.4,.5,.6,.7,.8,.9,.95,1.01]
def b(x):
    for i in range(len(bins)-1):
        if x<bins[i+1]: return i
# conditional acceptance by confidence bin, position-pooled and by position
import collections
cnt=collections.defaultdict(lambda:[0,0])
for c,a in rows:
    for j,x in enumerate(c):
        if j>a: break
        acc = 1 if j<a else 0
        k=(min(j,2),b(x)); cnt[k][0]+=acc; cnt[k][1]+=1
        k=('all',b(x)); cnt[k][0]+=acc; cnt[k][1]+=1
for pos in ['all',0,1,2]:
    print("pos",pos, " ".join(f"[{bins[i]:.2f}:{cnt[(pos,i)][0]}/{cnt[(pos,i)][1]}={cnt[(pos,i)][0]/max(1,cnt[(pos,i)][1]):.2f}]" for i in range(len(bins)-1) if cnt[(pos,i)][1]))
# cumulative product calibration: bin by product of confidences
cc=collections.defaultdict(lambda:[0,0])
for c,a in rows:
    p=1
    for j,x in enumerate(c):
        p*=x
        acc=1 if j<a else 0
        cc[b(p)][0]+=acc; cc[b(p)][1]+=1
print("cum", " ".join(f"[{bins[i]:.2f}:{cc[i][0]}/{cc[i][1]}={cc[i][0]/max(1,cc[i][1]):.2f}]" for i in range(len(bins)-1) if cc[i][1]))

# --- replay: the steps that drafted all four (room ends some runs early) ---
rows=[(c,a) for c,a in rows if len(c)>=4]
def run(V, rnd, policy):
    tok=cost=0
    for c,a in rows:
        k,rounds=policy(c)
        tok+=1+min(k,a); cost+=V[k]+rnd*rounds
    return tok/cost
for name,V,rnd in [("q8",[1,1.13,1.25,1.37,1.5],0.08),("f32",[1,1.10,1.17,1.23,1.3],0.035),("gpu",[1,1.05,1.07,1.09,1.11],0.10)]:
    print(name)
    for k in range(0,5):
        print(f"  fixed {k}: {run(V,rnd,lambda c:(k,k)):.3f}")
    best=None
    for th in [0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]:
        def pol(c,th=th):
            p=1;k=0
            for j,x in enumerate(c):
                p*=min(1,x*1.1)
                if p<th: return k, j+1
                k=j+1
            return k,len(c)
        r=run(V,rnd,pol); print(f"  cum>={th}: {r:.3f}")
print("two thresholds")
for name,V,rnd in [("q8",[1,1.13,1.25,1.37,1.5],0.08),("f32",[1,1.10,1.17,1.23,1.3],0.035),("gpu",[1,1.05,1.07,1.09,1.11],0.10)]:
    res=[]
    for keep in [0.05,0.1,0.15,0.2,0.3]:
        for go in [0.0,0.2,0.3,0.4,0.5,0.6,0.7]:
            def pol(c,keep=keep,go=go):
                p=1;k=0;rounds=0
                for j,x in enumerate(c):
                    rounds=j+1
                    p*=min(1,x*1.1)
                    if p>=keep: k=j+1
                    else: break
                    if p<go: break
                return k,rounds
            res.append((run(V,rnd,pol),keep,go))
    res.sort(reverse=True); print(name, res[:4])
