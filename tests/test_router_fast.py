"""The routing fast path (issue 15): placements built from shared per-shard records and the
CENTRAL key cache behave exactly like the plain values they replace."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from mdb import GDID, Router, load_map
from mdb import router as router_module
from mdb.router import Placement, fnv1a_64

EXAMPLE = Path(__file__).resolve().parent.parent / "partition_maps" / "example.yaml"


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
