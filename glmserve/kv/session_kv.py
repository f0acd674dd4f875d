"""The engine side of session persistence: a finished turn's KV goes out to the `SessionStore`, the
next turn's prompt prefix comes back in as prefix-cache blocks.

Save (engine thread, when sample 0 of a session's request finishes, before its blocks are freed):
the KV of the chunks the store does not have yet is gathered from the pool in one batched copy
(`KVBlockIO.gather`); turning it into bytes and writing it happen in one background writer thread,
so the engine does not wait for the disk or the network. A turn waits for the write of its session's
previous turn before it reads the session, so a client never sees a half-written session; DELETE and
`close()` wait too.

Restore (engine thread, when a request with a session id is added): the prompt's full blocks that
the device prefix cache does not already hold are looked up in the session's chunks (`load_prefix`:
tokens must match exactly, checksums must hold). Loaded blocks are written into free pool blocks
(`KVBlockIO.scatter`, which also refreshes per-block metadata such as block-indexer bounds), get the
same chained hashes the BlockManager gives computed blocks, and are left free-but-cached at the
most-recently-used end, so the request's admission hits them like any cached prefix and counts them
as cached tokens. Nothing is loaded when the pool could not hold the whole prompt anyway.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from glmserve.config import EngineConfig
from glmserve.errors import InvalidRequestError
from glmserve.kv.blocks import BlockManager
from glmserve.kv.chunk_store import ChunkStore, DiskChunkStore
from glmserve.kv.kv_io import KVBlockIO
from glmserve.kv.sessions import SessionStore

logger = logging.getLogger(__name__)

DEFAULT_SESSION_DIR = Path.home() / ".cache" / "glmserve" / "sessions"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_chunk_store(spec: str | None, max_bytes: int, ttl_s: float) -> ChunkStore:
    """The store a `session_store` option names: a directory (None: the default one) or a Redis URL."""
    if spec is not None and spec.startswith(REDIS_SCHEMES):
        from glmserve.kv.redis_store import RedisChunkStore

        # the chunk store's own LRU budget is a backstop above the session cap (whole sessions go first)
        return RedisChunkStore(spec, 2 * max_bytes, prefix="glmserve:sessions:", ttl_s=ttl_s)
    root = Path(spec).expanduser() if spec else DEFAULT_SESSION_DIR
    try:
        return DiskChunkStore(root, 2 * max_bytes)
    except OSError as exc:
        raise InvalidRequestError(f"cannot use the session directory {root}: {exc}") from exc


def open_session_kv(config: EngineConfig, blocks: BlockManager, io: KVBlockIO, identity: str) -> SessionKV | None:
    """The engine's SessionKV for `config.session_store` (None when "off"). A Redis store is connected at
    once (a wrong URL fails the start); a directory is only created when the first session arrives."""
    spec = config.session_store
    if spec == "off":
        return None
    chunk_tokens = config.kv_chunk_tokens  # the tiers' chunk size (a multiple of the block size)

    def open_store() -> SessionStore:
        store = open_chunk_store(spec, config.session_max_bytes, config.session_ttl_s)
        return SessionStore(store, identity, chunk_tokens, config.session_ttl_s, config.session_max_bytes)

    kv = SessionKV(open_store, blocks, io)
    if spec is not None and spec.startswith(REDIS_SCHEMES):
        kv.open()
    return kv


class SessionKV:
    """Moves a session's KV between the engine's paged pool and its SessionStore (opened on first use)."""

    def __init__(self, open_store: Callable[[], SessionStore], blocks: BlockManager, io: KVBlockIO) -> None:
        self._open_store = open_store
        self._store: SessionStore | None = None
        self.blocks = blocks
        self.io = io
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glmserve-session-writer")
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def open(self) -> SessionStore:
        """The session store, opened (directory created, Redis connected) on the first call."""
        with self._lock:
            if self._store is None:
                self._store = self._open_store()
            return self._store

    @property
    def sessions(self) -> SessionStore:
        return self.open()

    # -- writes ---------------------------------------------------------------------------------------
    def save(self, session_id: str, token_ids: list[int], block_table: list[int], num_computed: int) -> None:
        """Persist the KV of the sequence's full, computed blocks (prompt and generated tokens)."""
        self.wait(session_id)
        bs = self.blocks.block_size
        num_blocks = min(num_computed // bs, len(block_table))
        if num_blocks == 0:
            return
        plan = self.sessions.plan_save(session_id, token_ids[:num_blocks * bs])
        chunk_blocks = self.sessions.chunk_tokens // bs
        gathered = []
        for i in plan.new_chunks:
            first = i * chunk_blocks
            ids = block_table[first:first + len(plan.record.chunk_tokens[i]) // bs]
            gathered.append(self.io.gather(torch.tensor(ids, dtype=torch.long)))
        future = self._writer.submit(self._write, plan, gathered)
        with self._lock:
            self._pending[session_id] = future

    def _write(self, plan, gathered: list[torch.Tensor]) -> None:
        try:
            if not self.sessions.commit(plan, [self.io.to_bytes(t) for t in gathered]):
                logger.warning("session %s: the store is full; only part of its KV was saved",
                               plan.record.session_id)
        except Exception:  # a lost save costs a recompute next turn, never the request
            logger.exception("session %s: saving its KV failed", plan.record.session_id)

    def wait(self, session_id: str) -> None:
        """Block until the session's pending write (if any) is done."""
        with self._lock:
            future = self._pending.pop(session_id, None)
        if future is not None:
            future.result()

    def close(self) -> None:
        """Finish every pending write and stop the writer thread."""
        self._writer.shutdown(wait=True)

    # -- reads ----------------------------------------------------------------------------------------
    def restore(self, session_id: str, token_ids: list[int], cache_salt: str | None) -> int:
        """Load the session's stored KV for the start of `token_ids` into the prefix cache; returns how
        many tokens were loaded (those already cached on the device are not counted)."""
        self.wait(session_id)
        if not self.blocks.enable_prefix_caching:
            return 0
        bs = self.blocks.block_size
        hashes = self.blocks.prompt_block_hashes(token_ids, cache_salt)
        cached = self.blocks.hash_to_block
        on_device = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        if on_device == len(hashes):
            return 0
        # the device hits are needed by this request: keep them out of reach of the blocks taken below
        hit_free = self.blocks.protect_free_hits([cached[h] for h in hashes[:on_device]])
        prompt_blocks = -(-len(token_ids) // bs)
        if prompt_blocks - on_device + hit_free > self.blocks.num_free_blocks:
            return 0
        chunk_blocks = self.sessions.chunk_tokens // bs
        first_chunk = on_device // chunk_blocks
        loaded = 0
        for c, payload in enumerate(self.sessions.load_prefix(session_id, token_ids, first_chunk), first_chunk):
            data = self.io.from_bytes(payload)
            start = c * chunk_blocks
            if data is None:
                break
            total = data.numel() // self.io.elems_per_block
            skip = max(0, on_device - start)
            wanted = hashes[start + skip:start + total]
            if len(wanted) != total - skip:  # a chunk longer than the prompt's full blocks: never stored so
                break
            new_blocks = self.blocks.take_free_blocks(len(wanted))
            self.io.scatter(torch.tensor(new_blocks, dtype=torch.long), data, first=skip)
            self.blocks.cache_blocks(new_blocks, wanted)
            loaded += len(new_blocks) * bs
        return loaded

    # -- the HTTP API ---------------------------------------------------------------------------------
    def info(self, session_id: str) -> dict | None:
        self.wait(session_id)
        return self.sessions.info(session_id)

    def delete(self, session_id: str) -> bool:
        self.wait(session_id)
        return self.sessions.delete(session_id)

    def summary(self, session_id: str) -> dict | None:
        """The session's anchoring summary (server/anchoring.py), or None."""
        self.wait(session_id)
        record = self.sessions.record(session_id)
        return None if record is None else record.summary

    def set_summary(self, session_id: str, summary: dict | None) -> None:
        self.wait(session_id)
        self.sessions.set_summary(session_id, summary)
