"""The routing fast path (issue 15): placements built from shared per-shard records and the
CENTRAL key cache behave exactly like the plain values they replace."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdb import GDID, Router, RoutingError, load_map
from mdb import router as router_module
from mdb.router import CentralPlacement, Placement, fnv1a_64, fnv1a_64_many

EXAMPLE = Path(__file__).resolve().parents[2] / "partition_maps" / "example.yaml"


@pytest.fixture(scope="module")
def example() -> Router:
    return Router(load_map(EXAMPLE))


def test_placement_is_a_value(example: Router) -> None:
    p = example.locate("user", GDID.parse("0:0:250001"))
    fields = (p.area, p.gdid, p.range_set, p.partition_start, p.partition_end, p.shard_index, p.shard_count,
              p.server, p.default_server, p.relocated)
    built = Placement(*fields)
    assert built == p and hash(built) == hash(p) and repr(built) == repr(p)
    assert repr(p).startswith("Placement(area='user', gdid=GDID('0:0:250001'), ")
    assert p == example.locate("user", GDID.parse("0:0:250001"))
    assert p != example.locate("user", GDID.parse("0:0:250002"))
    assert pickle.loads(pickle.dumps(p)) == p
    assert p.layout == built.layout and p.layout.shard_index == p.shard_index
    with pytest.raises(FrozenInstanceError):
        p.server = "elsewhere"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        del p.gdid  # type: ignore[misc]


def test_central_placement_is_a_value(example: Router) -> None:
    c = example.locate_central("ada@example.com")
    fields = (c.area, c.key, c.hash, c.shard_index, c.shard_count, c.server)
    assert fields[1:3] == (b"ada@example.com", fnv1a_64(b"ada@example.com"))
    built = CentralPlacement(*fields)
    assert built == c and hash(built) == hash(c) and repr(built) == repr(c)
    assert repr(c).startswith(f"CentralPlacement(area={c.area!r}, key=b'ada@example.com', hash={c.hash}, ")
    assert c == Router(example.map).locate_central(b"ada@example.com")
    assert c != example.locate_central("bob@example.com")
    assert c != fields  # a value of its own kind, not a tuple
    assert pickle.loads(pickle.dumps(c)) == c
    with pytest.raises(FrozenInstanceError):
        c.server = "elsewhere"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        del c.key  # type: ignore[misc]


def test_a_key_utf8_cannot_encode_is_a_routing_error_not_a_traceback(example: Router) -> None:
    router = Router(example.map)
    bad = "ada\udcff@example.com"  # what an undecodable byte in argv or a file name becomes
    for route in (router.locate_central, lambda k: router.locate_central_many(["ok@example.com", k])):
        with pytest.raises(RoutingError, match=r"must be text UTF-8 can encode: 'ada\\udcff@example.com' has surrogates not allowed at position 3"):
            route(bad)
    assert bad not in router._central_cache
    assert router.locate_central("ok@example.com") == example.locate_central("ok@example.com")


def test_relocated_placement_keeps_the_default_shard(example: Router) -> None:
    gdid = GDID.parse("0:0:250001")
    default = example.locate("user", gdid)
    moved = example.with_relocations({("user", gdid): "user-1"}).locate("user", gdid)
    assert (moved.server, moved.default_server, moved.relocated) == ("user-1", default.server, True)
    assert moved.layout == default.layout and moved != default
    same = example.with_relocations({("user", gdid): default.server}).locate("user", gdid)
    assert same == default  # a relocation to the default shard is no relocation


def test_central_cache_returns_what_the_hash_gives(example: Router, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "CENTRAL_CACHE_SIZE", 8)
    router = Router(example.map)
    for round_ in range(3):
        for i in range(20):
            key = f"user{i}@example.com"
            c = router.locate_central(key)
            assert c.hash == fnv1a_64(key.encode())
            assert c.server == router.central_servers()[c.hash % len(router.central_servers())]
            assert router.locate_central(key.encode()) == c == router.locate_central(bytearray(key.encode()))
            assert len(router._central_cache) <= 8


@given(st.lists(st.binary(max_size=40), max_size=60))
@settings(max_examples=200, deadline=None)
def test_fnv1a_64_many_matches_one_by_one(datas: list[bytes]) -> None:
    assert fnv1a_64_many(datas) == [fnv1a_64(d) for d in datas]


def test_fnv1a_64_many_on_long_and_extreme_keys() -> None:
    datas = [b"\xff" * 1000, b"\x00" * 1000, bytes(range(256)) * 3, b"", b"a"]
    assert fnv1a_64_many(datas) == [fnv1a_64(d) for d in datas]


def test_locate_central_many_is_locate_central(example: Router) -> None:
    keys: list[str | bytes | GDID] = [f"user{i}@example.com" for i in range(300)]
    keys += [b"raw", GDID.parse("0:5:1337"), "Ann@Example.com", "user7@example.com", "ü-nfc"]
    fresh = Router(example.map)
    many = fresh.locate_central_many(keys)
    assert many == [Router(example.map).locate_central(k) for k in keys]
    assert fresh.locate_central_many(keys) == many  # the second time from the cache
    assert fresh.locate_central_many([]) == []
    with pytest.raises(RoutingError):
        fresh.locate_central_many(["ok", 5])  # type: ignore[list-item]
