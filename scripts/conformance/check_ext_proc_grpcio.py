#!/usr/bin/env python3
"""Drives `kvrouter serve --ext-proc-port` with gRPC C-core (`grpcio`), the HTTP/2 and gRPC
stack of Envoy's `google_grpc` client, against the picker's own HTTP/2 server (the Rust tests
use tonic's and h2's): health `Check` (known and unknown names) and `Watch`, then 120 full
ext_proc exchanges, 40 at a time over one channel, each answered message by message as Envoy
does (request headers, a ~17 KB body that spans DATA frames, response headers, two body
chunks). Every exchange must name a destination and end; every pick must be finished and the
load released. The protobuf messages are written by hand (field numbers of
`envoy/service/ext_proc/v3/external_processor.proto`), so no generated code is needed.

Usage: check_ext_proc_grpcio.py PATH/TO/kvrouter      (needs grpcio, grpcio-health-checking)
"""
import queue
import subprocess
import sys
import threading
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BUFFERED = 2
SSE = [b'data: {"choices":[{"text":"a"}]}\n\n',
       b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
       b"data: [DONE]\n\n"]
ROUNDS, AT_ONCE = 3, 40


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def field(num: int, payload: bytes) -> bytes:
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def number(num: int, v: int) -> bytes:
    return varint(num << 3) + varint(v)


def headers(pairs) -> bytes:
    """HttpHeaders { headers: HeaderMap { headers: [HeaderValue { key, raw_value }] } }."""
    values = b"".join(field(1, field(1, k.encode()) + field(3, v.encode())) for k, v in pairs)
    return field(1, values)


def body(data: bytes, eos: bool) -> bytes:
    """HttpBody { body, end_of_stream }."""
    return field(1, data) + (number(2, 1) if eos else b"")


def exchange_messages(i: int):
    ids = ",".join(str(t) for t in range(i % 7, i % 7 + 3000))
    prompt = ('{"model":"mock-model","prompt":[%s],"max_tokens":2}' % ids).encode()
    request_headers = field(2, headers([(":method", "POST"), (":path", "/v1/completions"),
                                        ("content-type", "application/json")]))
    # protocol_config (11): request_body_mode (1) and response_body_mode (2) BUFFERED.
    request_headers += field(11, number(1, BUFFERED) + number(2, BUFFERED))
    return ([request_headers, field(4, body(prompt, True)), field(3, headers([(":status", "200")]))]
            + [field(5, body(c, k == len(SSE) - 1)) for k, c in enumerate(SSE)])


def exchange(process, i: int, errors: list) -> None:
    try:
        msgs, turns = exchange_messages(i), queue.Queue()

        def requests():
            for m in msgs:
                turns.get(timeout=30)  # the next message once the last is answered
                yield m

        turns.put(None)
        answers = []
        for answer in process(requests(), timeout=30):
            answers.append(answer)
            turns.put(None)
        assert len(answers) == len(msgs), f"{len(answers)} answers to {len(msgs)} messages"
        assert b"x-gateway-destination-endpoint" in answers[1], answers[1][:300]
    except Exception as e:  # noqa: BLE001 (reported below, with the exchange's number)
        errors.append((i, repr(e)))


def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def main() -> int:
    proc = subprocess.Popen(
        [sys.argv[1], "serve", "--port", "0", "--mock-workers", "2", "--ext-proc-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        words = proc.stdout.readline().split()
        base = next(w for w in words if w.startswith("http://"))
        target = next(w for w in words if w.startswith("ext_proc=")).split("=", 1)[1]
        channel = grpc.insecure_channel(target)
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == serving
        try:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            raise AssertionError("an unknown service was answered")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == serving
        watch.cancel()

        process = channel.stream_stream(PROCESS, request_serializer=None,
                                        response_deserializer=None)
        errors: list = []
        for r in range(ROUNDS):
            threads = [threading.Thread(target=exchange, args=(process, r * AT_ONCE + i, errors))
                       for i in range(AT_ONCE)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors, f"{len(errors)} exchanges failed, e.g. {errors[:3]}"
        finished = metric(base, 'kvrouter_picks_total{source="ext_proc",end="finished"}')
        assert finished == ROUNDS * AT_ONCE, finished
        assert metric(base, "kvrouter_worker_active_requests{") == 0
        channel.close()
        print(f"grpcio {grpc.__version__} through the ext_proc port: health and "
              f"{ROUNDS * AT_ONCE} exchanges OK")
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
