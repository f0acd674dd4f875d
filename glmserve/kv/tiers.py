"""KV chunks below the device pool: a host-RAM tier and a disk tier, each with its own byte budget.

A chunk is `chunk_tokens` tokens (default 2,048: 128 blocks of 16) of one prompt's prefix, aligned to the
start of the sequence, and is named by the chained hash of its last block (which covers the whole prefix up
to it, cache salt included) plus `kv_identity` (model, dtypes, block size, pool layout): KV of another model
can never be found. The block manager hands a chunk down when the first of its blocks is evicted from the
device pool (all its blocks still hold their KV at that moment), and asks for it when a prompt continues
past the device-resident prefix.

Save on eviction, not write-back at the end of every sequence: only chunks that really leave the device pay
the copy (a prefix that stays resident costs nothing), and the copy happens at most once per chunk while it
stays in a lower tier (a chunk loaded back and evicted again is only touched). The cost is paid inside the
scheduler step that needs the blocks: `KVTiers.stats` records the seconds spent saving and loading, and
bench/bench_tiers.py reports them per chunk.

Host tier: gathered chunks kept as tensors (pinned on CUDA, so device↔host copies run at full speed); its
LRU chunks go down to the disk tier when it is full. On a CPU-only machine the device pool is already host
memory, so the host tier is off unless a budget is given. Disk tier: a `ChunkStore` (atomic, checksummed
files) written by one background thread (`DiskWriter`: the step pays only the gather; chunks waiting for the
writer stay readable); a missing, truncated or corrupt chunk reads as None and the prefix from there on is
recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch

from glmserve import log_context
from glmserve.errors import InvalidRequestError
from glmserve.kv.chunk_store import ChunkStore, DiskChunkStore, LruIndex
from glmserve.kv.kv_io import KVBlockIO

HOST_TIER_CAP = 32 << 30  # default host tier on CUDA: 25% of available RAM, at most this
MAX_PENDING_BYTES = 1 << 30  # chunks waiting for the disk writer before a spill waits for it
PREFETCH_CHUNKS = 4  # disk chunks read ahead (in reader threads) while earlier ones are copied in

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    saved_chunks: int = 0  # chunks copied out of the device pool
    loaded_chunks: int = 0  # chunks copied back into the device pool
    loaded_tokens: int = 0
    failed_loads: int = 0  # missing or corrupt in the tier that listed them: recomputed
    failed_writes: int = 0  # the disk refused them (budget, disk full, file size limit): recomputed when needed
    demoted_chunks: int = 0  # host tier → disk tier
    save_seconds: float = 0.0  # in the engine step: gather (+ host copy)
    write_seconds: float = 0.0  # in the disk writer thread: to bytes, checksum, write, fsync
    load_seconds: float = 0.0


class HostTier:
    """Gathered chunks as tensors (pinned when the pool is on CUDA) under an LRU byte budget."""

    def __init__(self, budget: int, pin: bool):
        self.budget = budget
        self.pin = pin
        self.index = LruIndex()
        self.chunks: dict[str, torch.Tensor] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.chunks

    def put(self, key: str, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Stores a copy of `data`; returns the LRU chunks pushed out to make room (for the tier below)."""
        size = data.numel() * data.element_size()
        if size > self.budget:
            return [(key, data)]
        evicted = []
        while self.index.nbytes + size > self.budget:
            old = self.index.oldest()
            evicted.append((old, self.chunks.pop(old)))
            self.index.discard(old)
        if data.device.type == "cpu" and not self.pin:
            host = data  # a fresh tensor from gather: no second copy
        else:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.pin)
            host.copy_(data)  # synchronous: the disk writer may read it on the CPU at once
        self.chunks[key] = host
        self.index.add(key, size)
        return evicted

    def get(self, key: str) -> torch.Tensor | None:
        data = self.chunks.get(key)
        if data is not None:
            self.index.touch(key)
        return data


class DiskWriter:
    """Writes chunks to the disk tier in one background thread, so that a spill costs the engine step only
    its gather; a chunk waiting to be written stays readable (`get`). At most `max_pending_bytes` wait:
    beyond that a spill waits for the oldest writes (the disk sets the pace, memory stays bounded)."""

    def __init__(self, disk: ChunkStore, io: KVBlockIO, stats: TierStats, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.disk = disk
        self.io = io
        self.stats = stats
        self.max_pending_bytes = max_pending_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.futures: deque[tuple[Future, int]] = deque()
        self.queued_bytes = 0
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glmserve-kv-disk")

    def submit(self, key: str, data: torch.Tensor) -> None:
        with self.lock:
            if key in self.pending:
                return
            self.pending[key] = data
        size = data.numel() * data.element_size()
        while self.futures and self.queued_bytes + size > self.max_pending_bytes:
            self._wait_oldest()
        self.queued_bytes += size
        self.futures.append((self.executor.submit(log_context.carried(self._write), key, data), size))

    def _wait_oldest(self) -> None:
        future, size = self.futures.popleft()
        future.result()
        self.queued_bytes -= size

    def _write(self, key: str, data: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            if not self.disk.put(key, self.io.to_bytes(data)):
                self.stats.failed_writes += 1
                logger.warning("KV disk tier: no room for a chunk (budget or disk full); it will be recomputed")
        except Exception:  # a lost chunk costs a recompute later, never a request
            self.stats.failed_writes += 1
            logger.exception("KV disk tier: writing a chunk failed")
        finally:
            with self.lock:
                self.pending.pop(key, None)
            self.stats.write_seconds += time.perf_counter() - start

    def get(self, key: str) -> torch.Tensor | None:
        with self.lock:
            return self.pending.get(key)

    def wait(self) -> None:
        """Blocks until every submitted write is done."""
        while self.futures:
            self._wait_oldest()


class KVTiers:
    """Moves whole chunks between the device pool (through `KVBlockIO`) and the host and disk tiers."""

    def __init__(self, io: KVBlockIO, identity: str, chunk_blocks: int, host: HostTier | None,
                 disk: ChunkStore | None):
        self.io = io
        self.identity = identity
        self.chunk_blocks = chunk_blocks
        self.host = host
        self.disk = disk
        self.stats = TierStats()
        self.writer = DiskWriter(disk, io, self.stats) if disk is not None else None
        self.reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="glmserve-kv-read") if disk else None
        self.reads: dict[str, Future] = {}  # disk chunks being read ahead of their load
        self.upcoming: deque[str] = deque()  # disk chunks of the current prompt not yet read

    def key(self, chunk_hash: int) -> str:
        return f"kv-{self.identity}-{chunk_hash:032x}"

    def find(self, chunk_hashes: list[int]) -> list[torch.Tensor | None]:
        """One entry per leading chunk present in a tier: its host copy, held from now on (blocks taken
        while loading spill other chunks, which may push it out of the host tier), or None when it is on
        disk (read when loaded)."""
        self._drop_reads()
        found: list[torch.Tensor | None] = []
        for chunk_hash in chunk_hashes:
            key = self.key(chunk_hash)
            held = self._held(key)
            if held is None:
                if self.disk is None or key not in self.disk:
                    break
                self.upcoming.append(key)
            found.append(held)
        self._read_ahead()
        return found

    def _read_ahead(self) -> None:
        while self.upcoming and len(self.reads) < PREFETCH_CHUNKS:
            key = self.upcoming.popleft()
            self.reads[key] = self.reader.submit(self.disk.get, key)  # type: ignore[union-attr]

    def _drop_reads(self) -> None:
        """Forgets the read-ahead of an earlier prompt (its loads stopped early)."""
        for future in self.reads.values():
            future.cancel()
        self.reads.clear()
        self.upcoming.clear()

    def _held(self, key: str) -> torch.Tensor | None:
        """The chunk's copy in memory: in the host tier or waiting for the disk writer."""
        held = self.host.get(key) if self.host is not None else None
        if held is None and self.writer is not None:
            held = self.writer.get(key)
        return held

    def save(self, chunk_hash: int, blocks: list[int]) -> None:
        """Copies a full chunk out of the device pool into the highest tier with room (once per chunk)."""
        key = self.key(chunk_hash)
        if self._held(key) is not None or (self.disk is not None and self.disk.touch(key)):
            return
        start = time.perf_counter()
        data = self.io.gather(torch.tensor(blocks, dtype=torch.long))
        if self.host is not None:
            for old_key, old in self.host.put(key, data):
                self._to_disk(old_key, old)
        else:
            self._to_disk(key, data.cpu())  # waits for the writer in host RAM, never in device memory
        self.stats.saved_chunks += 1
        self.stats.save_seconds += time.perf_counter() - start

    def _to_disk(self, key: str, data: torch.Tensor) -> None:
        if self.writer is not None and self.disk is not None and key not in self.disk:
            self.writer.submit(key, data)
            self.stats.demoted_chunks += self.host is not None

    def wait(self) -> None:
        """Blocks until every chunk handed to the disk tier is written (tests, benchmarks, shutdown)."""
        if self.writer is not None:
            self.writer.wait()

    def load(self, chunk_hash: int, held: torch.Tensor | None, blocks: list[int], first: int) -> bool:
        """Writes blocks `first:` of the chunk (`held`: its host copy from `find`, else read from disk) into
        `blocks`; False (nothing usable) when it is gone or corrupt."""
        start = time.perf_counter()
        key = self.key(chunk_hash)
        data = held
        if data is None and self.disk is not None:
            future = self.reads.pop(key, None)
            raw = future.result() if future is not None else self.disk.get(key)
            self._read_ahead()
            data = self.io.from_bytes(raw) if raw is not None else None
            if data is not None and data.numel() != self.chunk_blocks * self.io.elems_per_block:
                self.disk.delete(key)
                data = None
        if data is None:
            self.stats.failed_loads += 1
            return False
        self.io.scatter(torch.tensor(blocks, dtype=torch.long), data, first)
        self.stats.loaded_chunks += 1
        self.stats.loaded_tokens += len(blocks) * self.io.block_size
        self.stats.load_seconds += time.perf_counter() - start
        return True


def host_tier_budget(requested: int | None, device: torch.device) -> int:
    """The host tier's bytes: as configured; by default 25% of available RAM (capped) on CUDA, 0 on CPU."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    return min(HOST_TIER_CAP, int(psutil.virtual_memory().available * 0.25))


def build_tiers(io: KVBlockIO, identity: str, chunk_tokens: int, host_bytes: int | None,
                disk_dir: str | None, disk_bytes: int) -> KVTiers | None:
    """The tiers an engine config asks for, or None when neither a host budget nor a disk dir is set."""
    host_budget = host_tier_budget(host_bytes, io.device)
    host = HostTier(host_budget, pin=io.device.type == "cuda") if host_budget > 0 else None
    try:
        disk = DiskChunkStore(disk_dir, disk_bytes) if disk_dir else None
    except OSError as e:
        raise InvalidRequestError(f"kv_disk_dir {disk_dir!r} cannot hold the disk KV tier: {e}") from e
    if host is None and disk is None:
        return None
    return KVTiers(io, identity, chunk_tokens // io.block_size, host, disk)
