#!/usr/bin/env python3
"""Writes router_hash_vectors.json: kvrouter's block hashes computed independently of the Rust
code, with the `xxhash` package (pip install xxhash). Run from this folder; the output is checked
in and pinned by tests/golden_hashes.rs."""
import json
import struct

import xxhash

BASE_SEED = 1337
MASK = (1 << 64) - 1


def seed(lora, salt):
    s = BASE_SEED
    if lora:
        s = (s + xxhash.xxh3_64_intdigest(lora.encode(), seed=0)) & MASK
    if salt:
        s = (s + xxhash.xxh3_64_intdigest(salt.encode(), seed=1)) & MASK
    return s


def hashes(tokens, block_size, lora=None, salt=None):
    sd = seed(lora, salt)
    content, sequence, prev = [], [], None
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        c = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(block), *block), seed=sd)
        s = c if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, c), seed=BASE_SEED)
        content.append(c)
        sequence.append(s)
        prev = s
    return content, sequence


CASES = [
    ("tokens 1..8, block 4", list(range(1, 9)), 4, None, None),
    ("tokens 1..10, block 4 (partial tail)", list(range(1, 11)), 4, None, None),
    ("tokens 0..256, block 64", list(range(256)), 64, None, None),
    ("large ids, block 2", [0, 4294967295, 151643, 100000], 2, None, None),
    ("lora adapter", list(range(1, 9)), 4, "math-lora", None),
    ("cache salt", list(range(1, 9)), 4, None, "tenant-a"),
    ("lora and salt", list(range(1, 9)), 4, "math-lora", "tenant-a"),
    ("empty strings mean absent", list(range(1, 9)), 4, "", ""),
]

out = []
for name, tokens, bs, lora, salt in CASES:
    content, sequence = hashes(tokens, bs, lora, salt)
    out.append({
        "name": name, "tokens": tokens, "block_size": bs, "lora_name": lora, "cache_salt": salt,
        "content": [str(c) for c in content], "sequence": [str(s) for s in sequence],
    })
with open("router_hash_vectors.json", "w") as f:
    f.write('{"generator": %s,\n "cases": [\n' % json.dumps("make_hash_vectors.py, python xxhash " + xxhash.VERSION))
    f.write(",\n".join("  " + json.dumps(case) for case in out))
    f.write("\n ]}\n")
