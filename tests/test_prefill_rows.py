"""A step's prefill rows run one attention each (layers/paged_metadata.py `_prefill_group`, `GroupMetadata.rows`):
decode rows, a fresh prompt and chunks after cached context in one step, against plain softmax attention per
sequence in float32."""

from __future__ import annotations

import math

import pytest
import torch

from glmserve.kv.slots import slots_of, table_tensor
from glmserve.layers.attention import PagedAttention
from glmserve.layers.paged_metadata import StepRows, paged_metadata
from glmserve.sparse_settings import SparseAttentionParams

HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 4


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., keys/values [start + n, Hkv, D] -> [n, H * D], causal."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(DIM)  # [H, n, L]
    visible = torch.arange(len(keys))[None, :] <= (start + torch.arange(len(q)))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).reshape(len(q), HEADS * DIM)


@pytest.mark.parametrize("rows", [
    [(9, 1), (0, 7), (5, 3), (0, 12), (2, 6)],  # decode, fresh, chunk after context, fresh, chunk
    [(0, 5), (0, 30)],  # only fresh prompts of unequal lengths
    [(13, 1), (6, 2), (17, 9)],  # only chunks after cached context
])
def test_rows_match_per_sequence_attention(rows):
    gen = torch.Generator().manual_seed(len(rows))
    starts = torch.tensor([s for s, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    blocks_per_row = [-(-(s + n) // BS) for s, n in rows]
    first_block = torch.cumsum(torch.tensor([1, *blocks_per_row[:-1]]), 0).tolist()  # block 0 is the null block
    tables = table_tensor([list(range(b, b + w)) for b, w in zip(first_block, blocks_per_row)])
    num_slots = (sum(blocks_per_row) + 1) * BS
    attn = PagedAttention(HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM))
    attn.kv_cache = torch.zeros(2, KV_HEADS, num_slots, DIM)
    # every sequence's whole K/V; the cached part is in the pool already, the new part comes with the step
    full_k = [torch.randn(s + n, KV_HEADS, DIM, generator=gen) for s, n in rows]
    full_v = [torch.randn(s + n, KV_HEADS, DIM, generator=gen) for s, n in rows]
    for row, (s, _) in enumerate(rows):
        cached = slots_of(tables[row:row + 1], torch.arange(s)[None], BS)[0]
        attn.kv_cache[0][:, cached] = full_k[row][:s].transpose(0, 1)
        attn.kv_cache[1][:, cached] = full_v[row][:s].transpose(0, 1)
    qi = torch.arange(int(lens.max()))[None, :]
    new = qi < lens[:, None]
    step = StepRows(tables=tables, starts=starts, lens=lens, positions=(starts[:, None] + qi)[new],
                    slot_mapping=slots_of(tables, starts[:, None] + qi, BS)[new], block_size=BS,
                    device=torch.device("cpu"), sparse=[SparseAttentionParams()] * len(rows), pins=[None] * len(rows),
                    decode_pins=None, spans=[None] * len(rows), offload=None, observe=None)
    meta = paged_metadata(step)
    assert meta.prefill is not None and meta.prefill.rows is not None
    assert len(meta.prefill.rows) == sum(1 for s, n in rows if not (n == 1 and s > 0))
    q = torch.randn(int(lens.sum()), HEADS, DIM, generator=gen)
    k = torch.cat([full_k[r][s:] for r, (s, _) in enumerate(rows)])
    v = torch.cat([full_v[r][s:] for r, (s, _) in enumerate(rows)])
    out = attn(q, k, v, meta)
    offset = 0
    for row, (s, n) in enumerate(rows):
        expected = reference(q[offset:offset + n], full_k[row], full_v[row], s)
        torch.testing.assert_close(out[offset:offset + n], expected, atol=2e-5, rtol=1e-4)
        offset += n
