"""Logically sharded counters: one hot total spread over K rows so writers rarely collide.

A counter ``C`` is stored as up to K slot rows ``C:0 .. C:K-1`` of a counter family (see
:func:`mdb.hot.tables.counter_tables`); every row holds all the family's named values. An
increment picks a slot at random and adds every given value in ONE statement
(``UPDATE .. SET v = v + :delta WHERE counter = :c AND slot = :n``) on a slot row created at
zero together with K, so two concurrent writers only wait for each other when they pick the
same slot (probability 1/K). A read sums the counter's rows: K rows, the price paid for the
spread.

Why an UPDATE and not an upsert: a slot row is unique twice, by its derived primary key and by
``(counter, slot)``. PostgreSQL's ``ON CONFLICT (counter, slot) DO UPDATE`` pre-checks only its
arbiter index, and that pre-check can miss a row that a concurrent writer is updating to a new
version (CI saw it: ``UniqueViolation`` on ``pk_…`` with 8 writers on K = 1); the insert it
then attempts raises on the primary key, which is not an arbiter. An UPDATE waits on the row
lock and re-reads the row, so it never raises under contention.

One slot per (transaction, counter): the first increment of a counter in a transaction picks
the slot at random, later ones in the same transaction reuse it. With a fresh pick each time, a
transaction holding slot a and then wanting slot b waits for one holding b that then wants a:
a deadlock (K = 2, two threads each doing ``add; add``: 8 in 40 rounds). Holding one row lock
per counter, a transaction never waits for a second row of that counter while holding the
first. Deadlocks that remain (two counters taken in opposite orders by the application) and
serialization failures surface as :class:`~mdb.errors.TransactionConflictError` (retryable)
through the place's transaction.

K is persisted per counter (``{family}_config``) and may grow but never shrink: slot rows
n >= K already hold part of the total, and a shrunk K would orphan them (no writer would add
to them again, and a reader bound to the new K would drop them). Because K only grows, a
process that cached an older, smaller K still writes to valid slots: the cache is never wrong,
merely less spread. It is re-read once it is ``max_k_age`` seconds old, so a raised K reaches
every live writer within that time (one indexed SELECT per counter and place per
``max_k_age``).
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select, update

from mdb.errors import StatsError
from mdb.session import BriefcaseSession
from mdb.dialects import sql_dialect
from mdb.hot.scope import Scope, insert_once, place_of
from mdb.hot.tables import NAME_LENGTH, CounterTables, check_name, derived_gdid

__all__ = ["MAX_SLOTS", "Counters"]

MAX_SLOTS = 4096
DEFAULT_MAX_K_AGE = 10.0
"""Seconds a process keeps a counter's K before reading it again (how long a K raise takes to spread)."""
_INT64 = range(-(2**63), 2**63)

# The slot each open transaction increments, per (family, server, briefcase key, counter). Keyed
# weakly by the SQLAlchemy transaction object, so an entry dies with its transaction.
_TXN_SLOTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, Any, str], int]] = weakref.WeakKeyDictionary()
_TXN_SLOTS_LOCK = threading.Lock()


class Counters:
    """Operations on one counter family.

    ``default_slots`` is K of a counter used before it is configured; ``max_k_age`` is how many
    seconds a cached K is trusted before it is read again (a raised K reaches this writer
    within that time).
    """

    def __init__(self, tables: CounterTables, *, default_slots: int = 1, max_k_age: float = DEFAULT_MAX_K_AGE) -> None:
        _check_slots(default_slots, "default_slots")
        if isinstance(max_k_age, bool) or not isinstance(max_k_age, (int, float)) or not 0 <= max_k_age <= 3600:
            raise StatsError(f"max_k_age must be a number of seconds in 0..3600, got {max_k_age!r}")
        self.tables = tables
        self.default_slots = default_slots
        self.max_k_age = float(max_k_age)
        self._slots: dict[tuple[Any, Any, str], tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._random = random.Random()

    def __repr__(self) -> str:
        return f"Counters({self.tables.rows.name!r}, values={list(self.tables.values)})"

    # -- configuration ----------------------------------------------------------------------------

    def configure(self, target: Scope | BriefcaseSession, counter: str, slots: int) -> int:
        """Set K of ``counter`` (creating it); growing is allowed, shrinking is refused. Returns K."""
        _check_slots(slots, "slots (K)")
        place = self._place(target, counter, write=True)
        cfg = self.tables.config
        where = self._where(place, cfg, counter)
        insert_once(place, cfg, "config_id", {"config_id": _config_id(counter), "counter": counter, "slots": slots}, ("counter",))
        current = place.conn.execute(select(cfg.c.slots).where(*where).with_for_update()).scalar_one()
        if slots < current:
            raise StatsError(
                f"counter {counter!r} in {place.where}: refusing to shrink K from {current} to {slots}: "
                f"slot rows {slots}..{current - 1} already hold part of the total and would be orphaned "
                "(K may only grow)"
            )
        if slots > current:
            place.conn.execute(update(cfg).where(*where).values(slots=slots, updated_at=func.current_timestamp()))
        self._create_slot_rows(place, counter, max(slots, current))
        self._remember(place, counter, slots)
        return slots

    def slots(self, target: Scope | BriefcaseSession, counter: str) -> int:
        """K of ``counter`` as persisted (``default_slots`` when it was never configured)."""
        place = self._place(target, counter, write=False)
        return self._load_slots(place, counter)

    # -- increments and reads ---------------------------------------------------------------------

    def add(self, target: Scope | BriefcaseSession, counter: str, **deltas: int) -> int:
        """Add ``deltas`` (value name -> amount) to one slot, in one statement; returns the slot.

        The slot is random, and the same for every increment of ``counter`` in one transaction.
        """
        place = self._place(target, counter, write=True)
        self._check_deltas(counter, deltas)
        k = self._current_slots(place, counter)
        slot = self._slot_for(place, counter, k)
        rows = self.tables.rows
        stmt = (
            update(rows)
            .where(*self._where(place, rows, counter), rows.c.slot == slot)
            .values({name: rows.c[name] + amount for name, amount in deltas.items()})
        )
        if place.conn.execute(stmt).rowcount == 1:
            return slot
        # The slot row is missing: a counter configured before slot rows were created with K,
        # or rows deleted by hand. Create the K rows (conflict-free) and add once more.
        self._create_slot_rows(place, counter, k)
        if place.conn.execute(stmt).rowcount != 1:
            raise StatsError(f"counter {counter!r} in {place.where}: slot row {slot} could not be created")
        return slot

    def read(self, target: Scope | BriefcaseSession, counter: str) -> dict[str, int]:
        """The counter's totals: every value summed over its slot rows (0 for a counter never written)."""
        place = self._place(target, counter, write=False)
        rows = self.tables.rows
        sums = [func.coalesce(func.sum(rows.c[name]), 0) for name in self.tables.values]
        got = place.conn.execute(select(*sums).where(*self._where(place, rows, counter))).one()
        return {name: int(v) for name, v in zip(self.tables.values, got)}

    def slot_rows(self, target: Scope | BriefcaseSession, counter: str) -> dict[int, dict[str, int]]:
        """slot -> values of the counter's rows (for inspection and tests)."""
        place = self._place(target, counter, write=False)
        rows = self.tables.rows
        result = place.conn.execute(
            select(rows.c.slot, *(rows.c[v] for v in self.tables.values)).where(*self._where(place, rows, counter))
        )
        return {r[0]: {v: int(r[i + 1]) for i, v in enumerate(self.tables.values)} for r in result}

    # -- helpers ------------------------------------------------------------------------------------

    def _place(self, target: Scope | BriefcaseSession, counter: str, *, write: bool) -> Scope:
        check_name("counter id", counter, NAME_LENGTH, write=write)
        place = place_of(target)
        place.check(self.tables.tables, self.tables.key_column, write=write)
        place.check_routed(counter)
        return place

    def _check_deltas(self, counter: str, deltas: Mapping[str, object]) -> None:
        if not deltas:
            raise StatsError(f"counter {counter!r}: nothing to add (name the values, e.g. add(s, {counter!r}, value=1))")
        unknown = sorted(set(deltas) - set(self.tables.values))
        if unknown:
            raise StatsError(f"counter family {self.tables.rows.name!r} has no values {unknown} (it has {list(self.tables.values)})")
        for name, amount in deltas.items():
            if isinstance(amount, bool) or not isinstance(amount, int):
                raise StatsError(f"counter {counter!r}: value {name!r} must be an integer (int), got {type(amount).__name__} {amount!r}")
            if amount not in _INT64:
                raise StatsError(f"counter {counter!r}: value {name!r} = {amount} is outside the 64-bit integer range")

    def _slot_for(self, place: Scope, counter: str, k: int) -> int:
        """The slot this transaction increments ``counter`` in: picked once, then reused.

        K only grows, so a slot picked under an earlier K stays valid.
        """
        txn = place.conn.get_transaction()
        key = (self.tables.rows.name, place.server, place.key, counter)
        with _TXN_SLOTS_LOCK:
            chosen = _TXN_SLOTS.setdefault(txn, {})
            if key not in chosen:
                chosen[key] = self._random.randrange(k)
            return chosen[key]

    def _create_slot_rows(self, place: Scope, counter: str, slots: int) -> None:
        """Create the zero rows of slots 0..K-1 together with K, so increments only ever update.

        ON CONFLICT DO NOTHING with no target covers both unique indexes (primary key and
        (counter, slot)), so creators racing here never raise. Afterwards every slot row must
        exist: one that does not had its derived id taken by a row of another counter (a
        clash), and increments to it would fail; that is an error here, not later.
        """
        rows = self.tables.rows
        place.conn.execute(
            sql_dialect(place.conn).insert(rows)
            .values([
                {**place.key_values(), "row_id": _row_id(counter, n), "counter": counter, "slot": n}
                for n in range(slots)
            ])
            .on_conflict_do_nothing()
        )
        present = set(place.conn.execute(select(rows.c.slot).where(*self._where(place, rows, counter), rows.c.slot < slots)).scalars())
        missing = sorted(set(range(slots)) - present)
        if missing:
            raise StatsError(
                f"counter {counter!r} in {place.where}: slot rows {missing[:10]} could not be created: their derived ids "
                f"are already used by other rows of {rows.name!r} (a derived-id clash)"
            )

    def _where(self, place: Scope, table: Any, counter: str) -> list[Any]:
        conds = [table.c[k] == v for k, v in place.key_values().items()]
        return [*conds, table.c.counter == counter]

    def _cache_key(self, place: Scope, counter: str) -> tuple[Any, Any, str]:
        # The database itself (its engine's URL), not the server's name: a name can come to mean
        # another database (a changed URL in a new map version, a test's fresh database), and K,
        # which only grows within one database, would then be carried over as the larger K.
        return (place.conn.engine.url, place.key, counter)

    def _remember(self, place: Scope, counter: str, slots: int) -> None:
        key = self._cache_key(place, counter)
        with self._lock:
            known = self._slots.get(key, (0, 0.0))[0]
            self._slots[key] = (max(slots, known), time.monotonic())

    def _current_slots(self, place: Scope, counter: str) -> int:
        """K for an increment: the cached K while it is younger than ``max_k_age``, else re-read."""
        cached = self._slots.get(self._cache_key(place, counter))
        if cached is not None and time.monotonic() - cached[1] < self.max_k_age:
            return cached[0]
        return self._load_slots(place, counter, persist=True)

    def _load_slots(self, place: Scope, counter: str, *, persist: bool = False) -> int:
        cfg = self.tables.config
        query = select(cfg.c.slots).where(*self._where(place, cfg, counter))
        k = place.conn.execute(query).scalar()
        if k is None and persist:
            # First write of a counter never configured: persist the default K, so a later
            # configure() knows which slots may already hold values.
            insert_once(place, cfg, "config_id", {"config_id": _config_id(counter), "counter": counter, "slots": self.default_slots}, ("counter",))
            k = place.conn.execute(query).scalar_one()
            self._create_slot_rows(place, counter, int(k))
        slots = self.default_slots if k is None else int(k)
        if k is not None:
            self._remember(place, counter, slots)
        return slots


def _check_slots(slots: object, what: str) -> None:
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise StatsError(f"{what} must be an integer in 1..{MAX_SLOTS}, got {slots!r}")


def _row_id(counter: str, slot: int) -> Any:
    return derived_gdid("counter", counter, slot)


def _config_id(counter: str) -> Any:
    return derived_gdid("counter-config", counter)
