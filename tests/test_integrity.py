"""Data integrity of briefcase sessions (issue 11): bulk flush cost, GDID text, duplicate keys,
one root-id sequence per type, child ids outside the area's scope, exclusive sessions.

SQLite and real PostgreSQL, with the map of tests/test_briefcase_pg.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session
from test_briefcase_pg import make_store, pg_store, sqlite_store, store  # noqa: F401 (fixtures)

from mdb.demo.models import Transaction, User, UserBriefcase
from mdb.gdid import GDID
from mdb.session import BriefcaseSession
from mdb.store import Store


def _count_new_accesses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count how often ``session.new`` is built on briefcase sessions (each access builds a set)."""
    calls = [0]
    original = Session.new

    def counting(self: Session) -> Any:
        calls[0] += 1
        return original.fget(self)  # type: ignore[attr-defined]

    monkeypatch.setattr(BriefcaseSession, "new", property(counting))
    return calls


def test_the_flush_guard_reads_the_pending_set_once_not_once_per_row(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Old code asked ``obj in session.new`` per new row: N set builds, a quadratic flush."""
    calls = _count_new_accesses(monkeypatch)
    per_flush: dict[int, int] = {}
    for user, n in ((GDID(0, 0, 5), 10), (GDID(0, 0, 6), 300)):
        with sqlite_store.briefcase(UserBriefcase, user) as session:
            session.add(User(user_id=user, email="bulk@example.com", name="bulk"))
            session.add_all(Transaction(transaction_id=GDID(0, 1, user.counter * 1000 + k), amount_cents=k) for k in range(n))
            calls[0] = 0
            session.flush()
            per_flush[n] = calls[0]
        with sqlite_store.briefcase(UserBriefcase, user, readonly=True) as session:
            assert session.query(Transaction).count() == n  # the key was filled in for every row
    assert per_flush[300] == per_flush[10], per_flush


def test_gdid_text_in_a_gdid_attribute_is_parsed_not_taken_for_another_briefcase(store: Store) -> None:  # noqa: F811
    """Old code: ``CrossBriefcaseError ... user_id=0:0:8 cannot be written in the session of briefcase user/0:0:8``."""
    me = GDID(0, 0, 8)
    with store.briefcase(UserBriefcase, me) as session:
        user = User(user_id="0:0:8", email="text@example.com", name="text")
        assert user.user_id == me  # parsed on assignment, not at bind time
        session.add(user)
        session.add(Transaction(user_id=" 0:0:8 ", transaction_id="0:1:77", amount_cents=5))
    with store.briefcase(UserBriefcase, "0:0:8", readonly=True) as session:
        assert session.get(User, me) is not None
        assert [t.transaction_id for t in session.query(Transaction)] == [GDID(0, 1, 77)]


def test_a_value_that_is_no_gdid_is_refused_as_such(sqlite_store: Store) -> None:  # noqa: F811
    from mdb.errors import CrossBriefcaseError, GDIDError

    with pytest.raises(GDIDError, match="'user-8'"):
        User(user_id="user-8", email="x@example.com", name="x")
    with pytest.raises(CrossBriefcaseError, match="expected a GDID, got int 8"):
        with sqlite_store.briefcase(UserBriefcase, GDID(0, 0, 8)) as session:
            session.add(User(user_id=8, email="x@example.com", name="x"))
