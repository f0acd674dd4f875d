"""A snapshot of the KV kept below the device pool, for the server's /metrics: what the KV tiers
(glmserve/kv/tiers.py), the session store (glmserve/kv/session_kv.py) and KV streaming of sequences longer
than the pool (glmserve/kv/offload.py) moved, and the bytes they hold.

Taken at scrape time from any thread: the counters are plain numbers the engine and its writer threads
update, copied here as they are at that moment. A Redis session store answers its size over the network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from glmserve.kv.offload import OffloadStats, RunningKVOffload
from glmserve.kv.session_kv import SessionKV, SessionStats
from glmserve.kv.tiers import KVTiers, TierStats


@dataclass(frozen=True)
class StorageStats:
    tiers: TierStats | None  # None: no host or disk tier
    host_tier_bytes: int
    disk_tier_bytes: int
    sessions: SessionStats | None  # None: sessions are off
    session_store_bytes: int
    streaming: OffloadStats | None = None  # None: the pool holds max_model_len (no KV streaming)


def storage_stats(tiers: KVTiers | None, sessions: SessionKV | None,
                  offload: RunningKVOffload | None = None) -> StorageStats:
    host = tiers.host if tiers is not None else None
    disk = tiers.disk if tiers is not None else None
    return StorageStats(
        tiers=dataclasses.replace(tiers.stats) if tiers is not None else None,
        host_tier_bytes=host.index.nbytes if host is not None else 0,
        disk_tier_bytes=disk.nbytes if disk is not None else 0,
        sessions=dataclasses.replace(sessions.stats) if sessions is not None else None,
        session_store_bytes=sessions.store_bytes() if sessions is not None else 0,
        streaming=offload.snapshot() if offload is not None else None,
    )
