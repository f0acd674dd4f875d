"""Where a token's KV lives in the pool, in one hop: block tables as tensors and the slot of a position.

A pool slot holds one token's KV; block `b` owns slots `b * block_size ... (b + 1) * block_size - 1`, so the
KV of position `p` of a sequence is at slot `table[p // block_size] * block_size + p % block_size`
(`slots_of`). Tables built by `table_tensor` read the null block (zeros) wherever a row has no pool block:
padding past its table, and entries whose KV was offloaded (`OFFLOADED`: attention reads those from the
offloaded chunks, glmserve/kv/offload.py).
"""

from __future__ import annotations

import torch

from glmserve.kv.blocks import NULL_BLOCK
from glmserve.kv.seq_kv import OFFLOADED


def table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """[B, W] block tables of the rows, padded with the null block; offloaded entries read the null block."""
    width = max(len(t) for t in tables)
    out = torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.long)
    return out.masked_fill_(out == OFFLOADED, NULL_BLOCK)


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of the KV at each position: `tables` [B, W] (`table_tensor`), `positions` [B, L] per row, or
    [1, L] for every row -> [B, L]. A position past a row's table reads its last entry: callers mask those."""
    blocks = (positions // block_size).clamp(max=tables.shape[1] - 1).expand(tables.shape[0], -1)
    return tables.gather(1, blocks) * block_size + positions % block_size
