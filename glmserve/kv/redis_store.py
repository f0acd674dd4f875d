"""A `ChunkStore` on a Redis server, so that several replicas share KV chunks (sessions).

Layout under a key prefix (default `glmserve:kv:`), so that one Redis can hold several stores:

- `<prefix>e:<key>`: the entry, framed like `DiskChunkStore`'s files (magic, version, lengths, blake2b
  of key + payload, key, payload); the checksum is verified on every read and a bad entry is deleted.
- `<prefix>lru`: a sorted set of keys scored by last use, shared by every replica: the LRU order for the
  byte budget (which covers everything under the prefix, whichever replica wrote it).
- `<prefix>sizes`: a hash of key -> bytes the entry takes.

TTL (`ttl_s`): every entry gets a Redis expiry, refreshed when it is read or checked with `in` (a key
a caller checks is in use, e.g. a session chunk kept for the next turn). Entries Redis expired are
pruned from the LRU index when `keys()` or `nbytes` next look at it.

The ABC's process-local LRU index cannot see what other replicas wrote, so this store keeps the index in
Redis and overrides the public methods; `_write`, `_read`, `_remove` are the raw entry operations.
Needs the optional dependency `redis` (`pip install 'glmserve[redis]'`).
"""

from __future__ import annotations

import time
from typing import Any

from glmserve.errors import InvalidRequestError
from glmserve.kv.chunk_store import _HEADER, MAGIC, VERSION, ChunkStore, _checksum

DEFAULT_PREFIX = "glmserve:kv:"


def frame(key: str, data: bytes) -> bytes:
    """Header + key + payload, as DiskChunkStore writes a file."""
    key_bytes = key.encode()
    return _HEADER.pack(MAGIC, VERSION, len(key_bytes), len(data), _checksum(key_bytes, data)) + key_bytes + data


def unframe(key: str, blob: bytes | None) -> bytes | None:
    """The payload of a framed entry, or None when it is missing, truncated, corrupt or another key's."""
    if blob is None or len(blob) < _HEADER.size:
        return None
    magic, version, key_len, payload_len, checksum = _HEADER.unpack_from(blob)
    key_bytes = key.encode()
    if magic != MAGIC or version != VERSION or len(blob) != _HEADER.size + key_len + payload_len:
        return None
    if blob[_HEADER.size:_HEADER.size + key_len] != key_bytes:
        return None
    payload = blob[_HEADER.size + key_len:]
    return payload if _checksum(key_bytes, payload) == checksum else None


def connect(url: str) -> Any:
    """A Redis client for `url` (redis://, rediss:// or unix://), checked with a PING."""
    try:
        import redis
    except ImportError as exc:
        raise InvalidRequestError("a redis:// store needs the redis package: pip install 'glmserve[redis]'") from exc
    client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise InvalidRequestError(f"cannot reach Redis at {url}: {exc}") from exc
    return client


class RedisChunkStore(ChunkStore):
    """ChunkStore on Redis: budget and LRU shared by every client of the same prefix; optional TTL."""

    def __init__(self, url: str, budget: int, prefix: str = DEFAULT_PREFIX, ttl_s: float | None = None):
        super().__init__(budget)
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive, got {ttl_s}")
        import redis

        self._errors = redis.RedisError
        self.redis = connect(url)
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._lru = prefix + "lru"
        self._sizes = prefix + "sizes"

    def _entry(self, key: str) -> str:
        return self.prefix + "e:" + key

    # -- raw entries --------------------------------------------------------------------------------------
    def entry_size(self, key: str, data: bytes) -> int:
        return _HEADER.size + len(key.encode()) + len(data)

    def _write(self, key: str, data: bytes) -> int | None:
        blob = frame(key, data)
        try:
            self.redis.set(self._entry(key), blob, px=self.ttl_ms)
        except self._errors:  # out of memory (maxmemory), connection lost: nothing was stored
            return None
        return len(blob)

    def _read(self, key: str) -> bytes | None:
        return unframe(key, self.redis.get(self._entry(key)))

    def _remove(self, key: str) -> None:
        self.redis.delete(self._entry(key))

    # -- shared index -------------------------------------------------------------------------------------
    def _prune(self) -> list[str]:
        """Keys of the LRU index, oldest first, after dropping those whose entries Redis expired."""
        keys = [k.decode() for k in self.redis.zrange(self._lru, 0, -1)]
        if not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._entry(key))
        gone = [key for key, alive in zip(keys, pipe.execute()) if not alive]
        if gone:
            self.redis.pipeline().zrem(self._lru, *gone).hdel(self._sizes, *gone).execute()
        return [key for key in keys if key not in set(gone)]

    @property
    def nbytes(self) -> int:
        with self.lock:
            self._prune()
            return sum(int(v) for v in self.redis.hvals(self._sizes))

    def put(self, key: str, data: bytes) -> bool:
        """Room is made under this process's lock (other replicas may evict concurrently: the budget is kept
        approximately across replicas); the upload itself runs outside it."""
        size = self.entry_size(key, data)
        with self.lock:
            self.delete(key)
            if size > self.budget:
                return False
            used = self.nbytes
            while used + size > self.budget:
                oldest = self.redis.zrange(self._lru, 0, 0)
                if not oldest:
                    break
                victim = oldest[0].decode()
                used -= int(self.redis.hget(self._sizes, victim) or 0)
                self.delete(victim)
        written = self._write(key, data)
        if written is None:
            return False
        self.redis.pipeline().zadd(self._lru, {key: time.time()}).hset(self._sizes, key, written).execute()
        return True

    def get(self, key: str) -> bytes | None:
        data = self._read(key)
        if data is None:
            self.delete(key)
            return None
        self.touch(key)
        return data

    def touch(self, key: str) -> bool:
        """Most recently used (and, with a TTL, alive for another TTL) without reading it; False when absent."""
        pipe = self.redis.pipeline().zadd(self._lru, {key: time.time()}, xx=True)
        if self.ttl_ms is not None:
            pipe.pexpire(self._entry(key), self.ttl_ms)
        else:
            pipe.exists(self._entry(key))
        return bool(pipe.execute()[1])

    def delete(self, key: str) -> None:
        with self.lock:
            self.redis.pipeline().delete(self._entry(key)).zrem(self._lru, key).hdel(self._sizes, key).execute()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if self.ttl_ms is not None:  # PEXPIRE answers whether the key exists, and keeps it alive
            return bool(self.redis.pexpire(self._entry(key), self.ttl_ms))
        return bool(self.redis.exists(self._entry(key)))

    def keys(self) -> list[str]:
        with self.lock:
            return self._prune()
