"""Peer runner: llama-cpp-python on the SmolLM2 Q4_1 GGUF, CPU, n_threads=2.

    $GLMSERVE_BENCH_DIR/llamacpp/bin/python bench/peer_llamacpp.py --workloads W.json --gguf PATH

`Llama` holds one sequence, so batches run one request after another (decode_b32 and the
throughput run are serial). Its built-in prompt reuse keeps the KV of the previous prompt's
longest common prefix, which is what the warm prefix TTFT measures.
"""

from __future__ import annotations

import argparse

import harness
import workloads as wl


class LlamaCppEngine(harness.Engine):
    name = "llama.cpp (python)"
    notes = {
        "decode_b32_tok_s": "serial: llama-cpp-python's Llama runs one sequence at a time",
        "throughput_64_tok_s": "serial: one request after another",
        "prefix_warm_ttft_s": "reuses the previous prompt's KV (longest common prefix)",
    }

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

    def _one(self, prompt: list[int], max_tokens: int) -> int:
        produced = 0
        for _ in self._llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            produced += 1  # the generator never stops on EOS by itself: ignore_eos
            if produced == max_tokens:
                break
        return produced

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        return [self._one(prompt, max_tokens) for prompt in prompts]


if __name__ == "__main__":
    harness.run_main(LlamaCppEngine)
