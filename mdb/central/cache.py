"""The in-process CENTRAL lookup cache: bounded LRU, a TTL, negative entries, counters.

CENTRAL is read far more than written, so every process keeps the answers it has seen. The
TTL bounds how long another process's write can go unseen; this process's own writes drop
their entries at once. A positive entry can still be stale within the TTL (another process
renamed the key away); :mod:`mdb.central.service` confirms positive hits on the briefcase root,
so staleness costs a re-read, never a wrong answer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mdb.gdid import GDID

__all__ = ["CacheStats", "CentralCache"]

CacheKey = tuple[str, str]  # (index name, normalized key)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    """Lookups answered from the cache (negative answers included)."""
    negative_hits: int
    misses: int
    stale: int
    """Positive hits the briefcase root contradicted (dropped and re-read)."""
    evictions: int
    expirations: int
    size: int
    max_entries: int
    ttl: float

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class CentralCache:
    """Thread-safe LRU of ``(index, key) -> GDID | None`` with a per-entry expiry."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"cache max_entries must be at least 1, got {max_entries}")
        if ttl < 0:
            raise ValueError(f"cache ttl must not be negative, got {ttl}")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[CacheKey, tuple[GDID | None, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._negative_hits = self._misses = self._stale = self._evictions = self._expirations = 0

    def get(self, key: CacheKey) -> tuple[bool, GDID | None]:
        """``(True, value)`` on a fresh hit, ``(False, None)`` on a miss (an expired entry is a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return False, None
            value, expires = entry
            if self._clock() >= expires:
                del self._entries[key]
                self._expirations += 1
                self._misses += 1
                return False, None
            self._entries.move_to_end(key)
            self._hits += 1
            if value is None:
                self._negative_hits += 1
            return True, value

    def put(self, key: CacheKey, value: GDID | None) -> None:
        with self._lock:
            self._entries[key] = (value, self._clock() + self.ttl)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self._evictions += 1

    def invalidate(self, key: CacheKey) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def note_stale(self, key: CacheKey) -> None:
        """A positive hit turned out wrong: drop it and count it."""
        with self._lock:
            self._entries.pop(key, None)
            self._stale += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._negative_hits, self._misses, self._stale, self._evictions, self._expirations,
                len(self._entries), self.max_entries, self.ttl,
            )
