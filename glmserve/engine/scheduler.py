"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step: running sequences first (decodes and unfinished prefill chunks), then waiting
ones in (priority, arrival) order while the token budget and `max_num_seqs` allow. When KV
blocks run out, the running sequence that would be scheduled last is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed (its prefix may still hit
the cache). With KV offload (`offload`, glmserve/kv/offload.py) the scheduler first moves old
chunks of running sequences out of the pool: the one being scheduled, then the others from the
last scheduled; only when none can go does it preempt.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

from glmserve import log_context
from glmserve.engine.sequence import Sequence, SequenceStatus
from glmserve.kv.blocks import BlockManager
from glmserve.kv.offload import RunningKVOffload

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """True when a token is sampled after this chunk: it completes the sequence, which asks for tokens."""
        return self.completes and self.seq.params.max_tokens != 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 offload: RunningKVOffload | None = None):
        self.blocks = block_manager
        self.offload = offload
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0

    # -- queues -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq.kv)
        if self.offload is not None:
            self.offload.drop(seq.kv)

    def _preempt(self, seq: Sequence) -> None:
        with log_context.about(seq.log_id):
            logger.info("request %s preempted (no free KV blocks): its KV is recomputed when it is resumed",
                        seq.request_id)
        self.running.remove(seq)
        self._free(seq)
        self.num_preemptions += 1
        self.add(seq)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier sequence of this step
                continue
            num_new = seq.chunk_tokens(seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq.kv, num_new):
                if self._offload_one(first=seq):
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, scheduled):
                break
            budget -= scheduled[-1].num_new_tokens
        return scheduled

    def _free_hits(self, hits: list[int]) -> int:
        return sum(1 for b in hits if self.blocks.ref_counts[b] == 0)

    def _offload_one(self, first: Sequence | None) -> bool:
        """Moves one old KV chunk of a running sequence out of the pool (`first`'s, else the last scheduled
        one with a chunk to spare); False when offload is off or nothing can go."""
        if self.offload is None:
            return False
        candidates = ([first] if first is not None else []) + self.running[::-1]
        return any(self.offload.offload_oldest(s.kv) for s in candidates)

    def _admit(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq]) -> bool:
        hits = self.blocks.match_prefix(seq.kv) if seq.reads_prefix_cache else []
        while True:
            cached = min(len(hits) * self.blocks.block_size, seq.num_tokens - seq.recomputed_tail)
            num_new = seq.chunk_tokens(cached, budget)
            new_blocks = max(0, -(-(cached + num_new) // self.blocks.block_size) - len(hits))
            if new_blocks + self._free_hits(hits) <= self.blocks.num_free_blocks:
                break
            if self._offload_one(first=None):
                continue
            if self.offload is None or not hits:
                return False
            # offload: a cached prefix as large as the pool leaves no room to go on; its tail is recomputed
            # (and offloaded in turn) instead of waiting for room that never comes
            hits = hits[:max(0, len(hits) - self.offload.chunk_blocks)]
        self.waiting.pop(0)
        self.blocks.admit(seq.kv, hits, seq.recomputed_tail)
        allocated = self.blocks.allocate(seq.kv, num_new)
        assert allocated
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)
        scheduled.append(ScheduledSeq(seq, num_new))
        return True
