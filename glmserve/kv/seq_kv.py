"""One sequence's KV record: which pool blocks hold its tokens' KV, their prefix hashes, how far it is computed.

The engine's `Sequence` holds one (`seq.kv`); the KV side changes it: the BlockManager (glmserve/kv/blocks.py)
fills and frees its block table, RunningKVOffload (glmserve/kv/offload.py) takes chunks of it out of the pool.
kv/ never sees a Sequence: what the allocator needs of one (its tokens, prompt length, cache salt) is here, and
what the engine decides (how many cached tokens a prefix hit still recomputes) comes as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OFFLOADED = -1  # a block-table entry whose KV left the pool (glmserve/kv/offload.py): it holds no pool block


@dataclass(eq=False)
class SeqKV:
    """The KV side of one sequence (compared by identity)."""

    kv_id: int  # stable for the sequence's life: names its offloaded chunks
    token_ids: list[int]  # the sequence's own token list (it appends generated tokens to it)
    num_prompt_tokens: int
    cache_salt: str | None = None  # an extra key of every block hash: other salts never share blocks
    block_table: list[int] = field(default_factory=list)  # pool block of each block of tokens, or OFFLOADED
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks registered so far
    num_computed_tokens: int = 0  # tokens whose KV is written
    num_cached_tokens: int = 0  # prefix-cache hit at the first admission

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def resident_prefix_blocks(self) -> int:
        """Leading block-table entries in the pool: up to the first offloaded one (all when none is)."""
        table = self.block_table
        return table.index(OFFLOADED) if OFFLOADED in table else len(table)
