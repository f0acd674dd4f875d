"""Running sequences longer than the device pool: their older KV chunks leave the pool and read back.

The seeds keep a 200K-token context alive on limited memory by splitting its KV into chunks (2,048 tokens)
and keeping only the working set in fast memory. Here a running sequence keeps resident its first chunk
(attention sinks) and everything after its offloaded span; when the pool runs short (the scheduler asks before it
preempts anyone), the oldest fully computed resident chunk after the first is copied out
(`KVBlockIO.gather`: one batched copy, layer-major, so one layer of a chunk is one contiguous byte range),
its blocks are released from the sequence (block-table entries become `OFFLOADED`) and the chunk joins
the sequence's offloaded span. Each attention layer then merges the resident part with every offloaded chunk's layer
slice, read one at a time with read-ahead (glmserve/layers/partial_attention.py: partial softmax results
merged by their log-sum-exp), so memory stays at the pool plus a few layer slices whatever the context.

Where offloaded chunks live: on CUDA, pinned host memory while the host budget lasts (one layer slice copies to the
GPU at full speed); then files under `<kv_disk_dir>/running`. A file is unlinked as soon as it is created
(`tempfile.TemporaryFile`), so a crash leaves nothing behind; it is private scratch of this process and this
sequence, dropped when the sequence finishes or is preempted (a preempted sequence recomputes, as it does
without offload). Layer slices are read with `os.preadv` straight into tensors (no page-cache mapping in the
process: RSS stays flat).

Scope: models whose attention layers are `PagedAttention` (Llama family, Qwen, GLM-4: `supports_kv_offload`).
Block-sparse decode of a row with a offloaded span scores the offloaded blocks from the block indexer's key bounds
kept with each chunk and reads back only the blocks holding a selected token (`OffloadedChunk.read_blocks`); rows
in other sparse modes decode densely (their scorers keep nothing for offloaded tokens).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmserve.kv.blocks import BlockManager
from glmserve.kv.kv_format import dequantize
from glmserve.kv.kv_io import KVBlockIO
from glmserve.kv.seq_kv import SeqKV

READ_AHEAD = 2  # layer slices read ahead of the one being attended


class OffloadedChunk:
    """One chunk of one sequence's KV outside the pool, readable one layer at a time.

    Layout (from `KVBlockIO.gather` on a `[layers, 2, kv_heads, slots, width]` pool): `[layers, 2, kv_heads,
    tokens, width]` in the pool's KV format (glmserve/kv/kv_format.py: quantized rows carry their scales), so
    layer `l` is one contiguous run; then, when the block indexer is on, its key bounds
    `[layers, blocks, 2, kv_heads, head_dim]` in `bounds_dtype` (sparse decode scores the chunk's blocks without
    its K/V)."""

    def __init__(self, start: int, layer_shape: tuple[int, ...], bounds_shape: tuple[int, ...] | None,
                 dtype: torch.dtype, num_layers: int, bounds_dtype: torch.dtype | None):
        self.start = start  # first token position
        self.tokens = layer_shape[2]
        self.layer_shape = layer_shape  # (2, kv_heads, tokens, width)
        self.bounds_shape = bounds_shape  # (blocks, 2, kv_heads, head_dim) per layer, or None
        self.dtype = dtype
        self.bounds_dtype = bounds_dtype or dtype  # None: no bounds kept
        item = torch.empty((), dtype=dtype).element_size()
        self.layer_bytes = int(torch.Size(layer_shape).numel()) * item
        bounds_item = torch.empty((), dtype=self.bounds_dtype).element_size()
        self.bounds_bytes = int(torch.Size(bounds_shape).numel()) * bounds_item if bounds_shape else 0
        self.nbytes = (self.layer_bytes + self.bounds_bytes) * num_layers
        self.bounds_offset = self.layer_bytes * num_layers
        self.host: torch.Tensor | None = None  # uint8, the whole layout (CUDA: pinned)
        self.file = None  # an unlinked temp file holding the layout

    def _read(self, offset: int, nbytes: int) -> torch.Tensor:
        if self.host is not None:
            return self.host[offset:offset + nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8)
        got = os.preadv(self.file.fileno(), [out.numpy()], offset)
        if got != nbytes:
            raise OSError(f"offloaded KV chunk at token {self.start}: read {got} of {nbytes} bytes")
        return out

    def read_layer(self, layer: int) -> torch.Tensor:
        """This chunk's K/V of `layer`: [2, kv_heads, tokens, width] in host memory, as stored."""
        return self._read(layer * self.layer_bytes, self.layer_bytes).view(self.dtype).view(self.layer_shape)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """K/V of some of this chunk's blocks at `layer` (block indices within the chunk, ascending):
        [2, kv_heads, len(blocks) * block_size, head_dim]. From a file, one read per run of consecutive blocks
        and (K or V, kv head): the bytes of the other blocks are never read."""
        two, heads, tokens, dim = self.layer_shape
        block_size = tokens // self.bounds_shape[0]  # only block-sparse decode reads blocks: bounds are kept
        n = blocks.shape[0]
        if self.host is not None:
            layer_kv = self.read_layer(layer).view(two, heads, tokens // block_size, block_size * dim)
            return layer_kv.index_select(2, blocks.to(layer_kv.device)).view(two, heads, n * block_size, dim)
        out = torch.empty((two * heads, n, block_size * dim), dtype=self.dtype)
        run_bytes = block_size * dim * out.element_size()
        view = out.view(torch.uint8).numpy()
        ids = blocks.tolist()
        runs, first = [], 0  # [first, end) index ranges of consecutive block ids
        for i in range(1, n + 1):
            if i == n or ids[i] != ids[i - 1] + 1:
                runs.append((first, i))
                first = i
        base = layer * self.layer_bytes
        for row in range(two * heads):
            row_base = base + row * tokens * dim * out.element_size()
            for a, b in runs:
                want = (b - a) * run_bytes
                got = os.preadv(self.file.fileno(), [view[row, a:b]], row_base + ids[a] * run_bytes)
                if got != want:
                    raise OSError(f"offloaded KV chunk at token {self.start}: read {got} of {want} bytes")
        return out.view(two, heads, n * block_size, dim)

    def read_bounds(self, layer: int) -> torch.Tensor:
        """The block indexer's key bounds of this chunk's blocks at `layer`: [blocks, 2, kv_heads, head_dim]."""
        assert self.bounds_shape is not None
        raw = self._read(self.bounds_offset + layer * self.bounds_bytes, self.bounds_bytes)
        return raw.view(self.bounds_dtype).view(self.bounds_shape)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.host = None


@dataclass
class OffloadStats:
    offloaded_chunks: int = 0
    offloaded_bytes: int = 0  # currently held outside the pool (a gauge)
    offload_seconds: float = 0.0  # gather + copy out, in the engine step
    read_slices: int = 0  # layer slices read back by attention
    skipped_slices: int = 0  # layer slices sparse decode did not need (no selected token in the chunk)
    read_wait_seconds: float = 0.0  # waiting for layer slices in attention


@dataclass
class OffloadedSpan:
    """A sequence's offloaded chunks, contiguous from `start` (the end of its first chunk)."""

    chunks: list[OffloadedChunk] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.chunks[0].start if self.chunks else 0

    @property
    def length(self) -> int:
        return sum(c.tokens for c in self.chunks)


class RunningKVOffload:
    """Offloads and reads back the KV chunks of running sequences (see the module docstring)."""

    def __init__(self, blocks: BlockManager, io: KVBlockIO, chunk_tokens: int, num_layers: int,
                 host_bytes: int, disk_dir: str | None, disk_bytes: int,
                 block_bounds: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`block_bounds(blocks)`: the block indexer's bounds of `blocks` for every layer ([layers, n, ...]),
        kept with each chunk so that sparse decode can score it; None when the block indexer is off."""
        if len(io.layout) != 1:
            raise ValueError("KV offload needs a pool of [layers, 2, kv_heads, slots, head_dim]")
        self.blocks = blocks
        self.io = io
        self.chunk_tokens = chunk_tokens
        self.chunk_blocks = chunk_tokens // io.block_size
        self.num_layers = num_layers
        self.block_bounds = block_bounds
        self.host_bytes = host_bytes
        self.disk_dir = Path(disk_dir) / "running" if disk_dir else None
        self.disk_bytes = disk_bytes if disk_dir else 0
        self.host_used = 0
        self.disk_used = 0
        self.spans: dict[int, OffloadedSpan] = {}  # SeqKV.kv_id -> its offloaded span
        self.stats = OffloadStats()
        self.reader = ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="glmserve-kv-offload")
        self.lock = threading.Lock()  # stats updated from attention (engine thread) and readers

    def span(self, kv: SeqKV) -> OffloadedSpan | None:
        return self.spans.get(kv.kv_id)

    # -- offload --------------------------------------------------------------------------------------------
    def offload_oldest(self, kv: SeqKV) -> bool:
        """Moves the sequence's oldest resident, fully computed chunk after its first one out of the pool and
        releases its blocks; False when it has none or there is no room outside the pool."""
        span = self.spans.get(kv.kv_id)
        index = 1 + (len(span.chunks) if span else 0)
        first, last = index * self.chunk_blocks, (index + 1) * self.chunk_blocks
        if last * self.io.block_size > kv.num_computed_tokens or last > len(kv.block_table):
            return False
        start_time = time.perf_counter()
        chunk = self._copy_out(kv.block_table[first:last], index * self.chunk_tokens)
        if chunk is None:
            return False
        self.blocks.release_blocks(kv, first, last)
        self.spans.setdefault(kv.kv_id, OffloadedSpan()).chunks.append(chunk)
        self.stats.offloaded_chunks += 1
        self.stats.offloaded_bytes += chunk.nbytes
        self.stats.offload_seconds += time.perf_counter() - start_time
        return True

    def _copy_out(self, blocks: list[int], start: int) -> OffloadedChunk | None:
        groups, width = self.io.layout[0]
        layer_shape = (2, groups // (2 * self.num_layers), len(blocks) * self.io.block_size, width)
        index = torch.tensor(blocks, dtype=torch.long)
        kv = self.io.gather(index)
        bounds = self.block_bounds(index) if self.block_bounds is not None else None
        chunk = OffloadedChunk(start, layer_shape, None if bounds is None else tuple(bounds.shape[1:]), kv.dtype,
                               self.num_layers, None if bounds is None else bounds.dtype)
        size = chunk.nbytes
        data = kv.view(torch.uint8) if bounds is None else torch.cat(
            [kv.view(torch.uint8), bounds.contiguous().view(-1).view(torch.uint8)])
        if self.host_used + size <= self.host_bytes:
            chunk.host = torch.empty(size, dtype=torch.uint8, pin_memory=data.device.type == "cuda")
            chunk.host.copy_(data)
            self.host_used += size
            return chunk
        if self.disk_dir is None or self.disk_used + size > self.disk_bytes:
            return None
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        chunk.file = tempfile.TemporaryFile(dir=self.disk_dir, prefix="kv-")
        try:
            written = os.pwritev(chunk.file.fileno(), [data.cpu().numpy()], 0)
            if written != size:
                raise OSError(f"short write: {written} of {size} bytes")
        except OSError:
            chunk.close()
            return None
        self.disk_used += size
        return chunk

    def drop(self, kv: SeqKV) -> None:
        """The sequence finished or was preempted: its offloaded chunks are deleted."""
        span = self.spans.pop(kv.kv_id, None)
        for chunk in span.chunks if span is not None else []:
            if chunk.host is not None:
                self.host_used -= chunk.nbytes
            else:
                self.disk_used -= chunk.nbytes
            self.stats.offloaded_bytes -= chunk.nbytes
            chunk.close()

    # -- reading back -----------------------------------------------------------------------------------------
    def read_layer_slices(self, chunks: list[OffloadedChunk], layer: int, device: torch.device, dtype: torch.dtype
                          ) -> Iterator[torch.Tensor]:
        """Each chunk's layer slice ([2, kv_heads, tokens, head_dim], on `device` in `dtype`, dequantized), in
        order, the next `READ_AHEAD` being read in background threads meanwhile."""
        pending = [self.reader.submit(chunk.read_layer, layer) for chunk in chunks[:READ_AHEAD]]
        for i in range(len(chunks)):
            start = time.perf_counter()
            data = pending.pop(0).result()
            if i + READ_AHEAD < len(chunks):
                pending.append(self.reader.submit(chunks[i + READ_AHEAD].read_layer, layer))
            kv = dequantize(data.to(device, non_blocking=True), dtype)
            with self.lock:
                self.stats.read_slices += 1
                self.stats.read_wait_seconds += time.perf_counter() - start
            yield kv

    def snapshot(self) -> OffloadStats:
        """A copy of the counters, safe to read from another thread (the server's /metrics)."""
        with self.lock:
            return dataclasses.replace(self.stats)

    def count_skipped(self, slices: int) -> None:
        with self.lock:
            self.stats.skipped_slices += slices

    def count_read_slices(self, slices: int) -> None:
        with self.lock:
            self.stats.read_slices += slices

    def close(self) -> None:
        for span in self.spans.values():
            for chunk in span.chunks:
                chunk.close()
        self.spans.clear()
        self.reader.shutdown(wait=True)
