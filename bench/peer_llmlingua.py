"""LongLLMLingua's document ranking as a peer of bench/bench_compress.py; runs in its own venv
(bench/setup_peers.sh llmlingua: ~/.cache/glmserve-bench/llmlingua), never imports glmserve.

    ~/.cache/glmserve-bench/llmlingua/bin/python bench/peer_llmlingua.py --model DIR < request.json > answer.jsonl

request.json: {"chunks": [text, ...], "questions": [text, ...]}. For each question one JSON line: {"order": chunk
indices, best first, "seconds": wall time}. The ranking is llmlingua's own `PromptCompressor.get_rank_results(...,
rank_method="longllmlingua", condition_in_question="after")` (Jiang et al., "LongLLMLingua", ACL 2024: documents
ranked by the perplexity of the question conditioned on each document), with its scoring causal LM pointed at a
local transformers folder (the embedded SmolLM2 exported by setup_peers.sh, not its default 7B Llama-2).

One thread by default: the scorer (135M, float32, llmlingua's own dtype on CPU) runs once per chunk with the
question appended (~300 tokens per forward, never the whole context), about 0.6 s per chunk on one core here. With
2 threads on a shared 2-core machine each forward waits on the other thread's time slice: 4 s per chunk at load 6
(7x slower), hence the 14 minutes per question first seen at load 17. `--dtype bfloat16` runs the scorer in bf16:
1.7x faster on one core of this AMX CPU; a 30-chunk check ranked the same top 4 chunks as float32, later ones in a
slightly different order.

`PromptCompressor.__init__` also loads tiktoken's gpt-3.5-turbo encoding, which tiktoken downloads on first use;
the ranking never uses it, so the runner builds the object with llmlingua's own `load_model` and the attributes
`__init__` sets, and skips that download.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def compressor(model: str, dtype: str = "float32"):
    import torch
    from llmlingua import PromptCompressor

    pc = PromptCompressor.__new__(PromptCompressor)
    pc.model_name = model
    pc.use_llmlingua2 = False
    pc.retrieval_model = None
    pc.retrieval_model_name = None
    pc.open_api_config = {}
    pc.cache_bos_num = 10
    pc.prefix_bos_num = 100
    pc.load_model(model, "cpu", {"torch_dtype": getattr(torch, dtype)})  # llmlingua's CPU default: float32
    return pc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a transformers causal-LM folder")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    request = json.load(sys.stdin)
    chunks = request["chunks"]
    pc = compressor(args.model, args.dtype)
    lengths = [len(pc.tokenizer(c).input_ids) for c in chunks]
    for question in request["questions"]:
        t = time.perf_counter()
        ranked = pc.get_rank_results(chunks, question, "longllmlingua", "after", lengths)
        print(json.dumps({"order": [int(i) for i, _ in ranked], "seconds": time.perf_counter() - t}), flush=True)


if __name__ == "__main__":
    main()
