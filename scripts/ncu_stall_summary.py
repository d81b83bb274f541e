"""Where a kernel's warps stall, by SASS instruction, from an Nsight Compute report's source page:

    ncu --section WarpStateStats --section SourceCounters -k regex:NAME -o rep BINARY ...
    ncu -i rep.ncu-rep --page source --print-source sass --csv > src.csv
    python scripts/ncu_stall_summary.py src.csv [TOP]

Prints the stall-sampling columns summed over the kernel (by reason), the samples by opcode, and
the TOP instructions with the most samples (address, share, times executed, SASS, their three
largest reasons). The times executed tell the roles of a warp-specialised kernel apart (a producer
warp's instructions run a fraction as often as the consumers'). Used for RESULTS.md's session
twenty-seventh (the backward's consumers waiting for their stage).
"""

import csv
import re
import sys
from collections import Counter


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    with open(sys.argv[1], errors="replace") as source_page:
        rows = list(csv.reader(source_page))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    header_at = next((i for i, r in enumerate(rows) if any(c.strip().startswith("Source") for c in r)), None)
    if header_at is None:
        sys.exit(f"{sys.argv[1]}: no source-page header (a 'Source' column)")
    header = [c.strip() for c in rows[header_at]]
    body = [r for r in rows[header_at + 1:] if len(r) == len(header)]
    col = {h: i for i, h in enumerate(header)}
    samples = next((h for h in header if "Warp Stall Sampling (All" in h), None)
    if samples is None:
        sys.exit("no 'Warp Stall Sampling (All Samples)' column: was SourceCounters collected?")
    source = next(h for h in header if h.startswith("Source"))
    address = next((h for h in header if "Address" in h), header[0])
    executed = col.get("Instructions Executed")
    total = sum(number(r[col[samples]]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples")

    # Per-reason columns, each also given for not-issued samples only (skipped).
    reasons = [h for h in header
               if re.search(r"stall", h, re.I) and h != samples and not re.search(r"not[- ]issued", h, re.I)]
    if reasons:
        print("by reason:")
        sums = sorted(((sum(number(r[col[h]]) for r in body), h) for h in reasons), reverse=True)
        for value, name in sums[:20]:
            if value:
                print(f"  {value:10.0f} {100 * value / total:5.1f}%  {name}")
    by_opcode = Counter()
    for r in body:
        words = [w for w in r[col[source]].split() if not w.startswith("@")]
        by_opcode[words[0] if words else "?"] += number(r[col[samples]])
    print("by opcode:")
    for opcode, value in by_opcode.most_common(20):
        print(f"  {value:10.0f} {100 * value / total:5.1f}%  {opcode}")
    print(f"top {top} instructions (in program order):")
    chosen = sorted(range(len(body)), key=lambda i: -number(body[i][col[samples]]))[:top]
    for i in sorted(chosen):
        r = body[i]
        value = number(r[col[samples]])
        runs = f" x{number(r[executed]):.0f}" if executed is not None else ""
        why = sorted(((number(r[col[h]]), h) for h in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{h.split('_', 1)[-1]}:{v:.0f}" for v, h in why if v)
        print(f"  #{i:5d} {r[col[address]]:>8} {value:8.0f} {100 * value / total:5.1f}%{runs}  "
              f"{r[col[source]].strip()[:90]}  [{why_text}]")


if __name__ == "__main__":
    main()
