"""Builds the flat batch of a step (tokens, positions, slot mapping, the rows' `StepRows`), lets the model's
attention backend build its groups from them (`model.attention_metadata`), runs the model and samples.
Batch metadata is computed with tensor ops, once per step.
"""

from __future__ import annotations

import torch

from glmserve import kernels
from glmserve.engine.outputs import TokenLogprob
from glmserve.engine.prompt_logprobs import PromptRows
from glmserve.engine.sampler import sample
from glmserve.engine.scheduler import ScheduledSeq
from glmserve.engine.sequence import Sequence
from glmserve.kv.kv_format import KVFormat
from glmserve.kv.offload import RunningKVOffload
from glmserve.kv.slots import slots_of, table_tensor
from glmserve.layers.paged_metadata import StepRows
from glmserve.sparse.pinning import QuestionObservation, decode_pins


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_format: KVFormat, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        # block 0 is the null block: never allocated, zeroed, the target of padded slot indices
        self.kv_cache = model.bind_kv_cache(num_blocks * block_size, kv_format, device, zero_slots=block_size)
        self.offload: RunningKVOffload | None = None  # KV offload of sequences longer than the pool

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Runs one step; returns (sequence, sampled token, logprob) for sequences that sample. The kernel
        dispatch is looked up once per op for the step (kernels.pinned), not in every layer."""
        with kernels.pinned():
            return self._execute(batch)

    def _execute(self, batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        batch = sorted(batch, key=lambda s: s.num_new_tokens != 1)  # decode group first
        input_ids, step, logits_index = self._prepare(batch)
        sampling = [s.seq for s in batch if s.samples]
        rows = self._prompt_rows(batch, step)
        index = logits_index if rows is None else torch.cat([logits_index, rows.index])
        logits = self.model(input_ids, step.positions, self.model.attention_metadata(step), index)
        if rows is not None:
            rows.score(logits[len(logits_index):])  # the prompt rows follow the sampling rows
            logits = logits[:len(logits_index)]
        if step.observe is not None:
            step.observe.assign()  # question-pinned units of the sequences whose prompt ended
        if not sampling:
            return []
        tokens, logprobs = sample(logits, sampling)
        return list(zip(sampling, tokens, logprobs))

    def _prompt_rows(self, batch: list[ScheduledSeq], step: StepRows) -> PromptRows | None:
        """The step's rows that score prompt tokens (SamplingParams.prompt_logprobs), None when there are none."""
        if all(s.seq.prompt_scores is None for s in batch):
            return None
        first_rows = (torch.cumsum(step.lens, 0) - step.lens).tolist()
        return PromptRows.plan([(s.seq.prompt_scores, s.seq.token_ids, start, s.num_new_tokens, row)
                                for s, start, row in zip(batch, step.starts.tolist(), first_rows)], self.device)

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, StepRows, torch.Tensor]:
        """The flat batch's token ids, the step's rows (positions, slots, what the model's attention metadata
        builder needs) and the flat index of each token that samples."""
        dev = self.device
        bs = self.block_size
        seqs = [s.seq for s in batch]
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
        prefill = slice(num_decode, len(batch))
        observe = QuestionObservation.for_prefill(seqs[prefill], tables[prefill], starts[prefill], lens[prefill],
                                                  (cu - lens)[prefill], bs, dev, spans[prefill], self.offload
                                                  ) if num_decode < len(batch) else None
        step = StepRows(tables=tables, starts=starts, lens=lens, positions=positions.to(dev),
                        slot_mapping=slot_mapping.to(dev), block_size=bs, device=dev,
                        sparse=[s.sparse for s in seqs], pins=[s.sparse_pins for s in seqs],
                        decode_pins=decode_pins(seqs[:num_decode], dev), spans=spans, offload=self.offload,
                        observe=observe)
        return torch.tensor(tokens, dtype=torch.long, device=dev), step, logits_index.to(dev)
