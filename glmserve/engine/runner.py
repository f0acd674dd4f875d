"""Builds the flat batch of a step (tokens, positions, slot mapping, attention groups),
runs the model and samples. Batch metadata is computed with tensor ops, once per step.
"""

from __future__ import annotations

import torch

from glmserve.engine.outputs import TokenLogprob
from glmserve.engine.scheduler import ScheduledSeq
from glmserve.engine.sequence import Sequence
from glmserve.layers.attention import AttentionMetadata, GroupMetadata
from glmserve.layers.sampler import sample
from glmserve.sparse.selection import SparseRows


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        # block 0 is the null block: never allocated, zeroed, the target of padded slot indices
        self.kv_cache = model.bind_kv_cache(num_blocks * block_size, kv_dtype, device, zero_slots=block_size)
        self.native_sparse = bool(getattr(model, "native_sparse_attention", False))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Runs one step; returns (sequence, sampled token, logprob) for sequences that sample."""
        batch = sorted(batch, key=lambda s: s.num_new_tokens != 1)  # decode group first
        input_ids, positions, meta, logits_index = self._prepare(batch)
        sampling = [s.seq for s in batch if s.samples]
        logits = self.model(input_ids, positions, meta, logits_index)
        if not sampling:
            return []
        tokens, logprobs = sample(logits, sampling)
        return list(zip(sampling, tokens, logprobs))

    def _prepare(self, batch: list[ScheduledSeq]):
        dev = self.device
        bs = self.block_size
        starts = torch.tensor([s.seq.num_computed_tokens for s in batch])
        lens = torch.tensor([s.num_new_tokens for s in batch])
        tokens: list[int] = []
        for s in batch:
            tokens.extend(s.seq.token_ids[s.seq.num_computed_tokens:s.seq.num_computed_tokens + s.num_new_tokens])
        width = max(len(s.seq.block_table) for s in batch)
        tables = torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in batch])
        num_tokens = int(lens.sum())
        row_of_token = torch.repeat_interleave(torch.arange(len(batch)), lens)
        cu = torch.cumsum(lens, 0)
        offsets = torch.arange(num_tokens) - torch.repeat_interleave(cu - lens, lens)
        positions = starts[row_of_token] + offsets
        slot_mapping = tables[row_of_token, positions // bs] * bs + positions % bs
        samples = torch.tensor([s.samples for s in batch])
        logits_index = (cu - 1)[samples]  # last token of each chunk that ends its sequence

        num_decode = int((lens == 1).sum())
        decode = prefill = None
        if num_decode:
            rows = slice(0, num_decode)
            decode = self._group(tables[rows], starts[rows], lens[rows], query_offsets=None)
            params = [s.seq.sparse for s in batch[rows]]
            # rows all dense on a model without its own indexer: the dense fast path
            if self.native_sparse or any(p.mode != "dense" for p in params):
                decode.sparse = SparseRows.from_params(params, dev)
                decode.block_tables = tables[rows].to(dev)
        if num_decode < len(batch):
            rows = slice(num_decode, len(batch))
            first_token = (cu - lens)[rows]
            prefill = self._group(tables[rows], starts[rows], lens[rows], query_offsets=first_token - first_token[0])
        meta = AttentionMetadata(slot_mapping=slot_mapping.to(dev), decode=decode, prefill=prefill)
        return (torch.tensor(tokens, dtype=torch.long, device=dev), positions.to(dev), meta, logits_index.to(dev))

    def _group(self, tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
               query_offsets: torch.Tensor | None) -> GroupMetadata:
        dev, bs = self.device, self.block_size
        ctx = starts + lens
        num_tokens = int(lens.sum())
        if query_offsets is not None and len(lens) == 1 and int(starts[0]) == 0:
            return GroupMetadata(kv_slots=torch.empty(0), key_mask=None, num_tokens=num_tokens, fresh_causal=True)
        key_pos = torch.arange(int(ctx.max()))
        in_context = key_pos[None, :] < ctx[:, None]
        # positions past a sequence's context (padding, the unwritten tail of its last block) read the
        # zeroed null block: masked scores times uninitialized values could otherwise give NaN
        kv_slots = torch.where(in_context, tables[:, key_pos // bs] * bs + key_pos % bs, 0)
        if query_offsets is None:  # decode: one query per row
            mask = in_context[:, None, :]  # [B, 1, L] against scores [Hkv, B, g, L]
            return GroupMetadata(kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
                                 context_lens=ctx.to(dev))
        qlen = int(lens.max())
        qi = torch.arange(qlen)
        query_pos = starts[:, None] + qi[None, :]  # [B, Q]
        mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # [B, 1, Q, L]
        query_index = query_offsets[:, None] + torch.minimum(qi[None, :], lens[:, None] - 1)
        valid = (qi[None, :] < lens[:, None]).reshape(-1).nonzero()[:, 0]
        return GroupMetadata(
            kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
            query_index=query_index.to(dev), valid_index=valid.to(dev),
        )
