#!/usr/bin/env python3
"""Soak: does a long-running `kvrouter serve` keep its memory and descriptors bounded?

Stack: `kvrouter serve` (default flags, `cost` mode) in front of 4 separate `kvrouter
mock-engine` processes (`--speedup-ratio 1000`, KV events over ZMQ, a small KV pool so blocks
are evicted and the index churns), all on 127.0.0.1.

Traffic: a closed loop of C asyncio clients (stdlib only, raw HTTP/1.1) mixing what production
sends and what it should not, with ids that never repeat, so any per-key state that is kept
for good shows as growth:
  - streamed and non-streamed completions and chats over 2,000 prompt families (a shared
    prefix and a fresh tail), each with a fresh `x-session-id` (or one of a churning pool),
    an RL group id (`x-kvrouter-group-id`) and an `x-request-id`;
  - streams the client drops after the first chunk;
  - picks (`POST /v1/pick`) answered with `finish`, and picks never reported (their lease,
    `--pick-lease-secs 2` here, must release them);
  - bad requests: unknown model names (all different), broken JSON, a missing prompt;
  - worker churn through the admin API: every `--churn-s` seconds a fifth engine is registered
    (with its KV events) and the one registered before removed, each time under a new worker
    id; and a registration of an address that accepts and never answers, given up by the
    client after 0.5 s (the router must not keep a half-registered worker).

With `--replicas N` it runs N routers syncing over a `nats-server` it starts (clients spread
over them, each keeping its router; the churn goes to every router).

Every `--sample-s` seconds it records, for each router and engine, VmRSS, open file
descriptors and threads from /proc, and the size of the router's /metrics. The report gives
each process's RSS after warm-up (the first quarter), at the middle and at the end, and the
least-squares slope over the second half (KiB per minute): a bounded process levels off, a
leak keeps climbing. `--max-slope-kib-min` turns the report into a check (exit 1 above it).

Bounded: `--minutes` of traffic, at most `--max-requests`, every process stopped by its PID.
Example (repo root, after `cargo build --release -p kvrouter`):
  python3 bench/soak/soak.py --bin target/release/kvrouter --minutes 10 --out /tmp/soak
"""
import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "overhead"))
from realistic import HOST, Procs, free_port, log, read_response, wait_ready, write_tokenizer  # noqa: E402

VOCAB = 32000
FAMILIES = 2000
PREFIX_TOKENS = 96
TAIL_TOKENS = 32
SESSION_POOL = 500
ADMIN_TOKEN = "soak-admin-token"


def proc_stats(pid):
    """VmRSS KiB, open descriptors and threads of a process (None once it is gone)."""
    try:
        rss = threads = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"rss_kib": rss, "fds": fds, "threads": threads}
    except OSError:
        return None


def metrics_size(port):
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as r:
            body = r.read()
        workers = {line.split(b'worker="')[1].split(b'"')[0]
                   for line in body.split(b"\n") if b'worker="' in line}
        return {"metrics_bytes": len(body), "metrics_lines": body.count(b"\n"),
                "metrics_worker_ids": len(workers)}
    except OSError:
        return {"metrics_bytes": None, "metrics_lines": None, "metrics_worker_ids": None}


def wait_port(port, timeout_s=20):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            socket.create_connection((HOST, port), 1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def slope_per_min(points):
    """Least-squares slope of (t seconds, y) points, per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (y - my) for t, y in points) / var


class Traffic:
    """The request mix; counts what each kind got back."""

    def __init__(self, port, seed):
        self.port = port
        self.rng = random.Random(seed)
        self.families = [" ".join(f"t{self.rng.randrange(VOCAB - 3)}" for _ in range(PREFIX_TOKENS))
                         for _ in range(FAMILIES)]
        self.sessions = [f"pool-{i}" for i in range(SESSION_POOL)]
        self.n = 0
        self.counts = {}

    def count(self, kind, status):
        key = f"{kind} {status}"
        self.counts[key] = self.counts.get(key, 0) + 1

    def prompt(self):
        tail = " ".join(f"t{self.rng.randrange(VOCAB - 3)}" for _ in range(TAIL_TOKENS))
        return self.rng.choice(self.families) + " " + tail

    def headers(self):
        self.n += 1
        r = self.rng.random()
        if r < 0.5:
            session = f"s-{self.n}"
        elif r < 0.8:
            # A churning pool: a session comes back, then is replaced by a new one.
            i = self.rng.randrange(SESSION_POOL)
            if self.rng.random() < 0.1:
                self.sessions[i] = f"pool-{self.n}"
            session = self.sessions[i]
        else:
            session = None
        h = {"x-request-id": f"soak-{self.n}"}
        if session:
            h["x-session-id"] = session
        if self.rng.random() < 0.3:
            h["x-kvrouter-group-id"] = f"g-{self.n // 8}"
            h["x-kvrouter-group-size"] = "8"
        return h

    def request(self, path, payload, headers, raw=None):
        body = raw if raw is not None else json.dumps(payload).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
                "Connection: keep-alive\r\n\r\n").encode()
        return head + body

    def next(self):
        """(kind, path, bytes, mode): mode is "read", "drop" (close after the head) or a pick."""
        r = self.rng.random()
        h = self.headers()
        if r < 0.35:
            p = {"model": "tiny", "prompt": self.prompt(), "max_tokens": 8, "ignore_eos": True,
                 "stream": True}
            return "stream", "/v1/completions", self.request("/v1/completions", p, h), "read"
        if r < 0.55:
            p = {"model": "tiny", "prompt": self.prompt(), "max_tokens": 8, "ignore_eos": True}
            return "plain", "/v1/completions", self.request("/v1/completions", p, h), "read"
        if r < 0.65:
            p = {"model": "tiny", "messages": [{"role": "user", "content": self.prompt()}],
                 "max_tokens": 8, "ignore_eos": True, "stream": self.rng.random() < 0.5}
            return "chat", "/v1/chat/completions", self.request("/v1/chat/completions", p, h), "read"
        if r < 0.72:
            p = {"model": "tiny", "prompt": self.prompt(), "max_tokens": 64, "ignore_eos": True,
                 "stream": True}
            return "dropped", "/v1/completions", self.request("/v1/completions", p, h), "drop"
        if r < 0.82:
            p = {"model": "tiny", "prompt": self.prompt(), "max_tokens": 8}
            mode = "pick-finish" if self.rng.random() < 0.5 else "pick-abandon"
            return mode, "/v1/pick", self.request("/v1/pick", p, h), mode
        if r < 0.90:
            p = {"model": f"no-such-model-{self.n}", "prompt": "t1 t2", "max_tokens": 4}
            return "bad-model", "/v1/completions", self.request("/v1/completions", p, h), "read"
        if r < 0.95:
            raw = b'{"model": "tiny", "prompt": "t1 t2", "max_tokens": '
            return "bad-json", "/v1/completions", self.request("/v1/completions", None, h, raw), "read"
        p = {"model": "tiny", "max_tokens": 4}
        return "no-prompt", "/v1/completions", self.request("/v1/completions", p, h), "read"


async def client(t, deadline, budget, port):
    conn = None
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        kind, _path, data, mode = t.next()
        try:
            if conn is None:
                conn = await asyncio.open_connection(HOST, port)
            r, w = conn
            w.write(data)
            if mode == "drop":
                await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
                await asyncio.wait_for(r.readuntil(b"\r\n"), 30)  # the first chunk's size line
                w.close()
                conn = None
                t.count(kind, "dropped")
                continue
            status, body, _first, closing = await asyncio.wait_for(read_response(r), 60)
            t.count(kind, status)
            if mode == "pick-finish" and status == 200:
                pick = json.loads(body)
                fin = t.request(f"/v1/pick/{pick['id']}/finish",
                                {"status": "ok", "completion_tokens": 8}, {})
                w.write(fin)
                status, _b, _f, closing = await asyncio.wait_for(read_response(r), 60)
                t.count("finish", status)
            if closing:
                w.close()
                conn = None
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError,
                KeyError) as e:
            t.count(kind, type(e).__name__)
            if conn:
                conn[1].close()
            conn = None
    if conn:
        conn[1].close()


async def admin(port, method, path, payload=None, timeout=10):
    """One admin call on its own connection: (status, body)."""
    body = json.dumps(payload).encode() if payload is not None else b""
    r, w = await asyncio.open_connection(HOST, port)
    try:
        w.write((f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                 f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
        status, out, _f, _c = await asyncio.wait_for(read_response(r), timeout)
        return status, out
    finally:
        w.close()


async def churn(t, churn, deadline, port):
    """Registers the spare engine at the router on `port` and removes its previous
    registration there, every `every` s."""
    url, events, every = churn
    held = []

    async def hold(_reader, writer):
        held.append(writer)  # accepted, never answered

    stall = await asyncio.start_server(hold, HOST, 0)
    stall_url = f"http://{HOST}:{stall.sockets[0].getsockname()[1]}"
    last = None
    sizes = {"block_size": 16, "max_num_batched_tokens": 8192, "kv_capacity_blocks": 2048}
    try:
        while time.monotonic() < deadline:
            try:
                if last is not None:
                    status, _ = await admin(port, "DELETE", f"/admin/workers/{last}")
                    t.count("churn-remove", status)
                status, body = await admin(port, "POST", "/admin/workers",
                                           {"url": url, "kv_events_endpoint": events, **sizes})
                t.count("churn-add", status)
                last = json.loads(body).get("id") if status in (200, 201) else None
                # Given up before the router learns the models (it waits up to 2 s for them);
                # its KV events endpoint is a closed port.
                try:
                    await admin(port, "POST", "/admin/workers",
                                {"url": stall_url, "kv_events_endpoint": f"tcp://{HOST}:{free_port()}",
                                 **sizes}, timeout=0.5)
                except asyncio.TimeoutError:
                    t.count("stalled-add", "abandoned")
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
                t.count("churn", type(e).__name__)
            await asyncio.sleep(every)
    finally:
        stall.close()
        for w in held:
            w.close()


async def drive(t, ports, minutes, conc, max_requests, sample, sample_s, spare):
    deadline = time.monotonic() + 60 * minutes
    budget = [max_requests]
    # Clients spread over the routers; a client keeps its router (a pick's finish goes back to
    # the router that made it).
    tasks = [asyncio.create_task(client(t, deadline, budget, ports[i % len(ports)]))
             for i in range(conc)]
    if spare:
        tasks += [asyncio.create_task(churn(t, spare, deadline, port)) for port in ports]
    t0 = time.monotonic()
    while not all(x.done() for x in tasks):
        sample(time.monotonic() - t0, max_requests - budget[0])
        await asyncio.wait(tasks, timeout=sample_s)
    sample(time.monotonic() - t0, max_requests - budget[0])
    for x in tasks:
        x.result()


def report(samples, names):
    out = {}
    end = samples[-1]["t"]
    for name in names:
        pts = [(s["t"], s[name]) for s in samples if s.get(name)]
        if not pts:
            continue
        after_warm = [p for p in pts if p[0] >= end / 4] or pts
        second_half = [p for p in pts if p[0] >= end / 2]
        mid = min(pts, key=lambda p: abs(p[0] - end / 2))
        out[name] = {
            "rss_mib": [round(after_warm[0][1]["rss_kib"] / 1024, 1),
                        round(mid[1]["rss_kib"] / 1024, 1), round(pts[-1][1]["rss_kib"] / 1024, 1)],
            "rss_slope_kib_per_min_second_half":
                round(slope_per_min([(x, y["rss_kib"]) for x, y in second_half]) or 0, 1),
            "fds": [after_warm[0][1]["fds"], pts[-1][1]["fds"]],
            "threads": [after_warm[0][1]["threads"], pts[-1][1]["threads"]],
        }
        m = [y for _, y in pts if y.get("metrics_bytes")]
        if m:
            out[name]["metrics_bytes"] = [m[0]["metrics_bytes"], m[len(m) // 2]["metrics_bytes"],
                                          m[-1]["metrics_bytes"]]
            out[name]["metrics_worker_ids"] = [m[0]["metrics_worker_ids"],
                                               m[len(m) // 2]["metrics_worker_ids"],
                                               m[-1]["metrics_worker_ids"]]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/kvrouter")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=10_000_000)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="target/soak")
    ap.add_argument("--serve-flags", default="", help="more `kvrouter serve` flags (word-split)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="routers; more than one sync over a `nats-server` started here")
    ap.add_argument("--churn-s", type=float, default=3,
                    help="seconds between worker registrations (0: no worker churn)")
    ap.add_argument("--max-slope-kib-min", type=float, default=None,
                    help="exit 1 if any process's RSS slope over the second half is above this")
    a = ap.parse_args()
    # A SIGTERM stops the processes started here too (through the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvr-soak-")
    tok = os.path.join(work, "tokenizer.json")
    write_tokenizer(tok, VOCAB)
    procs = Procs(work)
    samples_path = os.path.join(a.out, "samples.jsonl")
    samples = []
    try:
        wf = os.path.join(work, "workers.toml")
        engines = []
        with open(wf, "w") as f:
            for i in range(5):
                hp, zp = free_port(), free_port()
                engines.append((hp, procs.start(f"engine{i}", [
                    a.bin, "mock-engine", "--port", str(hp), "--model-name", "tiny",
                    "--speedup-ratio", "1000", "--tokenizer", tok, "--num-gpu-blocks", "2048",
                    "--block-size", "16", "--kv-events-endpoint", f"tcp://{HOST}:{zp}"])))
                if i < 4:
                    f.write(f'[[workers]]\nurl = "http://{HOST}:{hp}"\n'
                            f'kv_events_endpoint = "tcp://{HOST}:{zp}"\n\n')
                else:
                    spare = (f"http://{HOST}:{hp}", f"tcp://{HOST}:{zp}", a.churn_s)
        for hp, proc in engines:
            wait_ready(hp, proc, 0)
        sync = []
        if a.replicas > 1:
            nats_port = free_port()
            procs.start("nats", ["nats-server", "-a", HOST, "-p", str(nats_port)])
            wait_port(nats_port)
            sync = ["--replica-sync", f"nats://{HOST}:{nats_port}"]
        routers = {}
        for i in range(a.replicas):
            port = free_port()
            name = "router" if a.replicas == 1 else f"router{i}"
            ids = ["--replica-id", str(i + 1)] if sync else []
            routers[name] = (port, procs.start(name, [
                a.bin, "serve", "--port", str(port), "--workers-file", wf, "--tokenizer", tok,
                "--kv-cache-block-size", "16", "--pick-lease-secs", "2",
                "--admin-token", ADMIN_TOKEN] + sync + ids + a.serve_flags.split()))
        for port, proc in routers.values():
            wait_ready(port, proc, 4)
        ports = [port for port, _ in routers.values()]
        procs_by_name = {**{n: p for n, (_, p) in routers.items()},
                         **{f"engine{i}": p for i, (_, p) in enumerate(engines)}}
        log(f"soak: {a.minutes} min, {a.conc} clients, routers on {ports}, logs in {work}")
        t = Traffic(ports[0], a.seed)
        f = open(samples_path, "w")

        def sample(t_s, requests):
            s = {"t": round(t_s, 1), "requests": requests}
            for name, proc in procs_by_name.items():
                s[name] = proc_stats(proc.pid)
                if name in routers and s[name]:
                    s[name].update(metrics_size(routers[name][0]))
            samples.append(s)
            f.write(json.dumps(s) + "\n")
            f.flush()
            for name in routers:
                r = s[name] or {}
                log(f"t={t_s:6.0f}s requests={requests} {name} rss={r.get('rss_kib', 0) / 1024:.1f}"
                    f" MiB fds={r.get('fds')} threads={r.get('threads')} metrics="
                    f"{r.get('metrics_bytes')} B worker ids in metrics={r.get('metrics_worker_ids')}")

        asyncio.run(drive(t, ports, a.minutes, a.conc, a.max_requests, sample, a.sample_s,
                          spare if a.churn_s > 0 else None))
        alive = {name: p.poll() is None for name, p in procs_by_name.items()}
        rep = {"minutes": a.minutes, "requests": samples[-1]["requests"],
               "alive": alive, "counts": dict(sorted(t.counts.items())),
               "processes": report(samples, list(procs_by_name))}
        with open(os.path.join(a.out, "report.json"), "w") as out:
            json.dump(rep, out, indent=1)
        print(json.dumps(rep, indent=1))
        bad = [n for n, v in rep["processes"].items()
               if isinstance(v, dict) and a.max_slope_kib_min is not None
               and v["rss_slope_kib_per_min_second_half"] > a.max_slope_kib_min]
        if not all(alive.values()) or bad:
            log(f"soak: FAILED (alive {alive}, growing {bad})")
            return 1
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
