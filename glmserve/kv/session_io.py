"""The engine side of session persistence: a finished turn's KV goes out to the `SessionStore`, the
next turn's prompt prefix comes back in as prefix-cache blocks.

Save (engine thread, when sample 0 of a session's request finishes, before its blocks are freed):
the KV of the chunks the store does not have yet is gathered from the pool in one batched copy
(`KVBlockIO.gather`); turning it into bytes and writing it happen in one background writer thread,
so the engine does not wait for the disk or the network. A turn waits for the write of its session's
previous turn before it reads the session, so a client never sees a half-written session; DELETE and
`close()` wait too.

A turn that ends early (client gone, server shutting down) saves the KV it computed too, unless that
would replace a longer stored sequence (`partial`): a long prefill cut by a restart is not lost.

Restore, in two halves so that reading never blocks the engine step. `start_restore` (engine thread,
when a request with a session id is added) finds the prompt's full blocks that the device prefix cache
does not hold and hands the slow part to a reader thread: wait for the session's pending write, read
the session's chunks (`load_prefix`: tokens must match exactly, checksums must hold) and turn them into
tensors. The request is not scheduled meanwhile; other requests keep running. `load_restored`
(engine thread, once the read is done) writes the chunks into free pool blocks (`KVBlockIO.scatter`,
which also refreshes per-block metadata such as block-indexer bounds and learned index keys: most of
its cost), one chunk per engine step while other requests run (their step grows by one chunk's copy,
not the whole session's), all at once when nothing else runs. Loaded blocks get the same chained
hashes the BlockManager gives computed blocks and are left free-but-cached at the most-recently-used
end, so the request's admission hits them like any cached prefix and counts them as cached tokens.
A chunk is not loaded when the pool could not hold the rest of the prompt, or when the device prefix
it continues was evicted meanwhile; a missing or corrupt chunk ends the loaded prefix (recomputed).

`SessionKV.stats` counts restores, misses, saves and bytes (the server's /metrics reads it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from glmserve import log_context
from glmserve.errors import InvalidRequestError, SessionStoreUnavailableError
from glmserve.kv.blocks import BlockManager
from glmserve.kv.chunk_store import ChunkStore, DiskChunkStore
from glmserve.kv.kv_io import KVBlockIO
from glmserve.kv.session_store import SavePlan, SessionStore
from glmserve.paths import cache_dir

logger = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
READER_THREADS = 2  # sessions restored at once (each reads its chunks in order)


def open_chunk_store(spec: str | None, max_bytes: int, ttl_s: float) -> ChunkStore:
    """The store a `session_store` option names: a directory (None: `sessions/` in `cache_dir()`) or a Redis URL."""
    if spec is not None and spec.startswith(REDIS_SCHEMES):
        from glmserve.kv.redis_store import RedisChunkStore

        # the chunk store's own LRU budget is a backstop above the session cap (whole sessions go first)
        return RedisChunkStore(spec, 2 * max_bytes, prefix="glmserve:sessions:", ttl_s=ttl_s)
    root = Path(spec).expanduser() if spec else cache_dir() / "sessions"
    try:
        return DiskChunkStore(root, 2 * max_bytes)
    except OSError as exc:
        raise InvalidRequestError(f"cannot use the session directory {root}: {exc}") from exc


def open_session_kv(spec: str | None, blocks: BlockManager, io: KVBlockIO, identity: str, chunk_tokens: int,
                    max_bytes: int, ttl_s: float) -> SessionKV | None:
    """The SessionKV for the `session_store` option `spec` (None when "off"): sessions of KV `identity`, saved in
    chunks of `chunk_tokens` (the tiers' chunk size, a multiple of the block size), expiring after `ttl_s` unused,
    the least recently used dropped over `max_bytes`. A Redis store is connected at once (a wrong URL fails the
    start); a directory is only created when the first session arrives."""
    if spec == "off":
        return None

    def open_store() -> SessionStore:
        store = open_chunk_store(spec, max_bytes, ttl_s)
        return SessionStore(store, identity, chunk_tokens, ttl_s, max_bytes)

    kv = SessionKV(open_store, blocks, io, chunk_tokens)
    if spec is not None and spec.startswith(REDIS_SCHEMES):
        kv.open()
    return kv


@dataclass
class SessionStats:
    """Session KV traffic since the engine started. Restore fields are written by the engine thread,
    save fields by the writer thread; any thread may read them."""

    restores: int = 0  # requests whose prompt went past the device prefix, so the store was read
    restore_misses: int = 0  # ... and gave nothing usable (unknown or expired session, other tokens, bad chunk)
    restored_chunks: int = 0
    restored_tokens: int = 0
    restore_read_seconds: float = 0.0  # reader threads: wait for the session's write, read, verify, to tensors
    restore_load_seconds: float = 0.0  # engine thread: scatter into the pool
    saves: int = 0  # turns written to the store (finished, or ended early with KV worth keeping)
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_failures: int = 0  # the store was full or a write failed (the next turn recomputes the rest)
    save_seconds: float = 0.0  # writer thread: to bytes, checksum, write


@dataclass
class PendingRestore:
    """A session's chunks being read in a reader thread, then loaded, for a request that waits meanwhile."""

    hashes: list[int]  # the prompt's full-block hashes
    prompt_blocks: int  # blocks the whole prompt takes
    first_chunk: int  # the first chunk read (the ones before it were on the device)
    future: Future[tuple[list[torch.Tensor], float]]  # chunks as tensors, seconds spent reading
    chunks: list[torch.Tensor] | None = None  # the read's result, once taken by the engine thread
    next_chunk: int = 0  # index into `chunks` of the next one to load

    def done(self) -> bool:
        return self.future.done()


def wait_for_any(restores: list[PendingRestore], timeout_s: float) -> None:
    """Block until one of `restores` has its data, or `timeout_s` passed."""
    wait([r.future for r in restores], timeout=timeout_s, return_when=FIRST_COMPLETED)


class SessionKV:
    """Moves a session's KV between the engine's paged pool and its SessionStore (opened on first use)."""

    def __init__(self, open_store: Callable[[], SessionStore], blocks: BlockManager, io: KVBlockIO,
                 chunk_tokens: int) -> None:
        self._open_store = open_store
        self._store: SessionStore | None = None
        self.blocks = blocks
        self.io = io
        self.chunk_blocks = chunk_tokens // blocks.block_size
        self.stats = SessionStats()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glmserve-session-writer")
        self._reader = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="glmserve-session-reader")
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

    def store_bytes(self) -> int:
        """Bytes the session store holds (0 before it is opened: no session has been used yet)."""
        store = self._store
        try:
            return 0 if store is None else store.store.nbytes
        except Exception:  # an unreachable store holds nothing this server can use
            return 0

    # -- writes ---------------------------------------------------------------------------------------
    def save(self, session_id: str, token_ids: list[int], block_table: list[int], num_computed: int,
             partial: bool = False) -> None:
        """Persist the KV of the sequence's full, computed blocks (prompt and generated tokens).
        `partial` (a turn that ended early): skipped when it would replace a longer stored sequence."""
        self.wait(session_id)
        bs = self.blocks.block_size
        num_blocks = min(num_computed // bs, len(block_table))
        if num_blocks == 0:
            return
        try:
            plan = self.sessions.plan_save(session_id, token_ids[:num_blocks * bs])
        except Exception:  # an unreachable store (Redis down) costs a recompute next turn, never the engine
            logger.warning("session %s: the session store cannot be reached; this turn's KV is not saved",
                           session_id, exc_info=True)
            self.stats.save_failures += 1
            return
        if partial and plan.replaced_tokens > plan.record.num_tokens:
            return
        gathered = []
        for i in plan.new_chunks:
            first = i * self.chunk_blocks
            ids = block_table[first:first + len(plan.record.chunk_tokens[i]) // bs]
            gathered.append(self.io.gather(torch.tensor(ids, dtype=torch.long)))
        future = self._writer.submit(log_context.carried(self._write), plan, gathered)
        with self._lock:
            self._pending[session_id] = future

    def _write(self, plan: SavePlan, gathered: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        payloads = [self.io.to_bytes(t) for t in gathered]
        try:
            ok = self.sessions.commit(plan, payloads)
            if not ok:
                logger.warning("session %s: the store is full; only part of its KV was saved",
                               plan.record.session_id)
        except Exception:  # a lost save costs a recompute next turn, never the request
            logger.exception("session %s: saving its KV failed", plan.record.session_id)
            ok = False
        stats = self.stats
        written = [i for i in plan.new_chunks if i < len(plan.record.chunk_bytes)]
        stats.saves += 1
        stats.saved_chunks += len(written)
        stats.saved_bytes += sum(plan.record.chunk_bytes[i] for i in written)
        stats.save_failures += not ok
        stats.save_seconds += time.perf_counter() - start

    def wait(self, session_id: str) -> None:
        """Block until the session's pending write (if any) is done."""
        with self._lock:
            future = self._pending.pop(session_id, None)
        if future is not None:
            future.result()

    def close(self) -> None:
        """Drop reads not started, finish every pending write and stop the threads."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)

    # -- reads ----------------------------------------------------------------------------------------
    def start_restore(self, session_id: str, token_ids: list[int], cache_salt: str | None) -> PendingRestore | None:
        """Start reading the session's stored KV for the start of `token_ids` in a reader thread; None when
        there is nothing to read (the prompt's full blocks are all on the device, or no prefix cache)."""
        if not self.blocks.enable_prefix_caching:
            return None
        hashes = self.blocks.prompt_block_hashes(token_ids, cache_salt)
        on_device = len(self.blocks.device_prefix(hashes))
        if on_device == len(hashes):
            return None
        first_chunk = on_device // self.chunk_blocks
        future = self._reader.submit(log_context.carried(self._read), session_id, list(token_ids), first_chunk)
        prompt_blocks = -(-len(token_ids) // self.blocks.block_size)
        return PendingRestore(hashes, prompt_blocks, first_chunk, future)

    def _read(self, session_id: str, token_ids: list[int], first_chunk: int) -> tuple[list[torch.Tensor], float]:
        """Reader thread: the session's verified chunks from `first_chunk` on, as tensors."""
        start = time.perf_counter()
        self.wait(session_id)  # the previous turn's write
        chunks = []
        for payload in self.sessions.load_prefix(session_id, token_ids, first_chunk):
            data = self.io.from_bytes(payload)
            if data is None:
                break
            chunks.append(data)
        return chunks, time.perf_counter() - start

    def load_restored(self, restore: PendingRestore, max_chunks: int | None = None) -> bool:
        """Engine thread, once `restore.done()`: load up to `max_chunks` (None: all) more of the chunks read into
        the prefix cache; True when the restore is over (every chunk loaded, or the rest left to recompute)."""
        start = time.perf_counter()
        if restore.chunks is None:
            restore.chunks = self._take_read(restore)
        chunks = restore.chunks
        end = len(chunks) if max_chunks is None else min(len(chunks), restore.next_chunk + max_chunks)
        while restore.next_chunk < end:
            if not self._load_chunk(restore, restore.first_chunk + restore.next_chunk, chunks[restore.next_chunk]):
                restore.next_chunk = len(chunks)  # the rest is recomputed
                break
            restore.next_chunk += 1
        self.stats.restore_load_seconds += time.perf_counter() - start
        return restore.next_chunk >= len(chunks)

    def _take_read(self, restore: PendingRestore) -> list[torch.Tensor]:
        try:
            chunks, read_seconds = restore.future.result()
        except Exception:  # an unreachable store costs a recompute, never the request
            logger.exception("reading a session's KV failed; its prompt is recomputed")
            chunks, read_seconds = [], 0.0
        self.stats.restores += 1
        self.stats.restore_misses += not chunks
        self.stats.restore_read_seconds += read_seconds
        return chunks

    def _load_chunk(self, restore: PendingRestore, c: int, data: torch.Tensor) -> bool:
        """Writes chunk `c` (its blocks not on the device) into free blocks; False when it cannot be used: the
        device prefix does not reach its start (evicted meanwhile), no room for the rest of the prompt, or it
        is longer than the prompt's full blocks (never stored so)."""
        hashes, start = restore.hashes, c * self.chunk_blocks
        on_device = len(self.blocks.device_prefix(hashes))
        if on_device < start:
            return False
        # the device hits are needed by this request: keep them out of reach of the blocks taken below
        cached = self.blocks.hash_to_block
        hit_free = self.blocks.protect_free_hits([cached[h] for h in hashes[:on_device]])
        if restore.prompt_blocks - on_device + hit_free > self.blocks.num_free_blocks:
            return False
        total = data.numel() // self.io.elems_per_block
        skip = on_device - start
        wanted = hashes[start + skip:start + total]
        if skip >= total:  # on the device already (computed meanwhile)
            return True
        if len(wanted) != total - skip:
            return False
        new_blocks = self.blocks.take_free_blocks(len(wanted))
        self.io.scatter(torch.tensor(new_blocks, dtype=torch.long), data, first=skip)
        self.blocks.cache_blocks(new_blocks, wanted)
        self.stats.restored_chunks += 1
        self.stats.restored_tokens += len(new_blocks) * self.blocks.block_size
        return True

    # -- the HTTP API ---------------------------------------------------------------------------------
    def info(self, session_id: str) -> dict | None:
        self.wait(session_id)
        with _reaching_the_store():
            return self.sessions.info(session_id)

    def delete(self, session_id: str) -> bool:
        self.wait(session_id)
        with _reaching_the_store():
            return self.sessions.delete(session_id)

    def summary(self, session_id: str) -> dict | None:
        """The session's anchoring summary (server/anchoring.py), or None."""
        self.wait(session_id)
        record = self.sessions.record(session_id)
        return None if record is None else record.summary

    def set_summary(self, session_id: str, summary: dict | None) -> None:
        self.wait(session_id)
        self.sessions.set_summary(session_id, summary)


@contextmanager
def _reaching_the_store() -> Iterator[None]:
    """Any failure of the store's backend (a Redis connection error, an OSError) as SessionStoreUnavailableError."""
    try:
        yield
    except Exception as exc:
        raise SessionStoreUnavailableError(f"the session store cannot be reached: {exc}") from exc
