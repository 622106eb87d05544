"""Hot data on MongoDB: logically sharded counters and the idempotent stats lock, per briefcase.

Both live in mdb's collections on the briefcase's shard (``mdb_counters``, ``mdb_stats_lock``),
each document carrying the briefcase key field (the shard key on a mongos cluster; moves take
them with the briefcase) and an ``_id`` text that starts with the briefcase GDID's hex, and both are used inside a briefcase context, on its
session: on a transactional server their writes commit or abort with the context's work.

- Counter: K slot documents ``_id = "{gdid hex}:{counter}:{slot}"``; an increment ``$inc``s one slot chosen at
  random with an upsert, so concurrent writers collide with probability 1/K; a read sums the
  slots. Reads sum every slot document that exists, so K may change between releases.
- Stats lock: ``apply(bc, event, state, calculation, effect)`` upserts the lock document
  ``_id = "{gdid hex}:{event}:{state}:{calculation}"`` with ``$setOnInsert``: the upsert that
  inserted it (``upserted_id``) is the first delivery and runs ``effect``; any other delivery
  matches the existing document and skips. With transactions the lock and the effect's
  ``$inc`` commit together (two concurrent first deliveries conflict and one is retried, then
  skips). Without transactions each write commits alone: the lock is written with
  ``done: false`` and marked done after the effect, so a crash between the two is visible in
  :meth:`MongoStatsLock.unfinished` (at-most-once, never twice).

The ``_id`` texts are not hashed, so two keys can only share one if the text is ambiguous. It
is not: the GDID hex is always 24 characters, a slot is digits, and state and calculation may
not contain ``:``, so splitting off the prefix and then from the right recovers every part (an
event id or counter name may contain ``:``). Names are checked as on SQL (no control
characters; :func:`mdb.hot.tables.check_name`), K is an int, deltas fit 64 bits.

Differences from the SQL counters, on purpose: K is not persisted but given per process
(``MongoCounter(name, slots=K)``) and a read sums every slot document there is, so a new K
takes effect as each process starts with it and no total is ever orphaned. MongoDB does not
make a transaction wait for a document another one is writing (the second write aborts with a
transient error, which :meth:`mdb.mongo.MongoStore.documents` raises as a RetryableError), so
two increments of one counter in one transaction cannot deadlock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, Final

from mdb.errors import StatsError
from mdb.mongo.store import DocumentBriefcase
from mdb.hot.tables import LABEL_LENGTH, NAME_LENGTH, check_name

__all__ = ["COUNTERS", "STATS_LOCK", "MongoCounter", "MongoStatsLock"]

COUNTERS: Final = "mdb_counters"
STATS_LOCK: Final = "mdb_stats_lock"
MAX_SLOTS: Final = 4096
_INT64: Final = range(-(2**63), 2**63)


def _session(bc: DocumentBriefcase) -> Any:
    return bc.session if bc.transactional else None


def _writable(bc: DocumentBriefcase, what: str) -> None:
    if bc.readonly:
        raise StatsError(f"{what}: the briefcase context of {bc.dtype.key}={bc.gdid} is readonly")


class MongoCounter:
    """One named counter of every briefcase of a document type, spread over ``slots`` documents."""

    def __init__(self, name: str, *, slots: int = 8) -> None:
        check_name("counter name", name, LABEL_LENGTH)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise StatsError(f"counter {name!r}: slots must be an integer between 1 and {MAX_SLOTS}, got {slots!r}")
        self.name = name
        self.slots = slots

    def __repr__(self) -> str:
        return f"MongoCounter({self.name!r}, slots={self.slots})"

    def add(self, bc: DocumentBriefcase, **deltas: int) -> int:
        """``$inc`` the named values in one random slot; returns the slot used."""
        _writable(bc, f"counter {self.name!r}")
        if not deltas or not all(isinstance(v, int) and not isinstance(v, bool) for v in deltas.values()):
            raise StatsError(f"counter {self.name!r}: give integer deltas by name, e.g. add(bc, amount=5), got {deltas!r}")
        bad = [k for k in deltas if k.startswith(("$", "_")) or "." in k or k in (bc.dtype.key, "counter", "slot")]
        if bad:
            raise StatsError(f"counter {self.name!r}: value names {bad} are reserved or not plain field names")
        for k, v in deltas.items():
            if v not in _INT64:
                raise StatsError(f"counter {self.name!r}: value {k!r} = {v} is outside the 64-bit integer range")
        slot = random.randrange(self.slots)
        key = bytes(bc.gdid)
        bc.db[COUNTERS].update_one(
            {"_id": f"{bc.gdid.hex}:{self.name}:{slot}"},
            {"$inc": {f"v.{k}": v for k, v in deltas.items()}, "$setOnInsert": {bc.dtype.key: key, "counter": self.name, "slot": slot}},
            upsert=True, session=_session(bc),
        )
        return slot

    def read(self, bc: DocumentBriefcase) -> dict[str, int]:
        """The counter's totals (sum over its slot documents)."""
        totals: dict[str, int] = {}
        for doc in bc.db[COUNTERS].find({bc.dtype.key: bytes(bc.gdid), "counter": self.name}, session=_session(bc)):
            for k, v in (doc.get("v") or {}).items():
                totals[k] = totals.get(k, 0) + int(v)
        return totals


class MongoStatsLock:
    """Exactly-once effects from at-least-once events, per briefcase (see the module docstring)."""

    def apply(
        self, bc: DocumentBriefcase, event_id: str, state: str, calculation: str, effect: Callable[[DocumentBriefcase], Any],
    ) -> bool:
        """Run ``effect(bc)`` unless ``calculation`` was already applied for ``event_id:state``; True if this call did."""
        _writable(bc, "stats lock")
        _check_lock_names(event_id, state, calculation, write=True)
        lock_id = f"{bc.gdid.hex}:{event_id}:{state}:{calculation}"
        session = _session(bc)
        result = bc.db[STATS_LOCK].update_one(
            {"_id": lock_id},
            {"$setOnInsert": {bc.dtype.key: bytes(bc.gdid), "event_id": event_id, "state": state,
                              "calculation": calculation, "done": bc.transactional, "at": time.time()}},
            upsert=True, session=session,
        )
        if result.upserted_id is None:
            return False
        try:
            effect(bc)
        except BaseException:
            bc.db[STATS_LOCK].delete_one({"_id": lock_id}, session=session)  # the effect did not happen: release
            raise
        if not bc.transactional:
            bc.db[STATS_LOCK].update_one({"_id": lock_id}, {"$set": {"done": True}})
        return True

    def applied(self, bc: DocumentBriefcase, event_id: str, state: str) -> set[str]:
        _check_lock_names(event_id, state, None, write=False)
        docs = bc.db[STATS_LOCK].find({bc.dtype.key: bytes(bc.gdid), "event_id": event_id, "state": state}, session=_session(bc))
        return {d["calculation"] for d in docs}

    def unfinished(self, bc: DocumentBriefcase) -> list[str]:
        """Locks taken without transactions whose effect may not have run (a crash between the two)."""
        docs = bc.db[STATS_LOCK].find({bc.dtype.key: bytes(bc.gdid), "done": False}, session=_session(bc))
        return sorted(d["_id"].split(":", 1)[1] for d in docs)


def _check_lock_names(event_id: object, state: object, calculation: object | None, *, write: bool) -> None:
    """The lock's key parts by name; state and calculation without ':' so the ``_id`` stays unambiguous."""
    check_name("stats lock: event id", event_id, NAME_LENGTH, write=write)
    parts = [("state", state), *([("calculation", calculation)] if calculation is not None else [])]
    for what, value in parts:
        check_name(f"stats lock: {what}", value, LABEL_LENGTH, write=write)
        if ":" in str(value):
            raise StatsError(f"stats lock: {what} {value!r} may not contain ':' (it separates the parts of the lock's _id)")
