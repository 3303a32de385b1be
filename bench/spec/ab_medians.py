"""Medians of alternating --mtp-compare runs: for each "## ... (dtype X|streams N[ chat|useless]) build NAME"
header, the "aggregate" lines alternate off, on; a "########## PART" line keeps a combined log's parts apart. Prints median off, median on, their ratio and the median drafted tokens.
Usage: python3 bench/spec/ab_medians.py LOG..."""
import re,sys,statistics as st
from collections import defaultdict
res=defaultdict(lambda: {'off':[], 'on':[], 'drafted':[]})
for f in sys.argv[1:]:
    key=None; i=0; part=''
    for line in open(f):
        if line.startswith('########## '):
            part=line.split()[1]
        elif line.startswith('## '):
            m=re.search(r'(dtype \S+|streams \d+( chat| useless)?) build (\S+)',line)
            if m:
                key=(part,m.group(1),m.group(3)); i=0
        elif line.startswith('aggregate'):
            v=float(re.search(r'= ([\d.]+) tokens/s',line).group(1))
            res[key]['off' if i%2==0 else 'on'].append(v); i+=1
        elif line.startswith('MTP:'):
            res[key]['drafted'].append(int(line.split()[1]))
for k,v in sorted(res.items()):
    off,on=v['off'],v['on']
    print(k, 'n=%d off med %.1f on med %.1f ratio %.3f  drafted med %s' % (len(on), st.median(off), st.median(on), st.median(on)/st.median(off), st.median(v['drafted']) if v['drafted'] else '-'))
