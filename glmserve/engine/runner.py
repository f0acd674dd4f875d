"""Builds the flat batch of a step (tokens, positions, slot mapping, attention groups),
runs the model and samples. Batch metadata is computed with tensor ops, once per step.
"""

from __future__ import annotations

import torch

from glmserve.engine.outputs import TokenLogprob
from glmserve.engine.sampler import sample
from glmserve.engine.scheduler import ScheduledSeq
from glmserve.engine.sequence import Sequence
from glmserve.kv.offload import ColdSpan, RunningKVOffload
from glmserve.kv.slots import slots_of, table_tensor
from glmserve.layers.attention import AttentionMetadata, GroupMetadata
from glmserve.layers.offloaded_attention import ColdRows
from glmserve.sparse.pinning import QuestionObservation, decode_pins
from glmserve.sparse.selection import SparseRows
from glmserve.sparse_settings import SparseAttentionParams


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        # block 0 is the null block: never allocated, zeroed, the target of padded slot indices
        self.kv_cache = model.bind_kv_cache(num_blocks * block_size, kv_dtype, device, zero_slots=block_size)
        self.native_sparse = bool(getattr(model, "native_sparse_attention", False))
        self.offload: RunningKVOffload | None = None  # KV streaming of sequences longer than the pool

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Runs one step; returns (sequence, sampled token, logprob) for sequences that sample."""
        batch = sorted(batch, key=lambda s: s.num_new_tokens != 1)  # decode group first
        input_ids, positions, meta, logits_index = self._prepare(batch)
        sampling = [s.seq for s in batch if s.samples]
        logits = self.model(input_ids, positions, meta, logits_index)
        if meta.prefill is not None and meta.prefill.observe is not None:
            meta.prefill.observe.assign()  # question-pinned units of the sequences whose prompt ended
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
        tables = table_tensor([s.seq.kv.block_table for s in batch])
        cu = torch.cumsum(lens, 0)
        qi = torch.arange(int(lens.max()))[None, :]
        new = qi < lens[:, None]  # [B, Q]: the rows' new tokens, row by row
        positions = (starts[:, None] + qi)[new]
        slot_mapping = slots_of(tables, starts[:, None] + qi, bs)[new]
        samples = torch.tensor([s.samples for s in batch])
        logits_index = (cu - 1)[samples]  # last token of each chunk that ends its sequence
        spans = [self.offload.span(s.seq.kv) if self.offload is not None else None for s in batch]

        num_decode = int((lens == 1).sum())
        decode = prefill = None
        if num_decode:
            rows = slice(0, num_decode)
            decode = self._group(tables[rows], starts[rows], lens[rows], None, spans[rows])
            # a row that streams offloaded chunks selects apart (ColdRows.params, see PagedAttention._decode)
            params = [s.seq.sparse if sp is None else SparseAttentionParams()
                      for s, sp in zip(batch[rows], spans[rows])]
            if decode.cold is not None:
                decode.cold.params = [batch[r].seq.sparse for r in decode.cold.rows]
                decode.cold.pins = [batch[r].seq.sparse_pins for r in decode.cold.rows]
            # rows all dense on a model without its own indexer: the dense fast path
            if self.native_sparse or any(p.mode != "dense" for p in params):
                decode.sparse = SparseRows.from_params(params, dev, decode_pins([s.seq for s in batch[rows]], dev))
            if decode.sparse is not None or decode.cold is not None:
                decode.block_tables = tables[rows].to(dev)
        if num_decode < len(batch):
            rows = slice(num_decode, len(batch))
            first_token = (cu - lens)[rows]
            prefill = self._group(tables[rows], starts[rows], lens[rows], first_token - first_token[0], spans[rows])
            prefill.observe = QuestionObservation.for_prefill([s.seq for s in batch[rows]], tables[rows], starts[rows],
                                                      lens[rows], first_token, bs, dev, spans[rows], self.offload)
        meta = AttentionMetadata(slot_mapping=slot_mapping.to(dev), decode=decode, prefill=prefill)
        return (torch.tensor(tokens, dtype=torch.long, device=dev), positions.to(dev), meta, logits_index.to(dev))

    def _group(self, tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
               query_offsets: torch.Tensor | None, spans: list[ColdSpan | None]) -> GroupMetadata:
        """Attention metadata of the decode group (`query_offsets` None) or the prefill group. `spans`: each row's
        offloaded chunks (glmserve/kv/offload.py) or None; keys are listed without them (resident keys only)."""
        dev, bs = self.device, self.block_size
        ctx = starts + lens
        num_tokens = int(lens.sum())
        if query_offsets is not None and len(lens) == 1 and int(starts[0]) == 0:
            return GroupMetadata(kv_slots=torch.empty(0), key_mask=None, num_tokens=num_tokens, fresh_causal=True)
        cold = torch.tensor([(sp.start, sp.length) if sp else (0, 0) for sp in spans], dtype=torch.long).view(-1, 2)
        cold_start, cold_len = cold[:, :1], cold[:, 1:]
        resident = ctx - cold_len[:, 0]
        j = torch.arange(int(resident.max()))[None, :]
        key_pos = torch.where(j < cold_start, j, j + cold_len)  # [B, L] positions of resident keys
        in_context = j < resident[:, None]
        # positions past a sequence's context (padding, the unwritten tail of its last block) read the
        # zeroed null block: masked scores times uninitialized values could otherwise give NaN
        kv_slots = torch.where(in_context, slots_of(tables, key_pos, bs), 0)
        cold_rows = [i for i, sp in enumerate(spans) if sp is not None]
        group_cold = ColdRows(cold_rows, [spans[i].chunks for i in cold_rows], self.offload) if cold_rows else None
        if query_offsets is None:  # decode: one query per row
            mask = in_context[:, None, :]  # [B, 1, L] against scores [Hkv, B, g, L]
            return GroupMetadata(kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
                                 context_lens=resident.to(dev), cold=group_cold)
        qlen = int(lens.max())
        qi = torch.arange(qlen)
        query_pos = starts[:, None] + qi[None, :]  # [B, Q]
        mask = ((key_pos[:, None, :] <= query_pos[:, :, None]) & in_context[:, None, :])[:, None]  # [B, 1, Q, L]
        query_index = query_offsets[:, None] + torch.minimum(qi[None, :], lens[:, None] - 1)
        valid = (qi[None, :] < lens[:, None]).reshape(-1).nonzero()[:, 0]
        return GroupMetadata(
            kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
            query_index=query_index.to(dev), valid_index=valid.to(dev), cold=group_cold,
        )
