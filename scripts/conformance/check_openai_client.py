#!/usr/bin/env python3
"""Drives `kvrouter serve --mock-workers 2` with the official `openai` Python client: a chat
completion, a streaming chat completion and a completion must all work through the router.

Usage: check_openai_client.py PATH/TO/kvrouter      (needs openai)
"""
import subprocess
import sys

import openai


def main() -> int:
    proc = subprocess.Popen(
        [sys.argv[1], "serve", "--port", "0", "--mock-workers", "2", "--mock-speedup-ratio", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        base = next(w for w in line.split() if w.startswith("http://"))
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=30, max_retries=0)
        models = [m.id for m in client.models.list().data]
        assert models == ["mock-model"], models

        chat = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5)
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content, chat
        assert chat.usage.completion_tokens == 5, chat.usage

        stream = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "Count."}], max_tokens=6,
            stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        assert len(pieces) == 6, pieces
        assert usage is not None and usage.completion_tokens == 6, usage

        completion = client.completions.create(model="mock-model", prompt="Once upon a time", max_tokens=4)
        assert completion.choices[0].text, completion
        assert completion.usage.completion_tokens == 4

        print("openai client through kvrouter serve: chat, streaming chat and completion OK")
        return 0
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
