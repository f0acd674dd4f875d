"""Peer runner: llama.cpp's `llama-server` on the SmolLM2 GGUF (the embedded Q4_1 or `--gguf`), CPU, over HTTP.

    .venv/bin/python bench/peer_llamacpp.py --workloads W.json --gguf PATH

The server (bench/setup_peers.sh llama-server; the llama.cpp vendored in the llama-cpp-python sdist) runs
with `-t/-tb THREADS`, 64 parallel slots over one unified KV cache (`-kvu`, sized for the 64-request run) and
continuous batching, so batch-32 decode and the 64-request throughput are batched as ours are. Requests go
to its native `/completion` with token-id prompts, greedy (`temperature: 0`), `ignore_eos`; batches are
concurrent streaming requests, and a decode timeline is the arrival time of every streamed token. Its host
prompt cache (`--cache-ram`) is off; the warm prefix reuses the KV of the slot that holds the prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

import harness
import httpx
import llama_server
import workloads as wl

SLOTS = 64
SLOT_TOKENS = 1280  # the longest throughput request (1,000 prompt + 128 new) fits; 8K prompts use the pool


class LlamaServerEngine(harness.Engine):
    name = "llama.cpp (llama-server)"
    notes = {"prefix_warm_ttft_s": "reuses the KV of the slot holding the prefix (cache_prompt)"}

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def load(self, args: argparse.Namespace) -> None:
        why = llama_server.missing()
        if why:
            raise RuntimeError(why)
        flags = ["-t", str(wl.THREADS), "-tb", str(wl.THREADS), "-np", str(SLOTS), "-kvu",
                 "-c", str(SLOTS * SLOT_TOKENS), "--cache-ram", "0"]
        log = wl.BENCH_DIR / "logs" / "engine-llama-server.log"
        self._server = self._stack.enter_context(llama_server.running(flags, log, args.gguf))
        self._flags, self._file = flags, (args.gguf or wl.embedded_gguf_path()).name

    def close(self) -> None:
        self._stack.close()

    def version(self) -> str:
        return f"llama-server {llama_server.version()}, {self._file}, {' '.join(self._flags)}"

    def peak_rss_kb(self) -> int:
        return harness.hwm_kb(self._server.proc.pid)

    def _body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
        return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": True, "stream": stream}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
            response = await client.post("/completion", json=self._body(prompt, max_tokens, False))
            response.raise_for_status()
            return int(response.json()["tokens_predicted"])

        async def run() -> list[int]:
            async with self._client() as client:
                return list(await asyncio.gather(*(one(client, p) for p in prompts)))

        return asyncio.run(run())

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
        events: list[tuple[float, int, int]] = []  # (arrival, request, tokens in the event)

        async def one(client: httpx.AsyncClient, index: int, prompt: list[int]) -> None:
            async with client.stream("POST", "/completion", json=self._body(prompt, max_tokens, True)) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[len("data: "):])
                    if data.get("tokens"):
                        events.append((time.perf_counter(), index, len(data["tokens"])))
                    if data.get("stop"):
                        return

        async def run() -> None:
            async with self._client() as client:
                await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

        asyncio.run(run())
        timeline: harness.Timeline = []
        produced, started = 0, set()
        for arrival, index, count in events:
            produced += count
            started.add(index)
            timeline.append((arrival, produced, len(started)))
        return timeline

    def _client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=SLOTS * 2, max_keepalive_connections=SLOTS * 2)
        return httpx.AsyncClient(base_url=self._server.base_url, timeout=None, limits=limits)


if __name__ == "__main__":
    harness.run_main(LlamaServerEngine)
