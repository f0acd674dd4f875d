"""Peer runner for bench_quality.py: llama.cpp's next-token logprobs (llama-cpp-python) on the same windows.

    $GLMSERVE_BENCH_DIR/llamacpp/bin/python bench/peer_llamacpp_ppl.py --gguf PATH --windows W.json --out R.json

W.json: {"ctx": C, "top": N, "threads": T, "windows": [{"tokens": [...], "first_scored": k}, ...]}. Each window is
evaluated from an empty KV cache (as llama-perplexity evaluates each chunk) with the logits of every position
kept; R.json gets, per window, the logprob of each scored token and the top-N alternatives of its position.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--windows", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from llama_cpp import Llama, __version__

    spec = json.loads(open(args.windows).read())
    llm = Llama(model_path=args.gguf, n_ctx=spec["ctx"], n_batch=spec["ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], logits_all=True, verbose=False)
    top = spec["top"]
    results = []
    for window in spec["windows"]:
        tokens, first = window["tokens"], window["first_scored"]
        llm.reset()  # the next eval starts from an empty KV cache
        llm.eval(tokens)
        logprobs = log_softmax(np.asarray(llm.scores[first - 1:len(tokens) - 1], dtype=np.float64))
        targets = np.asarray(tokens[first:])
        ids = np.argsort(-logprobs, axis=-1)[:, :top]
        results.append({
            "logprobs": logprobs[np.arange(len(targets)), targets].tolist(),
            "tops": [[[int(t), float(row[t])] for t in row_ids] for row, row_ids in zip(logprobs, ids)],
        })
    with open(args.out, "w") as f:
        json.dump({"version": f"llama-cpp-python {__version__}", "windows": results}, f)


if __name__ == "__main__":
    main()
