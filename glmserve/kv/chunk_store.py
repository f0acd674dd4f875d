"""Byte stores for KV chunks that leave the device pool: an ABC with an LRU byte budget, and a disk store.

Interface (stable; the session store and the KV tiers build on it):

- keys are `str` (any text; the disk store names files by a digest of the key and keeps the key in the
  file's header). Callers put a model/KV-layout identity into their keys (see `glmserve.kv.kv_io.kv_identity`)
  so that KV of one model can never be read back for another.
- `put(key, data) -> bool`: stores (or replaces) the entry; evicts least-recently-used entries to fit the
  byte budget; False when the entry cannot fit even in an empty store, or the backend failed (disk full):
  then nothing of the new entry is left behind and the old entry under that key, if any, is gone.
- `get(key) -> bytes | None`: the payload, or None when missing, truncated or corrupt (a checksum is
  verified on every read; a bad entry is deleted). A hit makes the entry most recently used.
- `touch(key) -> bool`: makes an entry most recently used without reading it (False when absent).
- `delete(key)`, `key in store`, `keys()` (LRU order, oldest first), `nbytes` (bytes used, headers
  included), `budget` (bytes allowed).

Subclasses implement `_write`, `_read`, `_remove`; `LruIndex` holds the LRU order and sizes for them.
Every public method is thread-safe (one lock per store).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path

from glmserve.errors import InvalidRequestError


class LruIndex:
    """Sizes of stored entries in LRU order (first = least recently used) and their byte total."""

    def __init__(self) -> None:
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.nbytes = 0

    def add(self, key: str, size: int) -> None:
        self.discard(key)
        self.sizes[key] = size
        self.nbytes += size

    def discard(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.nbytes -= size

    def touch(self, key: str) -> None:
        self.sizes.move_to_end(key)

    def oldest(self) -> str:
        return next(iter(self.sizes))


class ChunkStore(ABC):
    """A byte store with an LRU byte budget; see the module docstring for the contract."""

    def __init__(self, budget: int):
        if budget <= 0:
            raise InvalidRequestError(f"chunk store budget must be positive, got {budget}")
        self.budget = budget
        self.index = LruIndex()
        self.lock = threading.RLock()  # guards the index; file I/O runs outside it
        self.writing: set[str] = set()  # keys whose entry is being written (in the index, not yet readable)

    # -- backend ------------------------------------------------------------------------------------------
    @abstractmethod
    def _write(self, key: str, data: bytes) -> int | None:
        """Stores the entry atomically; returns the bytes it takes, or None on failure (nothing left behind)."""

    @abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The verified payload, or None when it is missing, truncated or corrupt."""

    @abstractmethod
    def _remove(self, key: str) -> None:
        """Deletes the entry; a missing entry is no error."""

    def entry_size(self, key: str, data: bytes) -> int:
        """Bytes an entry takes against the budget."""
        return len(data)

    def _touched(self, key: str) -> None:
        """Called on a hit; a backend that keeps LRU order across restarts records it here."""
        return None

    # -- public API ---------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def put(self, key: str, data: bytes) -> bool:
        """Room is reserved under the lock, the write runs outside it (readers of other keys never wait for a
        write); an entry deleted or evicted while it was being written is removed once written."""
        size = self.entry_size(key, data)
        with self.lock:
            if key in self.writing:  # a concurrent put of the same key wins
                return False
            self.delete(key)
            if size > self.budget:
                return False
            while self.index.nbytes + size > self.budget:
                self.delete(self.index.oldest())
            self.index.add(key, size)
            self.writing.add(key)
        written = None
        try:
            written = self._write(key, data)
        finally:
            with self.lock:
                self.writing.discard(key)
                if written is None:
                    self.index.discard(key)
                elif key not in self.index.sizes:
                    self._remove(key)
                    written = None
                else:
                    self.index.add(key, written)
        return written is not None

    def get(self, key: str) -> bytes | None:
        if key not in self:
            return None
        data = self._read(key)
        with self.lock:
            if key in self.writing or key not in self.index.sizes:  # replaced or deleted meanwhile
                return None
            if data is None:
                self.delete(key)
                return None
            self.index.touch(key)
            self._touched(key)
            return data

    def touch(self, key: str) -> bool:
        """Makes the entry most recently used without reading it; False when it is not stored."""
        with self.lock:
            if key not in self:
                return False
            self.index.touch(key)
            self._touched(key)
            return True

    def delete(self, key: str) -> None:
        with self.lock:
            if key in self.index.sizes:
                self._remove(key)
                self.index.discard(key)

    def __contains__(self, key: object) -> bool:
        """True for a complete entry (not one still being written)."""
        with self.lock:
            return key in self.index.sizes and key not in self.writing

    def keys(self) -> list[str]:
        with self.lock:
            return [k for k in self.index.sizes if k not in self.writing]


MAGIC = b"GLMKVCH\x00"
VERSION = 2
# magic, version, key length, payload length, crc32 of key + payload (corruption, not tampering: crc32 runs
# ~5x faster than blake2b here, and a 47 MB chunk is checked on every read)
_HEADER = struct.Struct("<8sIIQI")
SUFFIX = ".chunk"
TEMP_SUFFIX = ".tmp"


def _checksum(key: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key))


class DiskChunkStore(ChunkStore):
    """One file per entry under `root`: header (magic, version, lengths, checksum), key, payload.

    Writes go to a temp file in the same directory, are fsynced, then `os.replace`d into place, so a
    reader (or a restart after a crash) sees the whole old entry, the whole new one, or none. A new store
    on the same directory rebuilds its index from the headers (oldest modification first) and removes
    temp leftovers and files that are not valid entries. Reads re-verify the checksum. Disk full (or any
    OSError) while writing: `put` returns False and the temp file is removed.
    """

    def __init__(self, root: str | os.PathLike, budget: int):
        super().__init__(budget)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._last_stamp = 0
        self._scan()

    def _path(self, key: str) -> Path:
        return self.root / (hashlib.blake2b(key.encode(), digest_size=20).hexdigest() + SUFFIX)

    def entry_size(self, key: str, data: bytes) -> int:
        return _HEADER.size + len(key.encode()) + len(data)

    def _touched(self, key: str) -> None:
        try:
            self._stamp(self._path(key))
        except OSError:
            pass

    def _stamp(self, path: Path) -> None:
        """Sets a strictly increasing modification time: it orders the index rebuilt after a restart (the
        file system's own timestamps are too coarse to order writes a few milliseconds apart)."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        os.utime(path, ns=(self._last_stamp, self._last_stamp))

    def _scan(self) -> None:
        found = []
        for path in self.root.iterdir():
            if path.name.endswith(TEMP_SUFFIX):
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                key = self._read_key(path)
                if key is None or self._path(key) != path:
                    path.unlink(missing_ok=True)
                else:
                    stat = path.stat()
                    found.append((stat.st_mtime_ns, key, stat.st_size))
        for stamp, key, size in sorted(found):
            self.index.add(key, size)
            self._last_stamp = max(self._last_stamp, stamp)
        while self.index.nbytes > self.budget:  # a smaller budget than the last run's
            self.delete(self.index.oldest())

    @staticmethod
    def _read_key(path: Path) -> str | None:
        """The key in a file's header, or None when the header is not ours or the file is too short."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return None
                magic, version, key_len, payload_len, _ = _HEADER.unpack(head)
                if magic != MAGIC or version != VERSION:
                    return None
                if os.fstat(f.fileno()).st_size != _HEADER.size + key_len + payload_len:
                    return None
                return f.read(key_len).decode()
        except (OSError, UnicodeDecodeError):
            return None

    def _write(self, key: str, data: bytes) -> int | None:
        path = self._path(key)
        temp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}")
        key_bytes = key.encode()
        header = _HEADER.pack(MAGIC, VERSION, len(key_bytes), len(data), _checksum(key_bytes, data))
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(key_bytes)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._stamp(temp)
            os.replace(temp, path)
        except OSError as e:
            temp.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
                raise
            return None
        return len(header) + len(key_bytes) + len(data)

    def _read(self, key: str) -> bytes | None:
        key_bytes = key.encode()
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return None
                magic, version, key_len, payload_len, checksum = _HEADER.unpack(head)
                if (magic != MAGIC or version != VERSION or key_len != len(key_bytes)
                        or os.fstat(f.fileno()).st_size != _HEADER.size + key_len + payload_len
                        or f.read(key_len) != key_bytes):
                    return None
                payload = f.read(payload_len)
        except OSError:
            return None
        if len(payload) != payload_len or _checksum(key_bytes, payload) != checksum:
            return None
        return payload

    def _remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
