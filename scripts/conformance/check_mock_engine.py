#!/usr/bin/env python3
"""Checks `kvrouter mock-engine`'s KV events against vLLM 0.33's wire schema, from the outside.

Starts the binary on free loopback ports, sends a few completions, subscribes to the PUB socket
(live frames) and asks the ROUTER socket for a replay from sequence 0 over a DEALER, exactly as a
vLLM consumer would. Every payload must decode with msgspec structs that mirror
`vllm/distributed/kv_events.py` 0.33 (tagged maps, positional batch), see
`../shared/reference/kv-events-wire-format.md`.

Usage: check_mock_engine.py PATH/TO/kvrouter      (needs pyzmq and msgspec)
"""
import json
import subprocess
import sys
import time
import urllib.request
from typing import Optional, Union

import msgspec
import zmq

Hash = Union[int, bytes]


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
TOPIC = b"kv-events"
BLOCK = 4


def check_batch(payload: bytes, where: str) -> KVEventBatch:
    batch = DECODER.decode(payload)  # raises on any schema violation
    assert batch.data_parallel_rank == 0, where
    for e in batch.events:
        if isinstance(e, BlockStored):
            assert e.block_size == BLOCK, where
            assert len(e.token_ids) == BLOCK * len(e.block_hashes), where
            assert e.medium == "GPU", where
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e.block_hashes), where
        elif isinstance(e, BlockRemoved):
            assert len(e.block_hashes) >= 1, where
    return batch


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def main() -> int:
    binary = sys.argv[1]
    proc = subprocess.Popen(
        [binary, "mock-engine", "--port", "0", "--block-size", str(BLOCK), "--num-gpu-blocks", "32",
         "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
         "--kv-events-topic", TOPIC.decode(), "--speedup-ratio", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        base = next(w for w in line.split() if w.startswith("http://"))
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(fields["kv_events"])
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        live = []
        deadline = time.monotonic() + 20
        i = 0
        # Enough distinct prompts to fill 32 blocks, so evictions (BlockRemoved) happen too.
        while (len(live) < 3 or i < 40) and time.monotonic() < deadline and i < 400:
            post(base, {"prompt": f"request number {i} with some words to fill blocks", "max_tokens": 2})
            i += 1
            while sub.poll(20):
                live.append(sub.recv_multipart())
        assert live, "no live KV event arrived"
        kinds = set()
        for frames in live:
            assert len(frames) == 3, frames
            assert frames[0] == TOPIC and len(frames[1]) == 8
            for e in check_batch(frames[2], "live").events:
                kinds.add(type(e).__name__)
        assert {"BlockStored", "BlockRemoved"} <= kinds, kinds

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(fields["replay"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            if not dealer.poll(10_000):
                raise AssertionError("replay timed out")
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            if frames[2] == b"\xff" * 8:
                assert frames[1] == b"" and frames[3] == b""
                break
            assert frames[1] == TOPIC
            seqs.append(int.from_bytes(frames[2], "big"))
            check_batch(frames[3], f"replay seq {seqs[-1]}")
        assert seqs == list(range(len(seqs))) and seqs, seqs[:10]
        print(f"mock-engine KV events conform to the vLLM 0.33 schema: {len(live)} live batches, "
              f"{len(seqs)} replayed batches, event kinds {sorted(kinds)}")
        return 0
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
