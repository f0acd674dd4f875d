"""bench/peer_llamacpp_ppl.py reads llama-perplexity's --kl-divergence-base file: a file written the way
perplexity.cpp writes it (header, token ids, per scored position two floats and uint16 log-probabilities)
decodes back to the token ids and to log-probabilities within the format's quantization step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from peer_llamacpp_ppl import read_logits  # noqa: E402


def _encode(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp log_softmax(n_vocab, logits, uint16_t *, tok) for one position."""
    n_vocab = logits.shape[0]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    max_logit = float(logits.max())
    min_logit = max(float(logits.min()), max_logit - 16)
    log_sum_exp = float(np.log(np.exp(logits - max_logit).sum()))
    scale = (max_logit - min_logit) / 65535.0
    out = np.zeros(nv, dtype=np.uint16)
    out[:4] = np.array([scale, min_logit - max_logit - log_sum_exp], dtype=np.float32).view(np.uint16)
    out[4:4 + n_vocab] = np.where(logits > min_logit, np.rint((logits - min_logit) / scale), 0).astype(np.uint16)
    return out


def test_read_logits_decodes_tokens_and_logprobs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n_ctx, n_vocab, n_chunk = 8, 7, 2
    tokens = rng.integers(0, n_vocab, size=(n_chunk, n_ctx)).astype(np.int32)
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    logits = rng.normal(0, 3, size=(n_chunk, per_chunk, n_vocab)).astype(np.float32)
    path = tmp_path / "base.logits"
    with path.open("wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx, n_vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(tokens.tobytes())
        for c in range(n_chunk):
            for i in range(per_chunk):
                f.write(_encode(logits[c, i]).tobytes())
    chunks, scored = read_logits(path, top=3)
    assert chunks == tokens.tolist()
    shifted = logits - logits.max(axis=-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    for c in range(n_chunk):
        targets = tokens[c, first + 1:]
        assert scored[c].logprobs == pytest.approx(expected[c, np.arange(per_chunk), targets], abs=1e-3)
        for i, top in enumerate(scored[c].tops):
            assert set(top) == set(np.argsort(-expected[c, i])[:3].tolist())
