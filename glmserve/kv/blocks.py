"""Paged KV block allocator with automatic prefix caching.

A block holds `block_size` tokens of KV for every layer. Full blocks get a chained hash
(parent hash, token ids, extra keys such as a cache salt); a later sequence whose prompt
starts with the same blocks reuses them. The hash is a 128-bit blake2b digest (an int), stable
across processes and machines, so that it can name KV that leaves the process (tiers, sessions).
Freed blocks keep their hash and go to an LRU free list, so they can still be hit until the
allocator needs them for something else (the scheme of vLLM's automatic prefix caching;
nano-vllm's BlockManager is a small example).

With KV tiers attached (`attach_tiers`, glmserve/kv/tiers.py), the prefix cache spans them: every
`chunk_blocks` full blocks from the start of a sequence form a chunk named by its last block's hash; when
the first of a chunk's blocks is evicted, the whole chunk is handed to the tiers (its blocks still hold
their KV then), and `match_prefix` continues a prompt past its device-resident prefix by loading chunks
back from the tiers into free blocks, which become ordinary cached blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from glmserve.kv.seq_kv import OFFLOADED, SeqKV

if TYPE_CHECKING:
    from glmserve.kv.tiers import KVTiers

HASH_BYTES = 16


def block_hash(parent: int | None, token_ids: list[int] | tuple[int, ...], extra: str | None) -> int:
    """Chained block hash: blake2b-128 of (parent digest, token ids as int64, extra key), as an int.

    Stable across restarts (unlike `hash()` of a str); `None` parent and `None` extra are encoded apart
    from any real digest or string.
    """
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(b"\x00" * (HASH_BYTES + 1) if parent is None else b"\x01" + parent.to_bytes(HASH_BYTES, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\x01" + extra.encode())
    return int.from_bytes(h.digest(), "little")


NULL_BLOCK = 0  # never handed out: padded slot indices point at it, and its KV is zeros (glmserve/kv/slots.py)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        """`num_blocks` counts the pool's blocks; block 0 is reserved (the null block), the others are usable."""
        self.num_usable_blocks = num_blocks - 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_to_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # free blocks in eviction order: first = evicted first
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks) if b != NULL_BLOCK)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found
        self.tiers: KVTiers | None = None
        self.chunk_members: dict[int, tuple[int, ...]] = {}  # chunk (its last block's hash) -> block hashes
        self.block_chunk: list[int | None] = [None] * num_blocks  # the chunk a cached block belongs to

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Spill evicted chunks to `tiers` and load prefixes back from them (needs prefix caching)."""
        if self.enable_prefix_caching:
            self.tiers = tiers

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, kv: SeqKV, num_new_tokens: int) -> int:
        total = kv.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(kv.block_table))

    # -- prefix cache -------------------------------------------------------------------------
    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """Chained hashes of the full blocks of `token_ids`."""
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, token_ids[start:start + self.block_size], cache_salt)
            hashes.append(parent)
        return hashes

    def protect_free_hits(self, hit_blocks: list[int]) -> int:
        """Cached blocks a prompt is about to reuse go to the back of the free list, out of reach of the
        blocks taken from its front for the same prompt; returns how many of them are free."""
        free_hits = [b for b in hit_blocks if self.ref_counts[b] == 0]
        for b in free_hits:
            self.free_blocks.move_to_end(b)
        return len(free_hits)

    def device_prefix(self, hashes: list[int]) -> list[int]:
        """The pool blocks caching the leading run of `hashes` (stops at the first one not in the pool)."""
        hits = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def match_prefix(self, kv: SeqKV) -> list[int]:
        """Cached blocks that cover the start of the sequence's tokens (not yet referenced)."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.prompt_block_hashes(kv.token_ids, kv.cache_salt)
        hits = self.device_prefix(hashes)
        if self.tiers is not None and len(hits) < len(hashes):
            hits += self._load_from_tiers(hashes, hits)
        return hits

    def _load_from_tiers(self, hashes: list[int], hits: list[int]) -> list[int]:
        """Loads the chunks that continue the device hits from the tiers; returns the blocks they fill."""
        assert self.tiers is not None
        cb = self.tiers.chunk_blocks
        room = len(self.free_blocks) - self.protect_free_hits(hits)
        start, loaded = len(hits), []
        first_chunk = start // cb
        found = self.tiers.find(hashes[(first_chunk + 1) * cb - 1::cb])
        for c, held in enumerate(found, first_chunk):
            first = start - c * cb
            last = hashes[(c + 1) * cb - 1]
            if cb - first > room:
                break
            blocks = self.take_free_blocks(cb - first)
            if not self.tiers.load(last, held, blocks, first):
                for b in blocks:
                    self._release(b)
                break
            self.cache_blocks(blocks, hashes[start:start + len(blocks)])
            self._register_chunk(hashes[c * cb:(c + 1) * cb])
            loaded += blocks
            room -= len(blocks)
            start += len(blocks)
        return loaded

    def cache_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Blocks taken with `take_free_blocks` and filled with the KV of `hashes` become cached and free
        (most recently used), as if computed and freed; a hash cached in another block moves here."""
        for block, h in zip(blocks, hashes):
            old = self.hash_to_block.get(h)
            if old is not None:
                self.block_to_hash[old] = None
            self.hash_to_block[h] = block
            self.block_to_hash[block] = h
            self.ref_counts[block] = 0
            self.free_blocks[block] = None

    def _release(self, block: int) -> None:
        """A block taken but not filled goes back to the front of the free list."""
        self.ref_counts[block] = 0
        self.free_blocks[block] = None
        self.free_blocks.move_to_end(block, last=False)

    def _register_chunk(self, member_hashes: list[int]) -> None:
        last = member_hashes[-1]
        if last in self.chunk_members:
            return
        self.chunk_members[last] = tuple(member_hashes)
        for h in member_hashes:
            block = self.hash_to_block.get(h)
            if block is not None:
                self.block_chunk[block] = last

    def _spill(self, block: int) -> None:
        """`block` is about to be reused: hand its whole chunk to the tiers if all its blocks hold their KV."""
        assert self.tiers is not None
        last, self.block_chunk[block] = self.block_chunk[block], None
        members = self.chunk_members.pop(last, None) if last is not None else None
        if members is None:
            return
        blocks = [self.hash_to_block.get(h) for h in members]
        for b in blocks:
            if b is not None:
                self.block_chunk[b] = None
        if None not in blocks:
            self.tiers.save(last, blocks)  # type: ignore[arg-type]

    def admit(self, kv: SeqKV, hit_blocks: list[int], recomputed_tail: int) -> None:
        """Give a waiting sequence its cached prefix blocks and set its computed-token count: the cached tokens
        but its last `recomputed_tail` (at least 1: the logits of the next token need the last one computed)."""
        assert not kv.block_table and recomputed_tail >= 1
        for b in hit_blocks:
            self._ref(b)
        kv.block_table = list(hit_blocks)
        kv.block_hashes = [self.block_to_hash[b] for b in hit_blocks]  # type: ignore[misc]
        cached = len(hit_blocks) * self.block_size
        kv.num_computed_tokens = min(cached, kv.num_tokens - recomputed_tail)
        first_admission = kv.num_tokens == kv.num_prompt_tokens
        if first_admission:
            kv.num_cached_tokens = kv.num_computed_tokens
            self.prefix_cache_queries += kv.num_prompt_tokens
            self.prefix_cache_hits += kv.num_computed_tokens

    # -- allocation -----------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def take_free_blocks(self, n: int) -> list[int]:
        """Takes `n` blocks from the front of the free list (least recently used first), dropping their cached
        hashes (their chunk goes down to the tiers first, if any); the caller checked there are enough."""
        return [self._take_free_block() for _ in range(n)]

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_to_hash[block]
        if old is not None:
            if self.tiers is not None:
                self._spill(block)
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_to_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, kv: SeqKV, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (nothing changed) if full."""
        needed = self.blocks_needed(kv, num_new_tokens)
        if needed > len(self.free_blocks):
            return False
        kv.block_table.extend(self.take_free_blocks(needed))
        return True

    def register_full_blocks(self, kv: SeqKV) -> None:
        """Hash the blocks that became full since the last call so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(kv.num_computed_tokens // self.block_size, len(kv.block_table))
        parent = kv.block_hashes[-1] if kv.block_hashes else None
        for i in range(len(kv.block_hashes), num_full):
            start = i * self.block_size
            parent = block_hash(parent, kv.token_ids[start:start + self.block_size], kv.cache_salt)
            kv.block_hashes.append(parent)
            block = kv.block_table[i]
            if self.block_to_hash[block] is None and parent not in self.hash_to_block:
                self.block_to_hash[block] = parent
                self.hash_to_block[parent] = block
            if self.tiers is not None and (i + 1) % self.tiers.chunk_blocks == 0:
                self._register_chunk(kv.block_hashes[i + 1 - self.tiers.chunk_blocks:])

    def _unref(self, block: int) -> None:
        """One reference less; an unreferenced block becomes free: evicted last while it holds a cached hash,
        first otherwise."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.block_to_hash[block] is None:
                self.free_blocks.move_to_end(block, last=False)

    def release_blocks(self, kv: SeqKV, first: int, last: int) -> None:
        """Entries `first:last` of the sequence's block table leave it (their KV was offloaded, see
        glmserve/kv/offload.py): references dropped, entries set to OFFLOADED. The blocks stay cached
        by hash while free; their chunk is not spilled to the tiers again."""
        for i in range(first, last):
            block = kv.block_table[i]
            chunk = self.block_chunk[block]
            if chunk is not None:
                self.chunk_members.pop(chunk, None)
                self.block_chunk[block] = None
            self._unref(block)
            kv.block_table[i] = OFFLOADED

    def free(self, kv: SeqKV) -> None:
        """Drop the sequence's references; blocks at the end of a sequence are evicted first."""
        for block in reversed(kv.block_table):
            if block != OFFLOADED:  # released by release_blocks already
                self._unref(block)
        kv.block_table = []
        kv.block_hashes = []
        kv.num_computed_tokens = 0
