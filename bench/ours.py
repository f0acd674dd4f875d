"""Runner for our engine (glmserve's offline `LLM`), run with the project venv.

    .venv/bin/python bench/ours.py --workloads W.json

`LLM(model=None)` loads the embedded SmolLM2 GGUF (the same file the peers get; `--gguf` another one) with the
engine's default dtype; prefix caching is on. The API contract is docs/ENGINE_API.md. Once loaded, the process's
heap is frozen out of the cycle collector (glmserve/gc_heap.py), as `glmserve serve` freezes its own once ready and
vLLM's engine core its own at startup (vllm/v1/engine/core.py): the runner measures the engine as it is served.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import harness
import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))


class OursEngine(harness.Engine):
    name = "glmserve"
    notes = {"prefix_warm_ttft_s": "prefix caching on"}

    def load(self, args: argparse.Namespace) -> None:
        import torch

        from glmserve import LLM, SamplingParams
        from glmserve.gc_heap import freeze_startup_heap

        torch.set_num_threads(wl.THREADS)
        self._params = SamplingParams
        self._dtype = args.dtype or "auto"
        self._quantization = args.quantization
        other_file = args.gguf is not None and args.gguf.resolve() != wl.embedded_gguf_path().resolve()
        self._llm = LLM(model=str(args.gguf) if other_file else None, dtype=self._dtype, enable_prefix_caching=True,
                        num_threads=wl.THREADS, quantization=args.quantization)
        freeze_startup_heap()  # decode batch 1 / 32 1.02x / 1.03x, the mix 1.00x (bench/RESULTS.md)
        self._cached_tokens: list[int] = []
        self._ids = itertools.count()

    def version(self) -> str:
        import importlib.metadata

        try:
            version = importlib.metadata.version("glmserve")
        except importlib.metadata.PackageNotFoundError:
            version = "(source tree)"
        weights = self._quantization or "the GGUF's own blocks"
        return f"glmserve {version}, dtype {self._dtype}, KV {self._llm.engine.kv_format}, weights {weights}"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self._llm.generate(prompts, params)
        self._cached_tokens = [o.num_cached_tokens or 0 for o in outputs]
        return [len(o.outputs[0].token_ids) for o in outputs]

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
        engine = self._llm.engine
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(f"bench-{next(self._ids)}", prompt, params)
        timeline: harness.Timeline = []
        counts: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
            timeline.append((time.perf_counter(), sum(counts.values()), sum(c > 0 for c in counts.values())))
        return timeline

    def extra(self) -> dict[str, object]:
        return {"last_request_cached_tokens": self._cached_tokens}


if __name__ == "__main__":
    harness.run_main(OursEngine)
