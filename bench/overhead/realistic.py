#!/usr/bin/env python3
"""Router CPU per streamed request in the realistic case (issue 15).

Stack: `kvrouter serve` in front of 4 separate `kvrouter mock-engine` processes
(`--speedup-ratio 1000`, KV events over ZMQ, word-level tokenizer: one `tNNN`
word is one token). Workload: streamed /v1/completions, 128-token text prompts,
16 output tokens (ignore_eos), a closed loop of C asyncio clients (stdlib only,
raw HTTP/1.1), with a fresh connection per request or kept-alive connections.
Measure: the router's utime+stime from /proc/PID/stat over each case, divided
by the number of requests, plus client-side latency percentiles.

Variants (`--variant NAME=BIN[::EXTRA SERVE FLAGS]`, repeatable) are run
interleaved: for each rep, each variant's router is started against the same
engines, all cases run, the router is stopped. Everything is bounded: a request
count per case and a deadline per case; every process is stopped by its PID;
all traffic stays on 127.0.0.1.

Example (from the repo root, after `cargo build --release -p kvrouter`):
  python3 bench/overhead/realistic.py --variant base=target/release/kvrouter --reps 3
"""
import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MAX_REQUESTS = 20000


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# Common English words for prompts through a real tokenizer (`--tokenizer`).
ENGLISH = ("the of and to in is that for it as with was on be at by this had not are but from or "
           "have an they which one you were her all she there would their we him been has when "
           "who will more no if out so said what up its about into than them can only other new "
           "some could time these two may then do first any my now such like our over man me even "
           "most made after also did many before must through back years where much your way well "
           "down should because each just those people how too little state good very make world "
           "still own see men work long get here between both life being under never day same "
           "another know while last might us great old year off come since against go came right "
           "used take three router cache token block worker prefix request model engine").split()


def write_tokenizer(path, vocab_size):
    """A Hugging Face tokenizer.json: WordLevel model, whitespace split, 3 specials."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_size - 3):
        vocab[f"t{i}"] = i + 3
    specials = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
           "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    with open(path, "w") as f:
        json.dump(tok, f)


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def thread_cpu_s(pid):
    """CPU seconds by thread group: the comm name with its trailing digits and dashes cut
    (`kv-ingest-3-0` -> `kv-ingest`, `tokio-runtime-w` as is). Threads that ended between two
    reads are missed, so the groups need not add up to `cpu_s`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")].rstrip("0123456789-")
        fields = raw.rsplit(")", 1)[1].split()
        out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def counters(pid):
    """Read and write syscalls (/proc/PID/io) and context switches over the router's threads."""
    out = {"syscr": 0, "syscw": 0, "ctxsw": 0}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            if k in ("syscr", "syscw"):
                out[k] = int(v)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        out["ctxsw"] += int(line.split()[1])
        except OSError:
            pass
    return out


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Procs:
    def __init__(self, log_dir):
        self.log_dir, self.procs = log_dir, []

    def start(self, name, cmd, env=None):
        f = open(os.path.join(self.log_dir, name + ".log"), "w")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                             env=dict(os.environ, **(env or {})))
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


# ---- a minimal HTTP/1.1 client (one request at a time per connection) ----

async def read_response(reader):
    """Reads one response; returns (status, body bytes, first-chunk time or None)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            hdrs[k.strip().lower()] = v.strip()
    body, t_first = bytearray(), None
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            chunk = await reader.readexactly(size + 2)
            if t_first is None:
                t_first = time.perf_counter()
            body += chunk[:-2]
    elif "content-length" in hdrs:
        body += await reader.readexactly(int(hdrs["content-length"]))
        t_first = time.perf_counter()
    else:
        body += await reader.read(-1)
        t_first = time.perf_counter()
    return status, bytes(body), t_first, hdrs.get("connection", "").lower() == "close"


def request_bytes(port, payload, keepalive):
    body = json.dumps(payload).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if keepalive else 'close'}\r\n\r\n").encode()
    return head + body


async def run_case(port, prompts, conc, keepalive, max_tokens, deadline_s, stream=True):
    queue = list(range(len(prompts)))
    queue.reverse()
    lat, ttft, errors = [], [], []

    async def worker():
        conn = None
        while queue:
            i = queue.pop()
            payload = {"model": "tiny", "prompt": prompts[i], "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": stream}
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.open_connection(HOST, port)
                r, w = conn
                w.write(request_bytes(port, payload, keepalive))
                status, body, t_first, closing = await read_response(r)
                if status != 200 or (stream and not body.rstrip().endswith(b"data: [DONE]")):
                    errors.append(f"{status} {body[:200]!r}")
                else:
                    lat.append(time.perf_counter() - t0)
                    ttft.append(t_first - t0)
                if not keepalive or closing:
                    w.close()
                    conn = None
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                errors.append(repr(e))
                if conn:
                    conn[1].close()
                conn = None
        if conn:
            conn[1].close()

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(conc))), deadline_s)
    return {"wall_s": time.perf_counter() - t0, "ok": len(lat), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "lat_p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
            "lat_p99_ms": round(1000 * sorted(lat)[int(0.99 * (len(lat) - 1))], 2) if lat else None,
            "ttft_p50_ms": round(1000 * statistics.median(ttft), 2) if ttft else None}


def wait_ready(port, proc, n_workers, timeout_s=60):
    """Polls /v1/models until the model is listed (bounded); then one request per worker."""
    import urllib.request
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=2) as r:
                if b'"tiny"' in r.read():
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("router not ready")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=BIN[::[ENV=VAL ...] EXTRA SERVE FLAGS] (repeatable; run "
                         "interleaved)")
    ap.add_argument("--engine-bin", default=None,
                    help="kvrouter binary for the mock engines (default: the first variant's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--modes", default="fresh,keepalive")
    ap.add_argument("--requests", type=int, default=1500, help="requests per case at c>1")
    ap.add_argument("--requests-c1", type=int, default=400, help="requests per case at c=1")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-stream", action="store_true", help="non-streamed requests instead")
    ap.add_argument("--speedup-ratio", default="1000")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokenizer", default=None, metavar="PATH",
                    help="a real tokenizer.json (e.g. ../shared/tokenizers/deepseek-v4) instead of "
                         "the word-level one; prompts are then common English words (about one "
                         "token each)")
    ap.add_argument("--deadline", type=float, default=120, help="seconds per case")
    ap.add_argument("--router-cpus", default=None, help="taskset CPU list for the router")
    ap.add_argument("--perf-record", default=None, metavar="FILE",
                    help="`perf record -g` the router during the first rep's largest-concurrency "
                         "case of the first mode into FILE.<variant>; PERF_EVENT (default cpu-clock) "
                         "sets the event, PERF_RATE its rate (default '-F 1999'; '-c 1' records "
                         "every event, e.g. with PERF_EVENT=raw_syscalls:sys_enter), PERF_CG the "
                         "call-graph flags (default -g; '--call-graph dwarf,16384' resolves Rust "
                         "frames)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args()

    variants = []
    for v in a.variant:
        name, rest = v.split("=", 1)
        binary, _, extra = rest.partition("::")
        words = shlex.split(extra)
        # Leading NAME=VALUE words are the router's environment (LD_PRELOAD, TOKIO_WORKER_THREADS).
        env = {}
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        variants.append((name, os.path.abspath(binary), words, env))
    engine_bin = os.path.abspath(a.engine_bin or variants[0][1])
    work = tempfile.mkdtemp(prefix="kvr-realistic-")
    tok = os.path.join(work, "tokenizer.json")
    if a.tokenizer:
        tok = os.path.abspath(a.tokenizer)
    else:
        write_tokenizer(tok, a.vocab)
    procs = Procs(work)
    rng = random.Random(a.seed)
    out = open(a.out, "a")
    try:
        wf = os.path.join(work, "workers.toml")
        engines = []
        with open(wf, "w") as f:
            for i in range(4):
                hp, zp = free_port(), free_port()
                engines.append((hp, procs.start(f"engine{i}", [
                    engine_bin, "mock-engine", "--port", str(hp), "--model-name", "tiny",
                    "--speedup-ratio", a.speedup_ratio, "--tokenizer", tok,
                    "--kv-events-endpoint", f"tcp://{HOST}:{zp}"])))
                f.write(f'[[workers]]\nurl = "http://{HOST}:{hp}"\n'
                        f'kv_events_endpoint = "tcp://{HOST}:{zp}"\n\n')
        # The router learns the model name from the first worker at start: engines first (a
        # large tokenizer takes them seconds to load).
        for hp, proc in engines:
            wait_ready(hp, proc, 0)
        for rep in range(a.reps):
            for name, binary, extra, env in variants:
                port = free_port()
                cmd = [binary, "serve", "--port", str(port), "--workers-file", wf,
                       "--tokenizer", tok, "--health-check-interval-secs", "0"] + extra
                if a.router_cpus:
                    cmd = ["taskset", "-c", a.router_cpus] + cmd
                router = procs.start(f"router-{name}-{rep}", cmd, env)
                try:
                    wait_ready(port, router, 4)

                    def prompts(n):
                        if a.tokenizer:
                            return [" ".join(rng.choice(ENGLISH) for _ in range(a.prompt_tokens))
                                    for _ in range(n)]
                        return [" ".join(f"t{rng.randrange(a.vocab - 3)}"
                                         for _ in range(a.prompt_tokens)) for _ in range(n)]
                    asyncio.run(run_case(port, prompts(a.warmup), 8, True, a.max_tokens,
                                         a.deadline, not a.no_stream))
                    for mode in a.modes.split(","):
                        for c in (int(x) for x in a.conc.split(",")):
                            n = min(MAX_REQUESTS, a.requests_c1 if c == 1 else a.requests)
                            ps = prompts(n)
                            prof = None
                            if (a.perf_record and rep == 0 and mode == a.modes.split(",")[0]
                                    and c == max(int(x) for x in a.conc.split(","))):
                                prof = subprocess.Popen(
                                    ["perf", "record", "-e", os.environ.get("PERF_EVENT", "cpu-clock"),
                                     *os.environ.get("PERF_RATE", "-F 1999").split(),
                                     *os.environ.get("PERF_CG", "-g").split(), "-p", str(router.pid),
                                     "-o", f"{a.perf_record}.{name}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                                time.sleep(0.5)
                            c0, k0 = cpu_s(router.pid), counters(router.pid)
                            t0 = thread_cpu_s(router.pid)
                            res = asyncio.run(run_case(port, ps, c, mode == "keepalive",
                                                       a.max_tokens, a.deadline, not a.no_stream))
                            c1, k1 = cpu_s(router.pid), counters(router.pid)
                            t1 = thread_cpu_s(router.pid)
                            if prof:
                                prof.send_signal(signal.SIGINT)
                                try:
                                    prof.wait(60)
                                except subprocess.TimeoutExpired:
                                    prof.kill()
                                    prof.wait(5)
                            res.update({"variant": name, "rep": rep, "mode": mode, "conc": c,
                                        "stream": not a.no_stream, "router_cpu_s": round(c1 - c0, 3),
                                        "router_cpu_us_per_req":
                                            round(1e6 * (c1 - c0) / max(1, res["ok"]), 1),
                                        "req_per_s": round(res["ok"] / res["wall_s"], 1)})
                            res["thread_cpu_us_per_req"] = {
                                g: round(1e6 * (t1[g] - t0.get(g, 0.0)) / max(1, res["ok"]), 1)
                                for g in sorted(t1) if t1[g] > t0.get(g, 0.0)}
                            for k in k0:
                                res[f"{k}_per_req"] = round((k1[k] - k0[k]) / max(1, res["ok"]), 1)
                            out.write(json.dumps(res) + "\n")
                            out.flush()
                            log(f"{name} rep{rep} {mode} c{c}: {res['router_cpu_us_per_req']} us/req "
                                f"{res['req_per_s']} req/s p50 {res['lat_p50_ms']} ms "
                                f"reads {res['syscr_per_req']} writes {res['syscw_per_req']} "
                                f"ctxsw {res['ctxsw_per_req']} per req "
                                f"err {res['errors']} {res['first_error'] or ''} "
                                f"threads {res['thread_cpu_us_per_req']}")
                finally:
                    procs.stop(router)
    finally:
        procs.stop_all()
        out.close()


if __name__ == "__main__":
    main()
