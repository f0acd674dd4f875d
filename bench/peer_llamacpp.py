"""Peer runner: llama-cpp-python on the SmolLM2 Q4_1 GGUF, CPU, n_threads=2.

    $GLMSERVE_BENCH_DIR/llamacpp/bin/python bench/peer_llamacpp.py --workloads W.json --gguf PATH

`Llama` holds one sequence, so batches run one request after another (decode_b32 and the
throughput run are serial). Its built-in prompt reuse keeps the KV of the previous prompt's
longest common prefix, which is what the warm prefix TTFT measures.
"""

from __future__ import annotations

import argparse
import time

import harness
import workloads as wl


class LlamaCppEngine(harness.Engine):
    name = "llama.cpp (python)"
    notes = {
        "decode_b32_tok_s": "not measured: llama-cpp-python's Llama decodes one sequence at a time (no batch)",
        "throughput_64_tok_s": "serial: one request after another (no ratio: unlike continuous batching)",
        "prefix_warm_ttft_s": "reuses the previous prompt's KV (longest common prefix)",
    }
    unlike = frozenset({"throughput_64_tok_s"})

    def load(self, args: argparse.Namespace) -> None:
        from llama_cpp import Llama

        self._llm = Llama(
            model_path=str(args.gguf),
            n_ctx=wl.MODEL_CONTEXT,
            n_batch=512,
            n_threads=wl.THREADS,
            n_threads_batch=wl.THREADS,
            verbose=False,
        )

    def version(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}, Q4_1 GGUF"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        return [self.decode_timeline([prompt], max_tokens)[-1][1] for prompt in prompts]

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
        if len(prompts) != 1:
            raise NotImplementedError("llama-cpp-python's Llama has no batched decode")
        timeline: list[tuple[float, int]] = []
        for _ in self._llm.generate(prompts[0], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            timeline.append((time.perf_counter(), len(timeline) + 1))  # never stops on EOS: ignore_eos
            if len(timeline) == max_tokens:
                break
        return timeline


if __name__ == "__main__":
    harness.run_main(LlamaCppEngine)
