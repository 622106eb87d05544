"""CENTRAL indexes: declaration, normalization and sharding, the cache, and the index API (SQLite + PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, update

from mdb import GDID, Store
from mdb.central import CentralCache, CentralIndex, central_index, exact, strip_casefold
from mdb.central.indexes import STATE_LIVE
from mdb.demo.models import User, UserBriefcase
from mdb.demo.repositories import EmailIndex, UserRepository
from mdb.errors import DuplicateKeyError, SchemaError
from mdb.router import fnv1a_64
from support.central import make_map, open_store



@pytest.fixture(params=["sqlite", "postgres"])
def map_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "sqlite":
        urls = request.getfixturevalue("tmp_sqlite_urls")(4)
    else:
        urls = request.getfixturevalue("pg_databases")(2) + request.getfixturevalue("pg_databases")(2)
    return make_map(tmp_path, urls)


@pytest.fixture
def store(map_path: Path) -> Iterator[Store]:
    with open_store(map_path) as s:
        yield s


# -- declaration -----------------------------------------------------------------------------------


def test_normalization_must_be_declared() -> None:
    with pytest.raises(SchemaError, match="normalize"):
        class NoNormalize(CentralIndex):  # noqa: F841
            name = "t_no_normalize"
            area = "user"


def test_root_column_must_exist_and_area_must_match() -> None:
    with pytest.raises(SchemaError, match="root_column 'mail'"):
        class BadColumn(CentralIndex):  # noqa: F841
            name = "t_bad_column"
            area = "user"
            normalize = exact
            briefcase = UserBriefcase
            root_column = "mail"
    with pytest.raises(SchemaError, match="area 'orders'"):
        class BadArea(CentralIndex):  # noqa: F841
            name = "t_bad_area"
            area = "orders"
            normalize = exact
            briefcase = UserBriefcase


def test_index_names_are_unique() -> None:
    with pytest.raises(SchemaError, match="declared twice"):
        class Again(CentralIndex):  # noqa: F841
            name = "user_email"
            area = "user"
            normalize = exact


def test_keys_are_normalized_explicitly_and_checked() -> None:
    assert EmailIndex.key_of("  Alice@Example.ORG ") == "alice@example.org"
    assert EmailIndex.key_of("STRASSE@x.de") == EmailIndex.key_of("straße@x.de")

    class Exact(CentralIndex):
        name = "t_exact"
        area = "user"
        normalize = exact

    assert Exact.key_of(" A ") == " A "
    with pytest.raises(ValueError, match="empty after normalization"):
        EmailIndex.key_of("   ")
    with pytest.raises(ValueError, match="at most 512"):
        EmailIndex.key_of("a" * 513)
    with pytest.raises(ValueError, match="must be a str"):
        EmailIndex.key_of(42)  # type: ignore[arg-type]


def test_entries_live_on_the_central_shard_of_the_fnv_hash(store: Store) -> None:
    users = UserRepository(store)
    central = store.router.central_servers()
    seen = set()
    for i in range(12):
        email = f"Shard{i}@Example.org"
        gdid = users.register(email, "x")
        key = strip_casefold(email)
        expected = central[fnv1a_64(key.encode("utf-8")) % len(central)]
        seen.add(expected)
        for server in central:
            with store.transaction(server) as conn:
                found = conn.execute(select(central_index.c.gdid).where(central_index.c.key == key)).scalars().all()
            assert found == ([gdid] if server == expected else [])
    assert seen == set(central)  # 12 keys over 2 shards: both used


# -- the cache alone -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_cache_ttl_negative_entries_and_lru_bound() -> None:
    clock = FakeClock()
    cache = CentralCache(max_entries=3, ttl=10.0, clock=clock)
    g = GDID(0, 0, 5)
    cache.put(("i", "a"), g)
    cache.put(("i", "none"), None)
    assert cache.get(("i", "a")) == (True, g)
    assert cache.get(("i", "none")) == (True, None)
    assert cache.get(("i", "b")) == (False, None)
    clock.now += 10.0
    assert cache.get(("i", "a")) == (False, None)  # expired
    stats = cache.stats()
    assert (stats.hits, stats.negative_hits, stats.misses, stats.expirations) == (2, 1, 2, 1)
    for k in "wxyz":
        cache.put(("i", k), g)
    assert len(cache) == 3
    assert cache.get(("i", "w")) == (False, None)  # least recently used went first
    cache.get(("i", "x"))
    cache.put(("i", "v"), g)
    assert cache.get(("i", "x"))[0] and not cache.get(("i", "y"))[0]
    assert cache.stats().evictions >= 2


# -- lookups through the Store ---------------------------------------------------------------------


def test_lookup_negative_entry_and_own_write_invalidation(store: Store) -> None:
    central = store.central
    assert central.lookup(EmailIndex, "bob@example.org") is None
    assert central.lookup(EmailIndex, "BOB@example.org") is None
    assert central.cache_stats.negative_hits == 1
    gdid = UserRepository(store).register("Bob@Example.org", "Bob")  # own write drops the negative entry
    assert central.lookup(EmailIndex, " bob@example.org") == gdid
    assert central.lookup(EmailIndex, "bob@example.org") == gdid
    assert central.cache_stats.hits == 2
    assert central.keys_of(EmailIndex, gdid) == ["bob@example.org"]
    assert central.remove(EmailIndex, "bob@example.org")
    assert central.lookup(EmailIndex, "bob@example.org") is None


def test_another_process_write_is_seen_after_the_ttl(map_path: Path) -> None:
    clock = FakeClock()
    with open_store(map_path) as a, Store.from_yaml(map_path, types=[UserBriefcase]) as b:
        b.central.cache.__init__(1000, 5.0, clock)  # type: ignore[misc]
        assert b.central.lookup(EmailIndex, "carol@example.org") is None
        gdid = UserRepository(a).register("carol@example.org", "Carol")
        assert b.central.lookup(EmailIndex, "carol@example.org") is None  # negative entry, within the TTL
        clock.now += 5.0
        assert b.central.lookup(EmailIndex, "carol@example.org") == gdid


def test_stale_hit_is_detected_on_the_root_column(map_path: Path) -> None:
    with open_store(map_path) as a, Store.from_yaml(map_path, types=[UserBriefcase]) as b:
        users_a = UserRepository(a)
        dave = users_a.register("dave@example.org", "Dave")
        assert b.central.lookup(EmailIndex, "dave@example.org") == dave  # cached in b
        # Another process renames dave's email and gives the old one to a new user.
        users_a.change_email("dave@example.org", "david@example.org")
        erin = users_a.register("Dave@Example.org", "Erin")
        assert b.central.lookup(EmailIndex, "dave@example.org", verify=False) == dave  # the raw cache is stale ...
        assert b.central.lookup(EmailIndex, "dave@example.org") == erin  # ... the verified lookup is not
        assert b.central.cache_stats.stale == 1
        assert b.central.lookup(EmailIndex, "david@example.org") == dave
        with a.briefcase(UserBriefcase, dave, readonly=True) as s:
            assert s.get(User, dave).email == "david@example.org"


def test_add_remove_and_duplicates(store: Store) -> None:
    users = UserRepository(store)
    frank = users.register("frank@example.org", "Frank")
    with pytest.raises(DuplicateKeyError, match="frank@example.org"):
        users.register("FRANK@example.org", "Other Frank")
    with pytest.raises(DuplicateKeyError):
        store.central.add(EmailIndex, "frank@example.org", GDID(0, 0, 999))
    store.central.add(EmailIndex, "frank@example.org", frank)  # idempotent for the holder
    gina = users.register("gina@example.org", "Gina")
    with pytest.raises(DuplicateKeyError):
        users.change_email("gina@example.org", "Frank@example.org")
    # The failed rename left gina's key live and her root unchanged.
    assert store.central.lookup(EmailIndex, "gina@example.org") == gina
    c = central_index.c
    server = store.central.server_of("gina@example.org")
    with store.transaction(server) as conn:
        assert conn.execute(select(c.state).where(c.key == "gina@example.org")).scalar_one() == STATE_LIVE


def test_pending_entry_is_finished_by_a_reader(store: Store) -> None:
    gdid = UserRepository(store).register("hana@example.org", "Hana")
    c = central_index.c
    with store.transaction(store.central.server_of("hana@example.org")) as conn:
        conn.execute(update(central_index).where(c.key == "hana@example.org").values(state="pending"))
    store.central.cache.clear()
    assert store.central.lookup(EmailIndex, "hana@example.org") == gdid
    with store.transaction(store.central.server_of("hana@example.org")) as conn:
        assert conn.execute(select(c.state).where(c.key == "hana@example.org")).scalar_one() == STATE_LIVE


def test_unknown_index_name_is_a_clear_error(store: Store) -> None:
    with pytest.raises(SchemaError, match="unknown CENTRAL index 'nope'.*user_email"):
        store.central.lookup("nope", "x")


def test_factory_root_must_carry_the_key(store: Store) -> None:
    with pytest.raises(SchemaError, match="root column must carry the key"):
        store.central.create(UserBriefcase, lambda g: User(email="x@example.org", name="x"), {EmailIndex: "y@example.org"})
    assert store.central.lookup(EmailIndex, "y@example.org") is None
    assert store.central.lookup(EmailIndex, "x@example.org") is None


class CityIndex(CentralIndex):
    """A non-unique index without a root column: many users per city, existence-checked only."""

    name = "t_user_city"
    area = "user"
    unique = False
    normalize = strip_casefold
    briefcase = UserBriefcase


def test_non_unique_index_and_existence_check(store: Store) -> None:
    users = UserRepository(store)
    a = users.register("city-a@example.org", "A")
    b = users.register("city-b@example.org", "B")
    central = store.central
    central.add(CityIndex, "Lyon", a)
    central.add(CityIndex, " lyon ", b)
    central.add(CityIndex, "LYON", b)  # idempotent
    assert central.lookup_all(CityIndex, "lyon") == sorted([a, b])
    assert central.keys_of(CityIndex, a) == ["lyon"]
    with pytest.raises(SchemaError, match="not unique"):
        central.lookup(CityIndex, "lyon")
    from mdb.central.reconcile import check

    assert check(central, [CityIndex]).ok
    ghost = GDID(0, 0, 777_777)  # no such briefcase
    central.add(CityIndex, "lyon", ghost)
    report = check(central, [CityIndex])
    assert [(p.kind, p.gdid) for p in report.problems] == [("dangling", ghost)]
    assert central.remove(CityIndex, "lyon", a)
    assert central.lookup_all(CityIndex, "lyon") == sorted([b, ghost])  # a live entry is trusted as written
