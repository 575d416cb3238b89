#!/usr/bin/env python3
"""Summarize realistic.py output: per variant and case, the median router CPU per request,
its range over reps, req/s, latency p50 and write syscalls per request (medians).

Usage: summarize.py FILE.jsonl [FILE.jsonl ...]
"""
import json
import statistics
import sys
from collections import defaultdict


def main():
    rows = defaultdict(list)
    order = []
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                key = (r["mode"], r["conc"], r["variant"])
                if key not in rows:
                    order.append(key)
                rows[key].append(r)
    print("| mode | conc | variant | router CPU µs/req (median) | range over reps | reps | "
          "req/s | latency p50 ms | writes/req | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(order, key=lambda k: (k[0], k[1], order.index(k))):
        rs = rows[key]
        cpu = [r["router_cpu_us_per_req"] for r in rs]
        med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(
            x is not None for x in xs) else None
        print(f"| {key[0]} | {key[1]} | {key[2]} | {med(cpu):.0f} | {min(cpu):.0f}–{max(cpu):.0f} | "
              f"{len(rs)} | {med([r['req_per_s'] for r in rs]):.0f} | "
              f"{med([r['lat_p50_ms'] for r in rs])} | {med([r.get('syscw_per_req') for r in rs])} | "
              f"{sum(r['errors'] for r in rs)} |")


if __name__ == "__main__":
    main()
