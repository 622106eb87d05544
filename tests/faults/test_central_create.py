"""Atomic entity creation (docs/design.md invariant 5): many processes, and SIGKILL at every step.

Real processes ('spawn'), real databases (SQLite files and PostgreSQL servers), no mocks: the
crash is the creating process killing itself with SIGKILL at a named step
(``MDB_FAULT_POINT=central.create.<step>``, armed by conftest.py), then ``mdb central check`` must see the damage and ``mdb central
repair`` must leave both invariants true: every index entry resolves to a briefcase whose root
carries its key, and every briefcase is found by its key.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from mdb import GDID, Store
from mdb import faults
from mdb.central import central_index
from mdb.central.creation import STEPS
from mdb.cli import app
from mdb.demo.models import User, UserBriefcase
from mdb.demo.repositories import EmailIndex, UserRepository
from mdb.errors import DuplicateKeyError
from support.central import make_map, open_store
from support.mapfiles import write_map
from support.pgbouncer import Pooling

pytestmark = pytest.mark.slow

THROUGH_PGBOUNCER_TOO = pytest.mark.parametrize("map_path", ["sqlite", "postgres", "pgbouncer"], indirect=True)

EMAILS = [f"Person{i:02d}@Example.org" for i in range(24)]


@pytest.fixture(params=["sqlite", "postgres"])
def map_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """CENTRAL on SQLite or PostgreSQL; ``pgbouncer`` (the tests marked THROUGH_PGBOUNCER_TOO):
    PostgreSQL through a transaction-mode PgBouncer."""
    if request.param == "sqlite":
        urls, write = request.getfixturevalue("tmp_sqlite_urls")(4), write_map
    elif request.param == "postgres":
        urls, write = request.getfixturevalue("pg_databases")(2) + request.getfixturevalue("pg_databases")(2), write_map
    else:
        pooling = Pooling(request.getfixturevalue("pg_databases"), request.getfixturevalue("pgbouncer"))
        urls, write = pooling.databases(2) + pooling.databases(2), pooling.write_map
    path = make_map(tmp_path, urls, write)
    open_store(path).close()  # schema
    return path


def _register_all(map_path: str, seed: int, start: mp.synchronize.Event) -> list[tuple[str, str | None]]:
    """Child: register every email (shuffled, some in other spellings); report what it won."""
    emails = list(EMAILS)
    rng = random.Random(seed)
    rng.shuffle(emails)
    out: list[tuple[str, str | None]] = []
    with Store.from_yaml(map_path, types=[UserBriefcase]) as store:
        users = UserRepository(store)
        start.wait(60)
        for email in emails:
            spelled = email.upper() if rng.random() < 0.3 else f" {email} "
            try:
                out.append((EmailIndex.key_of(email), str(users.register(spelled, f"by {seed}"))))
            except DuplicateKeyError:
                out.append((EmailIndex.key_of(email), None))
    return out


def _run_register(args: tuple[str, int, mp.synchronize.Event]) -> list[tuple[str, str | None]]:
    return _register_all(*args)


def all_users(store: Store) -> dict[GDID, str]:
    out: dict[GDID, str] = {}
    for _start, _end, shards in store.router.partitions("user"):
        for server in shards:
            with store.transaction(server) as conn:
                out.update(conn.execute(select(User.__table__.c.user_id, User.__table__.c.email)).all())
    return out


def all_entries(store: Store) -> list[tuple[str, GDID, str]]:
    out = []
    for server in store.router.central_servers():
        with store.transaction(server) as conn:
            c = central_index.c
            out.extend(conn.execute(select(c.key, c.gdid, c.state).where(c.index_name == EmailIndex.name)).all())
    return out


def assert_invariants(store: Store) -> None:
    """Every entry resolves to a briefcase carrying its key; every briefcase is found by its key."""
    users = all_users(store)
    store.central.cache.clear()
    for key, gdid, state in all_entries(store):
        assert state == "live", (key, gdid, state)
        assert gdid in users and EmailIndex.key_of(users[gdid]) == key
    for gdid, email in users.items():
        assert store.central.lookup(EmailIndex, email) == gdid


@THROUGH_PGBOUNCER_TOO
def test_concurrent_registration_has_exactly_one_winner_per_email(map_path: Path) -> None:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    start = manager.Event()
    with ctx.Pool(8) as pool:
        pending = pool.map_async(_run_register, [(str(map_path), seed, start) for seed in range(8)])
        start.set()
        results = pending.get(timeout=240)
    manager.shutdown()
    winners: dict[str, list[str]] = {}
    for per_process in results:
        for key, gdid in per_process:
            if gdid is not None:
                winners.setdefault(key, []).append(gdid)
    assert sorted(winners) == sorted(EmailIndex.key_of(e) for e in EMAILS)
    assert all(len(w) == 1 for w in winners.values()), winners
    with open_store(map_path) as store:
        users = all_users(store)
        assert sorted(map(str, users)) == sorted(w[0] for w in winners.values())  # one briefcase per email
        assert_invariants(store)
        for key, (gdid,) in winners.items():
            assert store.central.lookup(EmailIndex, key) == GDID.parse(gdid)


def _register_and_crash(map_path: str, email: str, step: str) -> None:
    os.environ[faults.ENV] = f"central.create.{step}"
    with Store.from_yaml(map_path, types=[UserBriefcase]) as store:
        UserRepository(store).register(email, "Crash Test")


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@THROUGH_PGBOUNCER_TOO
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_creation_step_is_found_by_check_and_fixed_by_repair(map_path: Path, step: str) -> None:
    with open_store(map_path) as store:
        UserRepository(store).register("bystander@example.org", "Bystander")
    email = "Victim@Example.org"
    proc = mp.get_context("spawn").Process(target=_register_and_crash, args=(str(map_path), email, step))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, f"the creating process was not killed at {step!r}"

    code, out = cli("central", "check", str(map_path), "--grace", "0", "--json")
    report = json.loads(out)
    expected = {"start": {}, "reserved": {"dangling": 1}, "writing": {"dangling": 1},
                "written": {"unfinished": 1}, "live": {}}[step]
    assert {k: v for k, v in report["counts"].items() if v} == expected, report
    assert code == (1 if expected else 0)
    if expected:
        assert [p["key"] for p in report["problems"]] == ["victim@example.org"]
    # Within the grace period a crashed reservation is a creation in flight, not a problem.
    code, out = cli("central", "check", str(map_path), "--json")
    assert json.loads(out)["counts"].get("dangling", 0) == 0

    code, out = cli("central", "repair", str(map_path), "--grace", "0", "--json")
    assert code == 0, out
    repaired = json.loads(out)
    assert repaired["after"]["ok"] and sum(repaired["fixed"].values()) == sum(expected.values())
    code, _ = cli("central", "check", str(map_path), "--grace", "0")
    assert code == 0

    with open_store(map_path) as store:
        assert_invariants(store)
        written = step in ("written", "live")
        victim = store.central.lookup(EmailIndex, email)
        assert (victim is not None) == written
        if not written:  # the email is free again and can be registered for real
            gdid = UserRepository(store).register(email, "Second Try")
            assert store.central.lookup(EmailIndex, email) == gdid
            assert_invariants(store)


@THROUGH_PGBOUNCER_TOO
def test_reader_settles_a_crashed_creation_without_repair(map_path: Path) -> None:
    for email, step in (("a@example.org", "reserved"), ("b@example.org", "written")):
        proc = mp.get_context("spawn").Process(target=_register_and_crash, args=(str(map_path), email, step))
        proc.start()
        proc.join(120)
        assert proc.exitcode == -signal.SIGKILL
    with open_store(map_path) as store:
        store.central.grace = 0.0
        assert store.central.lookup(EmailIndex, "a@example.org") is None  # dangling: deleted by the reader
        assert store.central.lookup(EmailIndex, "b@example.org") is not None  # unfinished: finished by it
        assert_invariants(store)


def test_check_finds_missing_and_stale_keys_and_repair_fixes_them(map_path: Path) -> None:
    with open_store(map_path) as store:
        users = UserRepository(store)
        lost = users.register("lost@example.org", "Lost")
        moved = users.register("moved@example.org", "Moved")
        store.central.remove(EmailIndex, "lost@example.org")  # briefcase without its key
        with store.briefcase(UserBriefcase, moved) as s:  # root changed behind the index's back
            s.get(User, moved).email = "elsewhere@example.org"
    code, out = cli("central", "check", str(map_path), "--json")
    report = json.loads(out)
    assert code == 1
    kinds = {(p["kind"], p["key"]) for p in report["problems"]}
    assert kinds == {("missing", "lost@example.org"), ("stale", "moved@example.org"), ("missing", "elsewhere@example.org")}
    code, out = cli("central", "repair", str(map_path))
    assert code == 0, out
    with open_store(map_path) as store:
        assert_invariants(store)
        assert store.central.lookup(EmailIndex, "lost@example.org") == lost
        assert store.central.lookup(EmailIndex, "elsewhere@example.org") == moved
        assert store.central.lookup(EmailIndex, "moved@example.org") is None


def test_lookup_cli(map_path: Path) -> None:
    with open_store(map_path) as store:
        gdid = UserRepository(store).register("ivy@example.org", "Ivy")
    code, out = cli("central", "lookup", str(map_path), "user_email", " IVY@example.org", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["gdid"] == str(gdid) and data["normalized"] == "ivy@example.org" and data["briefcase"]["area"] == "user"
    code, out = cli("central", "lookup", str(map_path), "user_email", "nobody@example.org")
    assert code == 1 and "none" in out
    code, out = cli("central", "lookup", str(map_path), "no_such_index", "x")
    assert code != 0


def test_check_skips_indexes_of_areas_the_map_lacks(map_path: Path) -> None:
    """A process may hold index declarations of other maps (here: area 'elsewhere')."""
    from mdb.central.indexes import CentralIndex, exact

    class ElsewhereIndex(CentralIndex):
        name = "elsewhere_key"
        area = "elsewhere"
        normalize = exact

    code, out = cli("central", "check", str(map_path), "--grace", "0", "--json")
    assert code == 0, out
    assert json.loads(out)["ok"]
    code, out = cli("central", "check", str(map_path), "--index", "elsewhere_key")
    assert code == 2
    assert "'elsewhere_key' points at area 'elsewhere'" in out


def test_create_accepts_gdid_text(map_path: Path) -> None:
    """``gdid="0:0:777778"`` is a GDID as everywhere else; as a str it never equalled the root's
    parsed key and creation refused with "user_id=0:0:777778, not the new GDID 0:0:777778"."""
    with open_store(map_path) as store:
        text = "0:0:777778"
        created = store.central.create(
            UserBriefcase, lambda g: User(user_id=g, email="text@example.org", name="text"), [EmailIndex], gdid=text
        )
        assert created == GDID.parse(text)
        assert store.central.lookup(EmailIndex, "text@example.org") == created
        assert_invariants(store)


def test_a_central_made_without_a_store_draws_root_ids_from_the_types_own_sequence(map_path: Path) -> None:
    """``Central(cluster)`` alone (the public class, as a tool builds it) creates briefcases with root ids
    from ``{area}/ids``, the sequence ``store.new_gdid`` draws from: the two never hand out one id twice."""
    from mdb.central import Central

    with open_store(map_path) as store:
        own = Central(store, ttl=0.0)
        made = own.create(UserBriefcase, lambda g: User(user_id=g, email="alone@example.com", name="Alone"), [EmailIndex])
        drawn = store.new_gdid(UserBriefcase)
        assert made != drawn and store.central.lookup(EmailIndex, "alone@example.com") == made
        sequences = []
        for server in store.router.central_servers():
            with store.transaction(server) as conn:
                sequences += conn.exec_driver_sql("SELECT sequence FROM mdb_gdid_sequences WHERE scope = 'user'").scalars().all()
        assert sequences == ["ids"]  # both drew from user/ids
