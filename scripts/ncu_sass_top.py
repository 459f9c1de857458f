#!/usr/bin/env python3
"""The hottest SASS instructions of a kernel from Nsight Compute's source page (on the GPU machine):
`ncu --import R.ncu-rep --page source --csv --print-source sass > S.csv; python3 ncu_sass_top.py S.csv`
(the report taken with `--section WarpStateStats --section SourceCounters`): samples and the leading stall
reasons, the 45 instructions with the most samples, and the samples by twentieth of the program."""

import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]
data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
samp = ix["Warp Stall Sampling (All Samples)"]
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
tot = collections.Counter()
alls = 0
good = []
for r in data:
    if len(r) != len(hdr):
        continue
    try:
        s = int(r[samp].replace(",", ""))
    except ValueError:
        continue
    alls += s
    for h in stalls:
        try:
            tot[h] += int(r[ix[h]].replace(",", ""))
        except ValueError:
            pass
    good.append((s, r))
print("samples", alls, "instructions", len(good))
for h, v in tot.most_common(10):
    print(f"  {h:24} {v:8} {100 * v / max(alls, 1):5.1f} %")
good.sort(key=lambda x: -x[0])
for s, r in good[:45]:
    top = sorted(
        ((int(r[ix[h]].replace(",", "") or 0), h) for h in stalls if r[ix[h]].replace(",", "").isdigit()), reverse=True
    )[:2]
    print(f"{s:6} {r[ix['Address']][-5:]} {r[ix['Source']].strip()[:60]:60} {top}")
# cumulative by position (to see phases): samples per 1/20th of the program
n = len(good)
order = sorted(good, key=lambda x: int(x[1][ix["Address"]], 16))
chunk = max(1, n // 20)
print("samples by program twentieth:", [sum(s for s, _ in order[i : i + chunk]) for i in range(0, n, chunk)])
