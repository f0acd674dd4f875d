"""Which backend serves a request: a session (`X-Session-Id` header or `session_id` field) by consistent hashing
with bounded loads, else the prompt's leading characters (prefix affinity: the replica that already holds the
prefix's KV), else the least loaded backend.

Bounded loads follow Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018):
walk the ring clockwise from the key's point and take the first backend whose load is below
ceil(c * (total load + 1) / n); an overloaded backend is skipped even when the key hashes to it."""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from typing import Any

from glmserve.gateway.backends import Backend

VNODES = 64  # ring points per backend


def key_hash(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def prompt_text(payload: dict[str, Any]) -> str:
    """The prompt as routing sees it: chat messages as `role: text` lines (text parts only), or the completion
    prompt (the first one of a list; token ids as their decimal text)."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        lines = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            lines.append(f"{message.get('role', '')}: {content if isinstance(content, str) else ''}")
        return "\n".join(lines)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str | list) else prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


class HashRing:
    """VNODES points per backend on a 64-bit ring."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        points = sorted((key_hash(f"{b.url}#{i}"), n) for n, b in enumerate(backends) for i in range(VNODES))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]
        self.backends = tuple(backends)

    def walk(self, key: int) -> list[Backend]:
        """The backends in ring order from `key`, each once."""
        start = bisect.bisect(self._hashes, key)
        seen: dict[int, None] = {}
        size = len(self._owners)
        for i in range(size):
            seen.setdefault(self._owners[(start + i) % size])
            if len(seen) == len(self.backends):
                break
        return [self.backends[n] for n in seen]


class Router:
    def __init__(self, load_factor: float, prefix_chars: int, min_prefix_chars: int = 32) -> None:
        self.load_factor = load_factor
        self.prefix_chars = prefix_chars
        self.min_prefix_chars = min_prefix_chars
        self._rings: dict[tuple[Backend, ...], HashRing] = {}

    def ring(self, group: tuple[Backend, ...]) -> HashRing:
        ring = self._rings.get(group)
        if ring is None:
            ring = self._rings[group] = HashRing(group)
        return ring

    def affinity_key(self, session_id: str | None, prompt: str) -> tuple[str, int | None]:
        """(rule, ring key): `session`, `prefix` or `least_loaded` (no key)."""
        if session_id:
            return "session", key_hash("s:" + session_id)
        if len(prompt) >= self.min_prefix_chars:
            return "prefix", key_hash("p:" + prompt[: self.prefix_chars])
        return "least_loaded", None

    def choose(self, ring_group: tuple[Backend, ...], candidates: Sequence[Backend], key: int | None) -> Backend | None:
        """A backend among `candidates` (the available ones, maybe standbys outside `ring_group`)."""
        if not candidates:
            return None
        if key is not None and len(candidates) > 1:
            allowed = set(candidates)
            total = sum(b.load for b in candidates)
            capacity = math.ceil(self.load_factor * (total + 1) / len(candidates))
            ring = self.ring(ring_group) if allowed <= set(ring_group) else self.ring(tuple(candidates))
            for backend in ring.walk(key):
                if backend in allowed and backend.load < capacity:
                    return backend
        elif key is not None:
            return candidates[0]
        least = min(b.load for b in candidates)
        return random.choice([b for b in candidates if b.load == least])
