"""Peer runner: Hugging Face transformers `generate` (CPU, bf16 unless --dtype) on the exported SmolLM2 folder.

    $GLMSERVE_BENCH_DIR/transformers/bin/python bench/peer_transformers.py \
        --workloads W.json --hf-dir $GLMSERVE_BENCH_DIR/smollm2-bf16

Batches use left padding and run as static batches of at most 32 (the KV cache is recomputed
for every request: transformers has no cross-request prefix cache).
"""

from __future__ import annotations

import argparse
import time

import harness
import workloads as wl

BATCH = 32


class TransformersEngine(harness.Engine):
    name = "transformers"
    notes = {
        "decode_b32_tok_s": "one left-padded static batch of 32",
        "throughput_64_tok_s": "static left-padded batches of 32 in submission order",
        "prefix_warm_ttft_s": "no cross-request prefix cache: warm recomputes the prefix",
    }

    def load(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(wl.THREADS)
        self._torch = torch
        self._dtype = args.dtype or "bfloat16"
        self._model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=getattr(torch, self._dtype)).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def version(self) -> str:
        import torch
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}, {self._dtype}"

    def _batch(self, prompts: list[list[int]], max_tokens: int, streamer: object = None) -> list[int]:
        torch = self._torch
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # ignore_eos
                pad_token_id=self._pad,
                streamer=streamer,
            )
        return [out.shape[1] - width] * len(prompts)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        counts: list[int] = []
        for start in range(0, len(prompts), BATCH):
            counts += self._batch(prompts[start : start + BATCH], max_tokens)
        return counts

    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
        if len(prompts) > BATCH:
            raise NotImplementedError(f"one static batch holds at most {BATCH} prompts")
        calls: list[float] = []

        class Clock:  # transformers' streamer protocol: put(the prompt ids), then put(the [B] new tokens) per step
            def put(self, value: object) -> None:
                calls.append(time.perf_counter())

            def end(self) -> None:
                pass

        self._batch(prompts, max_tokens, Clock())
        return [(t, i * len(prompts), len(prompts)) for i, t in enumerate(calls)][1:]  # static batch: all at once


if __name__ == "__main__":
    harness.run_main(TransformersEngine)
