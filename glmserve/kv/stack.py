"""An engine's KV stack, from explicit arguments: the pool's size from a byte budget (`plan_pool`), then
everything around the pool the model allocated (`KVStack.build`): the block allocator, block I/O, the host and
disk tiers, the running offload of sequences longer than the pool, and the session store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from glmserve.errors import InvalidRequestError
from glmserve.kv.blocks import BlockManager
from glmserve.kv.kv_format import KVFormat
from glmserve.kv.kv_io import KVBlockIO, kv_identity
from glmserve.kv.offload import RunningKVOffload
from glmserve.kv.session_io import SessionKV, open_session_kv
from glmserve.kv.tiers import KVTiers, build_tiers, host_tier_budget

CPU_KV_CACHE_CAP = 4 << 30  # default pool budget on CPU: 30% of available RAM, at most this


def kv_budget_bytes(configured: int | None, device: torch.device) -> int:
    """Bytes for the pool (with its side pools): as configured; else 80% of free CUDA memory, or on CPU 30% of
    available RAM (at most CPU_KV_CACHE_CAP)."""
    if configured:
        return configured
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return min(CPU_KV_CACHE_CAP, int(psutil.virtual_memory().available * 0.3))


@dataclass(frozen=True)
class PoolPlan:
    """The pool's size and whether sequences longer than it offload their KV (glmserve/kv/offload.py)."""

    num_blocks: int  # pool blocks, the null block included
    block_size: int
    offloads: bool
    host_bytes: int  # host memory the tiers and the offload may use

    @property
    def usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def plan_pool(budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int, *,
              offload_supported: bool, chunk_tokens: int, max_num_batched_tokens: int,
              host_memory_bytes: int | None, disk_dir: str | None, device: torch.device) -> PoolPlan:
    """As many blocks as `budget_bytes` holds at `bytes_per_block` (KV and side pools). A pool shorter than
    `max_model_len` needs KV offload: a model whose attention supports it and somewhere to put the chunks (a disk
    dir, or a host budget); raises InvalidRequestError otherwise, or when the pool cannot hold the smallest
    offload's working set (the first chunk, a chunk filling up, one step's tokens, one block)."""
    host_bytes = host_tier_budget(host_memory_bytes, device)
    plan = PoolPlan(budget_bytes // bytes_per_block, block_size, False, host_bytes)
    if plan.usable_tokens >= max_model_len:
        return plan
    if not (offload_supported and (disk_dir is not None or host_bytes > 0)):
        raise InvalidRequestError(
            f"KV cache budget holds {plan.usable_tokens} tokens, less than max_model_len {max_model_len}; raise "
            "kv_cache_memory_bytes, lower max_model_len, or give kv_disk_dir to offload longer sequences' KV"
        )
    need = 2 * chunk_tokens + max_num_batched_tokens + block_size
    if plan.usable_tokens < need:
        raise InvalidRequestError(f"KV cache budget holds {plan.usable_tokens} tokens; offloading KV chunks needs at "
                                  f"least {need} (two chunks and one step's tokens)")
    return PoolPlan(plan.num_blocks, block_size, True, host_bytes)


@dataclass
class KVStack:
    """Everything that holds or moves an engine's KV, around its pool (the map: glmserve/kv/__init__.py)."""

    blocks: BlockManager
    io: KVBlockIO
    identity: str  # names the model and KV layout in every key that leaves the process
    tiers: KVTiers | None  # None: no host budget and no disk dir
    offload: RunningKVOffload | None  # None: the pool holds max_model_len
    sessions: SessionKV | None  # None: session_store "off"

    @classmethod
    def build(cls, plan: PoolPlan, model: torch.nn.Module, pool: torch.Tensor, model_ref: str,
              weights_dtype: torch.dtype, kv_format: KVFormat, *, prefix_caching: bool, chunk_tokens: int,
              disk_dir: str | None, disk_bytes: int, host_memory_bytes: int | None, session_store: str | None,
              session_max_bytes: int, session_ttl_s: float, load_listeners: list[Callable[[torch.Tensor], None]],
              block_bounds: Callable[[torch.Tensor], torch.Tensor] | None) -> KVStack:
        """The stack around `pool` (the model's, of `plan.num_blocks` blocks; `model_ref`, the weights dtype and the
        KV format name its KV in `identity`). `load_listeners` run after KV is
        loaded straight into the pool (side pools refresh); `block_bounds(blocks)` gives the block indexer's
        bounds that offloaded chunks keep (None without the block indexer)."""
        bs = plan.block_size
        blocks = BlockManager(plan.num_blocks, bs, prefix_caching)
        io = KVBlockIO(model, pool, bs, plan.num_blocks * bs)
        for listener in load_listeners:
            io.add_load_listener(listener)
        identity = kv_identity(model_ref, weights_dtype, kv_format, bs, io.layout)
        sessions = open_session_kv(session_store, blocks, io, identity, chunk_tokens, session_max_bytes,
                                   session_ttl_s)
        tiers = build_tiers(io, identity, chunk_tokens, host_memory_bytes, disk_dir, disk_bytes)
        if tiers is not None:
            blocks.attach_tiers(tiers)
        offload = RunningKVOffload(blocks, io, chunk_tokens, model.num_layers, plan.host_bytes, disk_dir, disk_bytes,
                                   block_bounds) if plan.offloads else None
        return cls(blocks, io, identity, tiers, offload, sessions)

    def close(self) -> None:
        """Finish background work (session writes, disk-tier writes) and drop offloaded chunks."""
        if self.sessions is not None:
            self.sessions.close()
        if self.tiers is not None:
            self.tiers.wait()
        if self.offload is not None:
            self.offload.close()
