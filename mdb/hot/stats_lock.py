"""Stats lock: exactly-once effects from at-least-once events.

An event (a staking transaction becoming ``active``, later ``unbonded``) may be delivered many
times, concurrently. For each calculation it feeds (``overall``, ``per_provider``, ...) the
lock records that the calculation was applied for ``{event id}:{state}``, and it does so IN
THE SAME TRANSACTION as the calculation's effect: one row per (event id, state, calculation),
inserted with ``ON CONFLICT DO NOTHING RETURNING`` (no conflict target: any unique index); a returned row says this delivery is
the first. When no row is returned, the record of this very triple must exist; if the derived
lock id is held by another triple instead, that is an error, never "already applied"
(:func:`mdb.hot.scope.insert_once`). A concurrent duplicate waits on the unique index until the first commits (then sees
the conflict and skips) or rolls back (then it applies). New calculation kinds are new rows,
so old records never need rewriting.

The API takes the effect as a callback that receives the same place, so the effect cannot run
in another transaction by accident; it runs inside a savepoint together with the lock row, so
an effect that raises leaves no lock row behind even if the caller catches the error and
commits the rest of its transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from mdb.session import BriefcaseSession
from mdb.hot.scope import Scope, insert_once, place_of
from mdb.hot.tables import LABEL_LENGTH, NAME_LENGTH, StatsLockTables, check_name, derived_gdid

__all__ = ["StatsLock"]


class StatsLock:
    """Operations on one stats-lock table (CENTRAL or inside a briefcase)."""

    def __init__(self, tables: StatsLockTables) -> None:
        self.tables = tables

    def __repr__(self) -> str:
        return f"StatsLock({self.tables.locks.name!r})"

    def apply(
        self,
        target: Scope | BriefcaseSession,
        event_id: str,
        state: str,
        calculation: str,
        effect: Callable[[Scope], Any],
    ) -> bool:
        """Run ``effect(place)`` unless ``calculation`` was already applied for ``event_id:state``.

        Returns True when this call applied it. The lock row and the effect commit or roll back
        together with the caller's transaction.
        """
        _check_names(event_id, state, calculation, write=True)
        place = place_of(target)
        place.check(self.tables.tables, self.tables.key_column, write=True)
        record = {
            "lock_id": derived_gdid("stats-lock", event_id, state, calculation),
            "event_id": event_id,
            "state": state,
            "calculation": calculation,
        }
        with place.conn.begin_nested():
            if not insert_once(place, self.tables.locks, "lock_id", record, ("event_id", "state", "calculation")):
                return False
            effect(place)
        return True

    def applied(self, target: Scope | BriefcaseSession, event_id: str, state: str) -> set[str]:
        """The calculations already applied for ``event_id:state`` here."""
        _check_names(event_id, state, None, write=False)
        place = place_of(target)
        place.check(self.tables.tables, self.tables.key_column, write=False)
        locks = self.tables.locks
        conds = [locks.c[k] == v for k, v in place.key_values().items()]
        rows = place.conn.execute(
            select(locks.c.calculation).where(*conds, locks.c.event_id == event_id, locks.c.state == state)
        )
        return set(rows.scalars())


def _check_names(event_id: object, state: object, calculation: object | None, *, write: bool) -> None:
    """The lock's natural key parts, each checked by name (see :func:`check_name`)."""
    check_name("stats lock: event id", event_id, NAME_LENGTH, write=write)
    check_name("stats lock: state", state, LABEL_LENGTH, write=write)
    if calculation is not None:
        check_name("stats lock: calculation", calculation, LABEL_LENGTH, write=write)
