"""Peer runner: llama.cpp's own `llama-bench` on the SmolLM2 GGUF (the embedded Q4_1 or `--gguf`), CPU, THREADS threads.

    .venv/bin/python bench/peer_llamabench.py --workloads W.json --gguf PATH

Each sample is one `llama-bench -r 1 -o json` process and its own timing (`samples_ts`): prefill_N is
`-p N -n 0` (N = our prompt's length, `--no-warmup`: a warmup would be a second N-token prefill), decode_b1
is `-p 0 -n DECODE_TOKENS -d 512` (generation after a 512-token context, as our decode_b1; llama-bench's
1-token warmup). It times only llama.cpp's compute, no request handling, and its prompts are llama-bench's
random tokens (speed does not depend on them). It runs one sequence: the batched workloads need the
llama-server runner (peer_llamacpp.py). Startup and peak RSS are of separate short processes (no KV pool
held), so they get no ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
from pathlib import Path

import harness
import llama_server
import workloads as wl


class LlamaBenchEngine(harness.Engine):
    name = "llama.cpp (llama-bench)"
    notes = {
        "decode_b32_tok_s": "not supported: llama-bench runs one sequence (batched: the llamacpp runner)",
        "throughput_64_tok_s": "not supported: llama-bench runs one sequence (batched: the llamacpp runner)",
        "startup_s": "python + one llama-bench process, not a server's startup (no ratio)",
        "peak_rss_mb": "the largest llama-bench process (KV sized to one test, no pool held; no ratio)",
    }
    unlike = frozenset({"startup_s", "peak_rss_mb"})

    def load(self, args: argparse.Namespace) -> None:
        self._gguf = str(args.gguf)
        if not llama_server.binary("llama-bench").exists():
            raise RuntimeError(f"{llama_server.binary('llama-bench')} missing: run bench/setup_peers.sh llama-server")

    def version(self) -> str:
        return f"llama-bench ({llama_server.version()}), {Path(self._gguf).name}, -t {wl.THREADS}"

    def _bench(self, *flags: str) -> float:
        cmd = [str(llama_server.binary("llama-bench")), "-m", self._gguf, "-t", str(wl.THREADS), "-r", "1",
               "-o", "json", "--repack", "0", *flags]  # llama_server.NO_REPACK: AMX crashes here
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench exited {out.returncode}: {out.stderr.strip()[-300:]}")
        tests = json.loads(out.stdout)  # one per test: -p N -n M gives a prompt test, then a generation test
        return float(tests[-1]["samples_ts"][0])

    def measure_itself(self, metric: str, work: wl.Workloads, index: int) -> float | None:
        if metric.startswith("prefill_"):
            prompt = work.prefill[metric.split("_")[1]][index]
            return self._bench("-p", str(len(prompt)), "-n", "0", "--no-warmup")
        if metric == "decode_b1_tok_s":
            depth = len(work.decode_b1[index])
            return self._bench("-p", "0", "-n", str(work.decode_tokens), "-d", str(depth))
        if metric in ("decode_b32_tok_s", "throughput_64_tok_s"):
            raise NotImplementedError("llama-bench runs one sequence")
        return None  # prefix workloads: no prompt cache in llama-bench -> not requested of it

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """The startup and warmup requests: one llama-bench run of the same shape."""
        for prompt in prompts:
            self._bench("-p", str(len(prompt)), "-n", str(max_tokens), "--no-warmup")
        return [max_tokens] * len(prompts)

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
        raise NotImplementedError("llama-bench reports rates, not step times")

    def peak_rss_kb(self) -> int:
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux


if __name__ == "__main__":
    harness.run_main(LlamaBenchEngine)
