#!/usr/bin/env python3
"""Table of peer_ab.sh output: per mode and router (log_note), router CPU per request at c64
(median, range over reps), req/s, and added latency at c1 (router p50 minus the direct p50 of
the same invocation).

Usage: peer_table.py OUT_DIR
"""
import json
import os
import statistics
import sys
from collections import defaultdict


def main():
    d = sys.argv[1]
    print("| mode | router | CPU µs/req at c64 (median) | range | reps | req/s c64 | "
          "added p50 latency c1 µs (median) |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("stream", "plain"):
        path = os.path.join(d, f"{mode}.jsonl")
        if not os.path.exists(path):
            continue
        rows, direct, order = defaultdict(list), {}, []
        for line in open(path):
            r = json.loads(line)
            if "error" in r:
                continue
            key = (r["date_utc"], r["log_note"])
            if r["router"] == "direct":
                direct[key] = r["lo"]["lat_us"]["p50"]
                continue
            name = r["log_note"]
            if name not in order:
                order.append(name)
            rows[name].append((r["hi"]["router_cpu_us_per_req"], r["hi"]["rps"],
                               r["lo"]["lat_us"]["p50"] - direct.get(key, 0)))
        for name in order:
            cpu = [x[0] for x in rows[name]]
            print(f"| {mode} | {name} | {statistics.median(cpu):.0f} | {min(cpu):.0f}–{max(cpu):.0f} "
                  f"| {len(cpu)} | {statistics.median(x[1] for x in rows[name]):.0f} | "
                  f"{statistics.median(x[2] for x in rows[name]):.0f} |")


if __name__ == "__main__":
    main()
