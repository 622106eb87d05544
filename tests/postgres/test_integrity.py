"""Data integrity of briefcase sessions (issue 11): bulk flush cost, GDID text, duplicate keys,
one root-id sequence per type, child ids outside the area's scope, exclusive sessions.

SQLite and real PostgreSQL, with the map of tests/postgres/test_briefcase_pg.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session
from support.briefcase import eight_exclusive_writers_lose_nothing, make_store, pg_store, sqlite_store, store  # noqa: F401 (fixtures)

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


def test_a_primary_key_collision_in_a_briefcase_session_is_a_duplicate_key_error(store: Store) -> None:  # noqa: F811
    """Old code let the driver's IntegrityError (sqlite3 / psycopg UniqueViolation) through."""
    from mdb import DuplicateKeyError, DuplicateRowError

    me = GDID(0, 0, 12)
    with store.briefcase(UserBriefcase, me) as session:
        session.add(User(user_id=me, email="first@example.com", name="first"))
    server = store.router.locate("user", me).server
    with pytest.raises(DuplicateKeyError) as caught:
        with store.briefcase(UserBriefcase, me) as session:
            session.add(User(user_id=me, email="second@example.com", name="second"))
    err = caught.value
    assert isinstance(err, DuplicateRowError) and (err.server, err.table) == (server, "users")
    assert f"server {server!r}: table 'users' already has a row with user_id=0:0:12" in str(err)
    with store.briefcase(UserBriefcase, me, readonly=True) as session:  # nothing of the failed block was kept
        assert session.get(User, me).email == "first@example.com"  # type: ignore[union-attr]
    # Through central.create with a taken GDID: the same error, and the reserved key is released.
    from mdb.demo.repositories import EmailIndex

    with pytest.raises(DuplicateRowError, match="table 'users' already has a row with user_id=0:0:12"):
        store.central.create(UserBriefcase, lambda g: User(user_id=g, email="doesnotexist@example.com", name="x"), [EmailIndex], gdid=me)
    assert store.central.lookup(EmailIndex, "doesnotexist@example.com") is None


# -- one root-id sequence per type; child ids outside the area's scope (items 2 and 13) ----------


def _register(store: Store, email: str) -> GDID:
    return store.central.create(UserBriefcase, lambda g: User(user_id=g, email=email, name=email), [])


def test_the_tour_and_central_create_draw_root_ids_from_one_sequence(store: Store) -> None:  # noqa: F811
    """Old code: the tour drew from ``user/ids``, ``central.create`` from ``user/UserBriefcase``:
    both started at 1 and the first registration failed on ``users.user_id``."""
    def tour(gdid: GDID) -> GDID:
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email=f"{gdid}@example.com", name="tour"))
        return gdid

    toured = [tour(store.gdids("user", "ids").next()) for _ in range(3)]  # the old README tour
    registered = [_register(store, f"reg{k}@example.com") for k in range(3)]
    toured.append(tour(store.new_gdid(UserBriefcase)))  # the tour now
    registered.append(_register(store, "last@example.com"))
    assert len(set(toured) | set(registered)) == 8


def test_a_new_root_sequence_starts_above_the_ids_older_sequences_issued(
    tmp_path: Path, tmp_sqlite_urls: Callable[[int], list[str]]
) -> None:
    """Upgrade: a CENTRAL where ``central.create`` drew from ``user/UserBriefcase`` (and child ids
    from ``user/address``) must not see those ids again from ``user/ids``."""
    urls = tmp_sqlite_urls(6)
    with make_store(tmp_path / "old", urls) as old:
        legacy_roots = old.gdids("user", "UserBriefcase").take(1500)  # what old central.create used
        legacy_children = old.gdids("user", "address").take(40)
    with make_store(tmp_path / "new", urls) as new:
        first = new.new_gdid(UserBriefcase)
        assert first > max(legacy_roots) and first > max(legacy_children)
        from mdb.repository import Repository

        class Users(Repository):
            scope = "user"

        child = Users(new).new_id("address")
        assert child > max(legacy_children)


def test_child_row_ids_do_not_raise_the_areas_high_water_mark(sqlite_store: Store) -> None:  # noqa: F811
    """Old code drew Repository ids from scope ``user``: 3,000 line ids put the mark at 0:0:3000
    with one user, and a partition at 0:0:2000 was refused."""
    from mdb.demo.repositories import OrderRepository, UserRepository
    from mdb.maps.high_water import high_water_marks

    user = UserRepository(sqlite_store).register("hw@example.com", "hw")
    OrderRepository(sqlite_store).new_ids("order_line", 3000)
    mark = high_water_marks(sqlite_store)["user"]
    assert user <= mark < GDID(0, 0, 2000), mark



# -- exclusive briefcase sessions (item 18) ---------------------------------------------------------


def test_exclusive_sessions_lose_no_read_modify_write_update_under_8_writers(store: Store) -> None:  # noqa: F811
    """``user.n = user.n + 1`` in the ORM, 8 threads x 15: every increment must land (see
    support.briefcase.eight_exclusive_writers_lose_nothing; also run through PgBouncer)."""
    eight_exclusive_writers_lose_nothing(store)


def test_an_exclusive_session_cannot_be_readonly(sqlite_store: Store) -> None:  # noqa: F811
    from mdb.errors import QueryError

    with pytest.raises(QueryError, match="cannot be both readonly and exclusive"):
        with sqlite_store.briefcase(UserBriefcase, GDID(0, 0, 1), readonly=True, exclusive=True):
            pass
