"""llama.cpp's own perplexity on a text file (the `llama-perplexity` tool), for bench_quality.py.

`llama-perplexity -f TEXT -c CTX -b CTX` (tools/perplexity/perplexity.cpp, `perplexity()`) tokenizes the whole
file, cuts it into non-overlapping CTX-token chunks, evaluates each on its own (-b CTX: one chunk per batch, as
our API scores one window per request), scores each chunk's second half and prints "Final estimate: PPL = X".
bench/quality_metrics.py cuts our windows the same way. With `--kl-divergence-base FILE` it also saves what it
scored: after the header ("_logits_", n_ctx, n_vocab, n_chunk) the token ids of every chunk, then per scored
position (ctx/2 .. ctx-2 of each chunk) its log-probabilities over the vocabulary, quantized to uint16
(perplexity.cpp `log_softmax(..., uint16_t *)`: two floats scale and min log-prob, then round((logit -
min_logit) / scale) per token, 0 for logits at or below min_logit = max_logit - 16). `read_logits` decodes
that into the token ids and, per chunk, a `Scored` (logprob of each next token, top-N), so llama.cpp's
distribution is compared with ours position by position, on token ids checked to be ours.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llama_server import NO_REPACK
from quality_metrics import Scored

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


@dataclass(frozen=True)
class LlamaPerplexity:
    ppl: float  # llama-perplexity's printed final estimate
    stderr: float
    chunks: list[list[int]]  # the token ids of each chunk it evaluated
    scored: list[Scored]  # per chunk, decoded from the saved log-probabilities


def llama_perplexity(binary: Path, gguf: str, text: Path, ctx: int, threads: int, top: int, log: Path
                     ) -> LlamaPerplexity:
    """Run llama-perplexity on `text` (output to `log`, logits next to it, removed after reading)."""
    logits = log.with_suffix(".logits")
    cmd = [str(binary), "-m", gguf, "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
           "-tb", str(threads), "--kl-divergence-base", str(logits), *NO_REPACK]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    output = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n" + output)
    final = _FINAL.search(output)
    if proc.returncode != 0 or not final:
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise RuntimeError(f"llama-perplexity exited {proc.returncode} without a final estimate:\n{tail}")
    try:
        chunks, scored = read_logits(logits, top)
    finally:
        logits.unlink(missing_ok=True)
    return LlamaPerplexity(float(final.group(1)), float(final.group(2)), chunks, scored)


def read_logits(path: Path, top: int) -> tuple[list[list[int]], list[Scored]]:
    """Token ids per chunk and, per chunk, the scored positions' next-token logprob and top-`top` logprobs."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw[:8].tobytes() != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(v) for v in raw[8:20].view(np.int32))
    tokens = raw[20:20 + 4 * n_ctx * n_chunk].view(np.int32).reshape(n_chunk, n_ctx)
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    nv = 2 * ((n_vocab + 1) // 2) + 4
    records = raw[20 + 4 * n_ctx * n_chunk:].view(np.uint16).reshape(n_chunk, per_chunk, nv)
    head = np.ascontiguousarray(records[..., :4]).view(np.float32)  # [chunk, pos, 2]: scale, min log-prob
    q = records[..., 4:4 + n_vocab].astype(np.float32)
    logprobs = head[..., 1:2] + head[..., 0:1] * q  # q == 0: at or below the floor, kept at the floor
    scored = []
    for c in range(n_chunk):
        targets = tokens[c, first + 1:]
        ids = np.argsort(-logprobs[c], axis=-1)[:, :top]
        scored.append(Scored(
            logprobs[c, np.arange(per_chunk), targets].astype(float).tolist(),
            [{int(t): float(row[t]) for t in row_ids} for row, row_ids in zip(logprobs[c], ids)],
        ))
    return tokens.tolist(), scored
