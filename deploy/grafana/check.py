#!/usr/bin/env python3
"""Checks that every metric the Grafana dashboard references is one the router exports.

  deploy/grafana/check.py --kvrouter KVROUTER [--dashboard deploy/grafana/kvrouter.json]

Starts `KVROUTER serve --mock-workers 2 --port 0`, sends a few requests (streamed and not),
scrapes /metrics, and checks that each metric name in a panel query (`expr`) is a family on the
page (`# TYPE`), a histogram's `_bucket`/`_sum`/`_count` counting as its family. Exits 1 naming
the panel and the metric. `--self-test` also checks that a dashboard naming a metric the router
does not export is refused (so the check itself cannot pass vacuously). Standard library only.
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
NAME = re.compile(r"\bkvrouter_[a-zA-Z0-9_:]+")
SUFFIXES = ("_bucket", "_sum", "_count")


def scrape(binary):
    """The router's /metrics page after a few requests."""
    proc = subprocess.Popen(
        [binary, "serve", "--mock-workers", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        base = next((w for w in line.split() if w.startswith("http://")), None)
        if base is None:
            raise SystemExit(f"no address on the router's first line: {line!r}")
        for stream in (False, True, False):
            body = {"model": "mock-model", "prompt": "hello dashboard", "max_tokens": 4,
                    "stream": stream}
            req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            return r.read().decode()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def families(page):
    """Metric family name -> type, from the `# TYPE` lines."""
    out = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            out[name] = kind
    return out


def exported(name, fams):
    if name in fams:
        return True
    for s in SUFFIXES:
        if name.endswith(s) and fams.get(name[: -len(s)]) == "histogram":
            return True
    return False


def problems(dashboard, fams):
    """(panel title, metric) for each referenced metric not exported; also panels without queries."""
    out = []
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if not exprs:
            out.append((panel["title"], "(no query)"))
        for expr in exprs:
            for name in NAME.findall(expr):
                if not exported(name, fams):
                    out.append((panel["title"], name))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvrouter", required=True)
    ap.add_argument("--dashboard", default=str(HERE / "kvrouter.json"))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    dashboard = json.loads(pathlib.Path(args.dashboard).read_text())
    fams = families(scrape(args.kvrouter))
    if not fams:
        raise SystemExit("the router's /metrics page has no metric families")
    bad = problems(dashboard, fams)
    names = {n for p in dashboard["panels"] for t in p.get("targets", []) for n in NAME.findall(t["expr"])}
    if args.self_test:
        broken = json.loads(json.dumps(dashboard))
        broken["panels"][0]["targets"][0]["expr"] = "rate(kvrouter_not_a_metric_total[5m])"
        if ("%s" % broken["panels"][0]["title"], "kvrouter_not_a_metric_total") not in problems(broken, fams):
            raise SystemExit("self-test: a dashboard naming an unknown metric was not refused")
        if not names:
            raise SystemExit("self-test: the dashboard names no kvrouter_ metric")
    for title, name in bad:
        print(f"panel {title!r}: {name} is not exported by the router", file=sys.stderr)
    if bad:
        sys.exit(1)
    print(f"dashboard: {len(dashboard['panels'])} panels, {len(names)} metrics, all exported")


if __name__ == "__main__":
    main()
