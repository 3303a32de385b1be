# Ratio table of bench/cpu/isa_sitting.sh's logs: Tandem / llama.cpp decode
# tokens/s at B = 1, 4, 16, 64 and prompt processing (each engine's best
# over the batch sizes), per shape, ISA and format.
#   python3 bench/cpu/isa_table.py OUT_DIR/*.log
import re, sys

rows = {}
for path in sys.argv[1:]:
    engine = key = None
    for line in open(path):
        m = re.match(r"=== (\S+) (\S+) (\S+): (Tandem|llama\.cpp)", line)
        if m:
            key, engine = m.groups()[:3], m.group(4)
            rows.setdefault(key, {})
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if engine == "Tandem" and cells[0] in ("as-stored", "f16", "f32"):
            v = [float(c) for c in cells[1:]]
            rows[key]["tandem"] = (v[:4], max(v[4:]))
        elif engine == "llama.cpp" and len(cells) == 10 and cells[0].isdigit():
            d = rows[key].setdefault("llama", ({}, 0.0))
            d[0][int(cells[2])] = float(cells[7])
            rows[key]["llama"] = (d[0], max(d[1], float(cells[5])))
        m = re.search(r"tok/s = [\d.]+ GB/s: ([\d.]+) % of the roofline", line)
        if m and engine == "Tandem":
            rows[key]["roofline"] = float(m.group(1))

print("| shape | ISA | format | Tandem B=1/4/16/64, pp | llama.cpp B=1/4/16/64, pp | ratio B=1 | B=4 | B=16 | B=64 | pp | roofline B=1 |")
print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
order = {"f32": 0, "f16": 1, "Q8_0": 2, "Q4_1": 3, "Q4_K_M": 4}
for key in sorted(rows, key=lambda k: (k[0], k[1], order.get(k[2], 9))):
    r = rows[key]
    if "tandem" not in r or "llama" not in r:
        print(f"| {' | '.join(key)} | incomplete |")
        continue
    (t, tp), (l, lp) = r["tandem"], r["llama"]
    lv = [l[b] for b in (1, 4, 16, 64)]
    ratios = [a / b for a, b in zip(t, lv)] + [tp / lp]
    cell = lambda x: f"**{x:.2f}**" if x < 1.0 else f"{x:.2f}"
    roof = f"{r['roofline']:.0f} %" if "roofline" in r else ""
    print(f"| {key[0]} | {key[1]} | {key[2]} | {'/'.join(f'{x:.0f}' for x in t)}, {tp:.0f} | "
          f"{'/'.join(f'{x:.0f}' for x in lv)}, {lp:.0f} | {' | '.join(cell(x) for x in ratios)} | {roof} |")
