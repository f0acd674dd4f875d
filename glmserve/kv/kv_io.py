"""Copy the KV of paged blocks out of the pool and back into other blocks, for any model's pool layout.

A model's pool is whatever its `bind_kv_cache` returned. KV I/O sees it as a few `[groups, slots, width]`
views: the model's `kv_slot_views(pool)` when it has one (MLA: latent rows + indexer keys in one flat
pool), else the pool itself reshaped around its slot dimension (Llama family: `[layers, 2, kv_heads,
slots, head_dim]` → `[layers * 2 * kv_heads, slots, head_dim]`). Copies index whole blocks (each view
seen as `[groups, blocks, block_size * width]`, so every row copied is a block's contiguous run): a run
of blocks is gathered with one `index_select` per view into one flat tensor (view by view,
`[groups, blocks, block_size, width]` each), and written back with one `index_copy_` per view; no loop
per block or layer.

Interface (stable; the tiers and the session store build on it):
- `KVBlockIO(model, pool, block_size)`; `gather(blocks) -> Tensor` (flat, the pool's dtype and device);
  `scatter(blocks, data, first=0)` writes blocks `first:` of a gathered run into `blocks`;
  `to_bytes(data)` / `from_bytes(raw)` convert a gathered run for byte stores (None when the size is not
  a whole number of blocks); `bytes_per_block`.
- `add_load_listener(fn)`: `fn(blocks: LongTensor)` runs after every `scatter`, for anything that keeps
  per-block metadata beside the pool (a block indexer's key bounds) and must refresh it for loaded blocks.
- `kv_identity(...)`: a digest naming the model and KV layout; put it into every key that leaves the
  process so that another model (or dtype, block size, layout) can never load the KV.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable

import torch

from glmserve.kv.kv_format import KVFormat, kv_format


def _slot_views(model: torch.nn.Module, pool: torch.Tensor, num_slots: int) -> list[torch.Tensor]:
    views_of = getattr(model, "kv_slot_views", None)
    if views_of is not None:
        return views_of(pool)
    dims = [d for d, size in enumerate(pool.shape) if size == num_slots]
    if len(dims) != 1:
        raise ValueError(f"cannot find the slot dimension ({num_slots} slots) of a KV pool of shape "
                         f"{tuple(pool.shape)}; give the model a kv_slot_views(pool) method")
    d = dims[0]
    return [pool.view(pool.shape[:d].numel(), num_slots, pool.shape[d + 1:].numel())]


def kv_identity(model_ref: str, weights_dtype: torch.dtype, kv_dtype: torch.dtype | str | KVFormat, block_size: int,
                layout: list[tuple[int, ...]]) -> str:
    """Hex digest of (model path or name, weights dtype, KV format, block size, per-view [groups, width]): a chunk
    written in one KV format (glmserve/kv/kv_format.py) is never read in another (float formats keep the digest
    they had before quantized formats, by their torch dtype, so existing disk chunks stay valid)."""
    fmt = kv_format(kv_dtype)
    text = repr((model_ref, str(weights_dtype), fmt.name if fmt.quantized else str(fmt.storage), block_size, layout))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class KVBlockIO:
    """Batched copies of whole blocks between a model's KV pool and flat tensors / bytes."""

    def __init__(self, model: torch.nn.Module, pool: torch.Tensor, block_size: int, num_slots: int):
        self.block_size = block_size
        self.views = _slot_views(model, pool, num_slots)
        self.device = pool.device
        self.dtype = pool.dtype
        self.layout = [(v.shape[0], v.shape[2]) for v in self.views]  # (groups, width) per view
        self.block_views = [v.view(g, num_slots // block_size, block_size * w) for v, (g, w) in
                            zip(self.views, self.layout)]
        self.elems_per_block = sum(g * w for g, w in self.layout) * block_size
        self.bytes_per_block = self.elems_per_block * pool.element_size()
        self.load_listeners: list[Callable[[torch.Tensor], None]] = []

    def add_load_listener(self, fn: Callable[[torch.Tensor], None]) -> None:
        self.load_listeners.append(fn)

    def gather(self, blocks: torch.Tensor) -> torch.Tensor:
        """KV of `blocks` (LongTensor [n]) as one flat tensor of n * elems_per_block elements."""
        blocks = blocks.to(self.device)
        out = torch.empty(len(blocks) * self.elems_per_block, dtype=self.dtype, device=self.device)
        offset = 0
        for v in self.block_views:
            size = v.shape[0] * len(blocks) * v.shape[2]
            torch.index_select(v, 1, blocks, out=out[offset:offset + size].view(v.shape[0], len(blocks), -1))
            offset += size
        return out

    def scatter(self, blocks: torch.Tensor, data: torch.Tensor, first: int = 0) -> None:
        """Writes blocks `first:` of the gathered run `data` into pool blocks `blocks`, then runs listeners
        (not when `blocks` is empty)."""
        total = data.numel() // self.elems_per_block
        assert data.numel() == total * self.elems_per_block and len(blocks) == total - first
        if not len(blocks):  # nothing to load: no copy, no listener call
            return
        data = data.to(self.device, non_blocking=True)
        blocks = blocks.to(self.device)
        offset = 0
        for v in self.block_views:
            size = v.shape[0] * total * v.shape[2]
            v.index_copy_(1, blocks, data[offset:offset + size].view(v.shape[0], total, -1)[:, first:])
            offset += size
        for fn in self.load_listeners:
            fn(blocks)

    def to_bytes(self, data: torch.Tensor) -> bytes:
        return data.contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def from_bytes(self, raw: bytes) -> torch.Tensor | None:
        """A gathered run back from `to_bytes`; None when `raw` is not a whole number of blocks."""
        if not raw or len(raw) % self.bytes_per_block:
            return None
        with warnings.catch_warnings():  # read-only buffer: the tensor is only read (copied into the pool)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
