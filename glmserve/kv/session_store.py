"""Session KV persistence: a session's KV outlives its turns, a server restart and the replica.

A request may carry a session id. When a turn ends, the KV of the session's whole sequence
(prompt + generated tokens, full blocks only) goes to a `ChunkStore` (a `DiskChunkStore` by
default, a `RedisChunkStore` to share sessions between replicas) as chunks of at most
`chunk_tokens` tokens, under the key (session id, document hash, chunk index). The document
hash of chunk i is a chained blake2b over the KV identity of the model and the token ids of
chunks 0..i (the hash of the prompt's prefix up to the chunk's end), so a chunk is only ever
loaded for exactly the tokens it was computed for, by the same model and KV layout. Beside the
chunks, one small JSON record per session: its token ids per chunk, the model identity,
created / last-used time, turns, size, and an optional summary of earlier turns (anchoring,
glmserve/server/anchoring.py).

The next turn, whose prompt starts with the stored tokens, gets the chunks back
(`load_prefix`) instead of recomputing them. The store verifies a checksum on every read: a
missing or corrupt chunk ends the loaded prefix there and the rest is recomputed.

Expiry: a session unused for `ttl_s` is dropped (checked on access, swept on writes). Size
cap: when the store holds more than `max_bytes`, the least recently used sessions are dropped
whole (never a part of one, which would leave a hole in its prefix).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from glmserve.kv.chunk_store import ChunkStore

META_SUFFIX = ".meta"
SWEEP_INTERVAL_S = 60.0


def session_key(session_id: str) -> str:
    """The store-safe name of a session (ids may hold characters a file name cannot)."""
    return "sess-" + hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest()


def document_hashes(identity: str, chunks: list[list[int]]) -> list[str]:
    """Chained hash per chunk: chunk i's hash covers the identity and every token of chunks 0..i."""
    hashes, parent = [], hashlib.blake2b(identity.encode(), digest_size=16).digest()
    for tokens in chunks:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens).tobytes())
        parent = h.digest()
        hashes.append(parent.hex())
    return hashes


@dataclass
class SessionRecord:
    """What a session holds in the store, apart from the KV chunks themselves."""

    session_id: str
    identity: str
    created: float
    last_used: float
    turns: int = 0
    chunk_tokens: list[list[int]] = field(default_factory=list)  # token ids of each stored chunk
    chunk_hashes: list[str] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)
    summary: dict | None = None  # anchoring state (text, messages covered, ...), see server/anchoring.py

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.chunk_tokens)

    @property
    def nbytes(self) -> int:
        return sum(self.chunk_bytes)

    def chunk_keys(self) -> list[str]:
        skey = session_key(self.session_id)
        return [f"{skey}.{h}.{i}" for i, h in enumerate(self.chunk_hashes)]

    def info(self) -> dict:
        """The public view (GET /v1/sessions/{id})."""
        return {
            "id": self.session_id,
            "object": "session",
            "turns": self.turns,
            "num_tokens": self.num_tokens,
            "num_chunks": len(self.chunk_hashes),
            "bytes": self.nbytes,
            "created": self.created,
            "last_used": self.last_used,
            "summary": self.summary,
        }


@dataclass
class SavePlan:
    """A turn's write: the new record and which of its chunks must be written (the rest are stored)."""

    record: SessionRecord
    new_chunks: list[int]  # indices into record.chunk_tokens
    stale_keys: list[str]  # chunks of the previous record that the new one no longer uses
    replaced_tokens: int = 0  # tokens the previous record held


class SessionStore:
    """Session records and KV chunks over one ChunkStore; safe to use from several threads."""

    def __init__(self, store: ChunkStore, identity: str, chunk_tokens: int, ttl_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.identity = identity
        self.chunk_tokens = chunk_tokens
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.RLock()
        self._next_sweep = 0.0

    # -- records --------------------------------------------------------------------------------------
    def record(self, session_id: str) -> SessionRecord | None:
        """The session's record; None when unknown, expired (then dropped) or made by another model."""
        with self._lock:
            data = self.store.get(session_key(session_id) + META_SUFFIX)
            if data is None:
                return None
            try:
                record = SessionRecord(**json.loads(data))
            except (ValueError, TypeError):  # unreadable record: the session is lost, not an error
                self._drop(session_id, None)
                return None
            if record.session_id != session_id or record.identity != self.identity:
                return None
            if record.last_used + self.ttl_s < self.clock():
                self._drop(session_id, record)
                return None
            return record

    def _write_record(self, record: SessionRecord) -> bool:
        return self.store.put(session_key(record.session_id) + META_SUFFIX, json.dumps(asdict(record)).encode())

    def info(self, session_id: str) -> dict | None:
        record = self.record(session_id)
        return None if record is None else record.info()

    def delete(self, session_id: str) -> bool:
        """Drop the session's record and chunks; False when there was no such session."""
        with self._lock:
            data = self.store.get(session_key(session_id) + META_SUFFIX)
            if data is None:
                return False
            try:
                record: SessionRecord | None = SessionRecord(**json.loads(data))
            except (ValueError, TypeError):
                record = None
            self._drop(session_id, record)
            return True

    def _drop(self, session_id: str, record: SessionRecord | None) -> None:
        for key in record.chunk_keys() if record is not None else []:
            self.store.delete(key)
        self.store.delete(session_key(session_id) + META_SUFFIX)

    def set_summary(self, session_id: str, summary: dict | None) -> None:
        """Store the anchoring summary in the session's record (a record is made if there is none)."""
        with self._lock:
            now = self.clock()
            record = self.record(session_id) or SessionRecord(session_id, self.identity, now, now)
            record.summary = summary
            record.last_used = now
            self._write_record(record)

    # -- KV chunks ------------------------------------------------------------------------------------
    def load_prefix(self, session_id: str, prompt_ids: list[int], start_chunk: int = 0) -> list[bytes]:
        """Payloads of the stored chunks, from `start_chunk` on, whose tokens begin `prompt_ids`.

        Stops at the first chunk whose tokens differ from the prompt, or that is missing or corrupt
        (the store drops a corrupt entry): the caller recomputes from there.
        """
        with self._lock:
            record = self.record(session_id)
            if record is None:
                return []
            payloads, start = [], 0
            for i, tokens in enumerate(record.chunk_tokens):
                end = start + len(tokens)
                if prompt_ids[start:end] != tokens:
                    break
                if i >= start_chunk:
                    data = self.store.get(record.chunk_keys()[i])
                    if data is None:
                        break
                    payloads.append(data)
                start = end
            record.last_used = self.clock()
            self._write_record(record)
            return payloads

    def plan_save(self, session_id: str, token_ids: list[int]) -> SavePlan:
        """Chunks of `token_ids` (full blocks only, as the caller trims them) and which must be written."""
        with self._lock:
            now = self.clock()
            old = self.record(session_id)
            chunks = [token_ids[i:i + self.chunk_tokens] for i in range(0, len(token_ids), self.chunk_tokens)]
            record = SessionRecord(session_id, self.identity, old.created if old else now, now,
                                   turns=(old.turns if old else 0) + 1, chunk_tokens=chunks,
                                   chunk_hashes=document_hashes(self.identity, chunks),
                                   chunk_bytes=[0] * len(chunks), summary=old.summary if old else None)
            kept = {}
            if old is not None:
                kept = {key: size for key, size in zip(old.chunk_keys(), old.chunk_bytes) if key in self.store}
            keys = record.chunk_keys()
            new_chunks = []
            for i, key in enumerate(keys):
                if key in kept:
                    record.chunk_bytes[i] = kept[key]
                else:
                    new_chunks.append(i)
            stale = [] if old is None else [k for k in old.chunk_keys() if k not in set(keys)]
            return SavePlan(record, new_chunks, stale, old.num_tokens if old else 0)

    def commit(self, plan: SavePlan, payloads: list[bytes]) -> bool:
        """Write the plan's new chunks (one payload each, in order), then the record; False if the store
        refused a chunk (it keeps the chunks written before it, and the record covers only those)."""
        record = plan.record
        keys = record.chunk_keys()
        written = len(record.chunk_tokens)
        for i, data in zip(plan.new_chunks, payloads):  # outside the lock: other sessions' reads go on
            if not self.store.put(keys[i], data):
                written = i
                break
            record.chunk_bytes[i] = len(data)
        with self._lock:
            for key in plan.stale_keys + keys[written:]:
                self.store.delete(key)
            for name in ("chunk_tokens", "chunk_hashes", "chunk_bytes"):
                setattr(record, name, getattr(record, name)[:written])
            ok = self._write_record(record) and written == len(keys)
            self._enforce_limits(keep=record.session_id)
            return ok

    # -- expiry and size cap --------------------------------------------------------------------------
    def records(self) -> list[SessionRecord]:
        """Every live session of this model (expired ones are dropped on the way)."""
        out = []
        for key in list(self.store.keys()):
            if not key.endswith(META_SUFFIX):
                continue
            data = self.store.get(key)
            try:
                session_id = json.loads(data)["session_id"] if data is not None else None
            except (ValueError, TypeError, KeyError):
                session_id = None
            record = self.record(session_id) if session_id is not None else None
            if record is not None:
                out.append(record)
        return out

    def _enforce_limits(self, keep: str) -> None:
        now = self.clock()
        over = self.store.nbytes > self.max_bytes
        if not over and now < self._next_sweep:
            return
        self._next_sweep = now + min(SWEEP_INTERVAL_S, self.ttl_s)
        records = sorted(self.records(), key=lambda r: r.last_used)  # records() drops the expired ones
        for record in records:
            if self.store.nbytes <= self.max_bytes:
                break
            if record.session_id != keep:
                self._drop(record.session_id, record)
