"""Router: placement by the rules of docs/design.md, checked by hand and against a brute-force reference."""

from __future__ import annotations

import random
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdb import GDID, MdbError, PartitionMap, Router, RoutingError, load_map, parse_map
from mdb.router import fnv1a_64
from support.fnv import ref_fnv1a_64

EXAMPLE = Path(__file__).resolve().parents[2] / "partition_maps" / "example.yaml"
TWO60 = 2**60
MAX_V = (2**32 - 1) * TWO60 + (TWO60 - 1)


@pytest.fixture(scope="module")
def example() -> Router:
    return Router(load_map(EXAMPLE))


def g(text: str) -> GDID:
    return GDID.parse(text)


# -- the docs/design.md example, by hand ------------------------------------------------------------------------

# (area, gdid, range set, partition start, partition end, shard index, shard count, server)
EXAMPLE_CASES = [
    ("user", "0:0:250001", "0:0:0", "0:0:250000", None, 2, 3, "user-5"),  # 250001 % 3 == 2
    ("user", "0:0:250000", "0:0:0", "0:0:250000", None, 1, 3, "user-4"),  # inclusive start; 250000 % 3 == 1
    ("user", "0:0:250002", "0:0:0", "0:0:250000", None, 0, 3, "user-3"),
    ("user", "0:0:1", "0:0:0", "0:0:0", "0:0:250000", 1, 2, "user-2"),
    ("user", "0:0:2", "0:0:0", "0:0:0", "0:0:250000", 0, 2, "user-1"),
    ("user", "0:0:249999", "0:0:0", "0:0:0", "0:0:250000", 1, 2, "user-2"),
    ("user", "0:9:249999", "0:0:0", "0:0:0", "0:0:250000", 1, 2, "user-2"),  # authority ignored
    ("user", "0:15:0", "0:0:0", "0:0:0", "0:0:250000", 0, 2, "user-1"),  # v == 0
    ("user", "1:0:0", "0:0:0", "0:0:250000", None, 1, 3, "user-4"),  # v = 2^60; 2^60 % 3 == 1
    ("user", "1:0:1", "0:0:0", "0:0:250000", None, 2, 3, "user-5"),
    ("user", "4294967295:15:1152921504606846975", "0:0:0", "0:0:250000", None, MAX_V % 3, 3, ["user-3", "user-4", "user-5"][MAX_V % 3]),
    ("archive", "0:0:1", "0:0:0", "0:0:0", "0:0:100000000", 0, 1, "user-6"),
    ("archive", "0:0:99999999", "0:0:0", "0:0:0", "0:0:100000000", 0, 1, "user-6"),
    ("archive", "0:0:100000000", "0:0:100000000", "0:0:100000000", "0:0:100050000", 0, 2, "user-7"),
    ("archive", "0:0:100000001", "0:0:100000000", "0:0:100000000", "0:0:100050000", 1, 2, "user-8"),
    ("archive", "0:0:100049999", "0:0:100000000", "0:0:100000000", "0:0:100050000", 1, 2, "user-8"),
    # the second start is an offset: 100000000 + 50000
    ("archive", "0:0:100050000", "0:0:100000000", "0:0:100050000", None, 0, 1, "user-9"),
    ("archive", "0:3:50000", "0:0:0", "0:0:0", "0:0:100000000", 0, 1, "user-6"),  # NOT the offset 50000
    ("archive", "7:0:5", "0:0:100000000", "0:0:100050000", None, 0, 1, "user-9"),
]


@pytest.mark.parametrize("area, gdid, range_set, start, end, index, count, server", EXAMPLE_CASES)
def test_example_placements(
    example: Router, area: str, gdid: str, range_set: str, start: str, end: str | None, index: int, count: int, server: str
) -> None:
    p = example.locate(area, g(gdid))
    assert p.area == area
    assert p.gdid == g(gdid)
    assert p.range_set == g(range_set)
    assert p.partition_start == g(start)
    assert p.partition_end == (None if end is None else g(end))
    assert (p.shard_index, p.shard_count, p.server) == (index, count, server)
    assert p.default_server == server and not p.relocated
    assert p.layout.area == area and p.layout.partition_start == g(start)
    assert (p.layout.shard_index, p.layout.shard_count) == (index, count)
    assert example.default_placement(area, g(gdid)) == p


def test_example_issue_must_show(example: Router) -> None:
    p = example.locate("user", g("0:0:250001"))
    assert (str(p.partition_start), p.shard_index, p.server) == ("0:0:250000", 2, "user-5")


def test_example_central_single_shard(example: Router) -> None:
    for key in ("", "a@b.c", b"\x00", g("0:0:1")):
        c = example.locate_central(key)
        assert (c.area, c.shard_index, c.shard_count, c.server) == ("central", 0, 1, "central-a")


def test_example_metadata(example: Router) -> None:
    assert example.version == 3
    assert example.area_names() == ["user", "archive"]
    assert example.central_servers() == ("central-a",)
    assert example.area_servers("user") == ["user-1", "user-2", "user-3", "user-4", "user-5"]
    assert example.area_servers("archive") == ["user-6", "user-7", "user-8", "user-9"]
    layouts = list(example.layouts())
    servers = [s for s, _ in layouts]
    assert sorted(servers) == sorted(["central-a"] + [f"user-{i}" for i in range(1, 10)])
    by_server = dict(layouts)
    assert by_server["user-5"].partition_start == g("0:0:250000") and by_server["user-5"].shard_index == 2
    assert by_server["user-9"].partition_start == g("0:0:100050000") and by_server["user-9"].shard_count == 1


# -- errors ----------------------------------------------------------------------------------------------


def test_unknown_area(example: Router) -> None:
    with pytest.raises(RoutingError, match="'orders'") as info:
        example.locate("orders", g("0:0:1"))
    assert isinstance(info.value, LookupError) and isinstance(info.value, MdbError)
    assert "example.yaml has: user, archive" in str(info.value)  # the map it looked in, and its areas


def test_central_is_not_a_partitioned_area(example: Router) -> None:
    with pytest.raises(RoutingError, match="central"):
        example.locate("central", g("0:0:1"))


def test_zero_gdid_refused(example: Router) -> None:
    for area in ("user", "archive"):
        with pytest.raises(RoutingError, match="0:0:0"):
            example.locate(area, GDID.ZERO)


def test_bad_central_key_type(example: Router) -> None:
    for key in (1, None, 1.5, ["a"]):
        with pytest.raises(RoutingError):
            example.locate_central(key)  # type: ignore[arg-type]


LATE_START = """\
version: 1
servers:
  c: {primary: "sqlite:///c.db"}
  a: {primary: "sqlite:///a.db"}
  b: {primary: "sqlite:///b.db"}
areas:
  central: {kind: central, shards: [c]}
  user:
    partitions: [{start: "0:0:1000", shards: [a]}]
  late:
    range_sets:
      - breakpoint: "2:0:0"
        partitions: [{start: "0:0:0", shards: [b]}]
"""


def test_below_first_start_names_area_and_gdid() -> None:
    r = Router(parse_map(LATE_START, "late.yaml"))
    assert r.locate("user", g("0:0:1000")).server == "a"
    with pytest.raises(RoutingError) as info:
        r.locate("user", g("0:7:999"))
    assert "'user'" in str(info.value) and "0:7:999" in str(info.value)
    # below the first breakpoint of a range-set area
    assert r.locate("late", g("2:0:0")).server == "b"
    with pytest.raises(RoutingError) as info:
        r.locate("late", g("1:0:1152921504606846975"))
    assert "'late'" in str(info.value) and "1:0:1152921504606846975" in str(info.value)


# -- authority never influences placement -----------------------------------------------------------------

gdid_values = st.one_of(
    st.integers(1, 400_000),
    st.integers(99_990_000, 100_100_000),
    st.integers(1, MAX_V),
)


@given(gdid_values, st.integers(0, 15), st.integers(0, 15), st.sampled_from(["user", "archive"]))
def test_authority_never_influences_placement(example: Router, v: int, a1: int, a2: int, area: str) -> None:
    p1 = example.locate(area, GDID.from_sharding_value(v, a1))
    p2 = example.locate(area, GDID.from_sharding_value(v, a2))
    assert (p1.range_set, p1.partition_start, p1.partition_end, p1.shard_index, p1.shard_count, p1.server) == (
        p2.range_set, p2.partition_start, p2.partition_end, p2.shard_index, p2.shard_count, p2.server
    )


# -- random maps against a brute-force reference ------------------------------------------------------------


@dataclass
class RandomArea:
    name: str
    uses_range_sets: bool
    # (breakpoint, [(absolute start, shards)]) in map order
    sets: list[tuple[int, list[tuple[int, list[str]]]]]

    @property
    def first_start(self) -> int:
        return self.sets[0][1][0][0]

    def cut_points(self) -> list[int]:
        return [bp for bp, _ in self.sets] + [s for _, parts in self.sets for s, _ in parts]

    def reference(self, v: int) -> tuple[int, int, int | None, int, str] | None:
        """Linear scan: greatest breakpoint <= v, then greatest start <= v; None if below."""
        chosen = None
        for bp, parts in self.sets:
            if bp <= v and (chosen is None or bp > chosen[0]):
                chosen = (bp, parts)
        if chosen is None:
            return None
        bp, parts = chosen
        below = [(s, sh) for s, sh in parts if s <= v]
        if not below:
            return None
        start, shards = max(below, key=lambda x: x[0])
        later = [s for s, _ in parts if s > start] + [b for b, _ in self.sets if b > bp]
        end = min(later) if later else None
        return bp, start, end, v % len(shards), shards[v % len(shards)]


cut_values = st.one_of(
    st.integers(0, 3000),
    st.builds(lambda e, c: e * TWO60 + c, st.integers(0, 6), st.integers(0, 3000)),
    st.integers(0, 6 * TWO60),
)


@st.composite
def random_area(draw: st.DrawFn, name: str, server_counter: list[int]) -> RandomArea:
    cuts = sorted(set(draw(st.lists(cut_values, min_size=1, max_size=14))))
    n_sets = draw(st.integers(1, min(4, len(cuts))))
    # range sets begin at some cut points (always including the first); each set after the
    # first begins with a partition at offset 0 (the map refuses holes)
    set_starts = sorted({0, *draw(st.lists(st.integers(1, len(cuts) - 1), max_size=n_sets - 1))}) if len(cuts) > 1 else [0]
    uses_range_sets = len(set_starts) > 1 or draw(st.booleans())
    first_bp = draw(st.integers(0, cuts[0])) if uses_range_sets else 0
    sets = []
    for k, begin in enumerate(set_starts):
        stop = set_starts[k + 1] if k + 1 < len(set_starts) else len(cuts)
        bp = first_bp if k == 0 else cuts[begin]
        parts = []
        for start in cuts[begin:stop]:
            n = draw(st.integers(1, 4))
            shards = [f"s{server_counter[0] + i}" for i in range(n)]
            server_counter[0] += n
            parts.append((start, shards))
        sets.append((bp, parts))
    return RandomArea(name, uses_range_sets, sets)


def _gdid_text(v: int) -> str:
    return str(GDID.from_sharding_value(v))


def area_yaml(area: RandomArea) -> dict:
    def parts(bp: int, ps: list[tuple[int, list[str]]]) -> list[dict]:
        return [{"start": _gdid_text(s - bp), "shards": sh} for s, sh in ps]

    if not area.uses_range_sets:
        ((bp, ps),) = area.sets
        return {"partitions": parts(bp, ps)}
    return {"range_sets": [{"breakpoint": _gdid_text(bp), "partitions": parts(bp, ps)} for bp, ps in area.sets]}


@st.composite
def random_map(draw: st.DrawFn) -> tuple[str, list[RandomArea], int]:
    counter = [0]
    areas = [draw(random_area(f"area{i}", counter)) for i in range(draw(st.integers(1, 3)))]
    n_central = draw(st.integers(1, 5))
    servers = {f"s{i}": {"primary": f"sqlite:///s{i}.db"} for i in range(counter[0])}
    servers.update({f"c{i}": {"primary": f"sqlite:///c{i}.db"} for i in range(n_central)})
    doc = {
        "version": draw(st.integers(1, 50)),
        "servers": servers,
        "areas": {"central": {"kind": "central", "shards": [f"c{i}" for i in range(n_central)]}}
        | {a.name: area_yaml(a) for a in areas},
    }
    return yaml.safe_dump(doc, sort_keys=False), areas, n_central


@st.composite
def probes(draw: st.DrawFn, areas: list[RandomArea]) -> list[int]:
    near = [c + d for a in areas for c in a.cut_points() for d in (-1, 0, 1)]
    out = draw(st.lists(st.sampled_from(near), min_size=5, max_size=25))
    out += draw(st.lists(st.integers(0, 7 * TWO60), max_size=10))
    out += [MAX_V, 1]
    return [v for v in out if 0 <= v <= MAX_V]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_routing_matches_brute_force_reference(data: st.DataObject) -> None:
    text, areas, _ = data.draw(random_map())
    pmap = parse_map(text, "random.yaml")
    router = Router(pmap)
    again = Router(parse_map(pmap.to_yaml(), "again.yaml"))
    values = data.draw(probes(areas))
    for area in areas:
        for v in values:
            authority = data.draw(st.integers(0, 15))
            gdid = GDID.from_sharding_value(v, authority)
            if gdid.is_zero:
                continue
            expected = area.reference(v)
            if v < area.first_start:
                assert expected is None
                with pytest.raises(RoutingError) as info:
                    router.locate(area.name, gdid)
                assert repr(area.name) in str(info.value) and str(gdid) in str(info.value)
                continue
            # total: everything at or above the first start routes
            assert expected is not None, "reference found a hole above the first start"
            p = router.locate(area.name, gdid)
            bp, start, end, index, server = expected
            assert p.range_set == GDID.from_sharding_value(bp)
            assert p.partition_start == GDID.from_sharding_value(start)
            assert p.partition_end == (None if end is None else GDID.from_sharding_value(end))
            assert p.partition_start.sharding_value <= v
            assert p.partition_end is None or v < p.partition_end.sharding_value
            assert (p.shard_index, p.server) == (index, server)
            assert p.shard_count == len([sh for _, ps in area.sets for s, sh in ps if s == start][0])
            # stable: same answer again, from a fresh router and from the re-serialized map
            assert router.locate(area.name, gdid) == p
            assert again.locate(area.name, gdid) == p
            # authority never matters
            other_gdid = GDID.from_sharding_value(v, (authority + 7) % 16)
            if other_gdid.is_zero:
                continue
            other = router.locate(area.name, other_gdid)
            assert (other.partition_start, other.server) == (p.partition_start, p.server)


def test_routing_is_total_on_random_maps_with_many_probes() -> None:
    """Deterministic stress: a fixed random map shape, 5k probes, all above the first start route."""
    rng = random.Random(20240601)
    lines = ["version: 1", "servers:", '  c: {primary: "sqlite:///c.db"}']
    cuts = sorted(rng.sample(range(1, 10**7), 300))
    for i in range(len(cuts) * 2):
        lines.append(f'  s{i}: {{primary: "sqlite:///s{i}.db"}}')
    lines += ["areas:", "  central: {kind: central, shards: [c]}", "  x:", "    range_sets:"]
    bps = [cuts[0]] + sorted(rng.sample(cuts[1:], 20))
    n = 0
    for k, bp in enumerate(bps):
        nxt = bps[k + 1] if k + 1 < len(bps) else None
        lines += [f'      - breakpoint: "{_gdid_text(bp)}"', "        partitions:"]
        for c in [c for c in cuts if c >= bp and (nxt is None or c < nxt)]:
            lines.append(f'          - {{start: "{_gdid_text(c - bp)}", shards: [s{n}, s{n + 1}]}}')
            n += 2
    router = Router(parse_map("\n".join(lines) + "\n", "stress.yaml"))
    starts = [start.sharding_value for start, *_ in router.partitions("x")]
    assert starts == cuts
    for _ in range(5_000):
        v = rng.randrange(cuts[0], 2 * 10**7)
        p = router.locate("x", GDID.from_sharding_value(v, rng.randrange(16)))
        i = max(i for i, c in enumerate(cuts) if c <= v) if v < 10**7 else len(cuts) - 1
        assert p.partition_start.sharding_value == cuts[i]
        assert p.server == f"s{2 * i + v % 2}"


# -- relocations -----------------------------------------------------------------------------------------------


def test_relocation_overrides_default_shard(example: Router) -> None:
    moved = g("0:0:250001")
    r = Router(example.map, {("user", moved): "user-9"})
    p = r.locate("user", moved)
    assert p.server == "user-9" and p.relocated
    assert p.default_server == "user-5"
    # the layout is still the default shard's: that is what the source shard is stamped with
    assert (p.partition_start, p.shard_index, p.shard_count) == (g("0:0:250000"), 2, 3)
    assert r.default_placement("user", moved).server == "user-5"
    # only that briefcase: neighbours, the same counter with another authority, other areas
    assert r.locate("user", g("0:0:250004")).server == "user-5"
    assert r.locate("user", g("0:1:250001")).server == "user-5"
    assert not r.locate("user", g("0:1:250001")).relocated
    assert r.locate("archive", moved).server == "user-6"
    # the original router is untouched; with_relocations builds a new one
    assert example.locate("user", moved).server == "user-5"
    r2 = example.with_relocations({("user", moved): "user-1"})
    assert r2.locate("user", moved).server == "user-1"
    assert r2.relocations == {("user", moved): "user-1"}


def test_relocation_to_the_default_server_is_not_a_relocation(example: Router) -> None:
    moved = g("0:0:250001")
    p = Router(example.map, {("user", moved): "user-5"}).locate("user", moved)
    assert p.server == "user-5" and not p.relocated


def test_relocations_are_copied(example: Router) -> None:
    reloc = {("user", g("0:0:7")): "user-9"}
    r = Router(example.map, reloc)
    reloc[("user", g("0:0:7"))] = "user-8"
    reloc[("user", g("0:0:8"))] = "user-8"
    assert r.locate("user", g("0:0:7")).server == "user-9"
    assert r.locate("user", g("0:0:8")).server == "user-1"


# -- CENTRAL: FNV-1a-64 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", 0xCBF29CE484222325),
        (b"a", 0xAF63DC4C8601EC8C),
        (b"foobar", 0x85944171F73967E8),
    ],
)
def test_fnv1a_64_known_vectors(data: bytes, expected: int) -> None:
    assert fnv1a_64(data) == expected
    assert ref_fnv1a_64(data) == expected


@given(st.binary(max_size=64))
def test_fnv1a_64_matches_reference(data: bytes) -> None:
    assert fnv1a_64(data) == ref_fnv1a_64(data)
    assert 0 <= fnv1a_64(data) < 2**64


CENTRAL5 = """\
version: 1
servers:
  c0: {primary: "sqlite:///c0.db"}
  c1: {primary: "sqlite:///c1.db"}
  c2: {primary: "sqlite:///c2.db"}
  c3: {primary: "sqlite:///c3.db"}
  c4: {primary: "sqlite:///c4.db"}
areas:
  directory: {kind: central, shards: [c3, c1, c4, c0, c2]}
"""


@pytest.fixture(scope="module")
def central5() -> Router:
    return Router(parse_map(CENTRAL5, "central5.yaml"))


def test_central_known_vectors_mod_count(central5: Router) -> None:
    shards = ["c3", "c1", "c4", "c0", "c2"]
    for key, h in (("", 0xCBF29CE484222325), ("a", 0xAF63DC4C8601EC8C), ("foobar", 0x85944171F73967E8)):
        c = central5.locate_central(key)
        assert c.area == "directory"
        assert c.hash == h
        assert c.shard_index == h % 5
        assert c.server == shards[h % 5]  # by position in the list, not by name
        assert c.shard_count == 5


@given(st.text(max_size=40))
def test_central_string_keys_are_utf8_without_implicit_normalization(central5: Router, key: str) -> None:
    c = central5.locate_central(key)
    data = key.encode("utf-8")
    assert c.key == data
    assert c.hash == ref_fnv1a_64(data)
    assert c.shard_index == ref_fnv1a_64(data) % 5
    assert central5.locate_central(data) == c
    assert central5.locate_central(bytearray(data)) == c


def test_central_does_not_casefold_or_normalize(central5: Router) -> None:
    assert central5.locate_central("Ann@Example.com").key == b"Ann@Example.com"
    assert central5.locate_central("Ann@Example.com").hash != central5.locate_central("ann@example.com").hash
    nfc, nfd = unicodedata.normalize("NFC", "Zoë"), unicodedata.normalize("NFD", "Zoë")
    assert central5.locate_central(nfc).key == nfc.encode() != central5.locate_central(nfd).key


@given(st.builds(GDID, st.integers(0, 2**32 - 1), st.integers(0, 15), st.integers(0, 2**60 - 1)))
def test_central_gdid_keys_hash_their_12_bytes(central5: Router, key: GDID) -> None:
    c = central5.locate_central(key)
    assert c.key == bytes(key) and len(c.key) == 12
    assert c.hash == ref_fnv1a_64(bytes(key))
    assert c.shard_index == c.hash % 5
    assert central5.locate_central(bytes(key)) == c
    # not the text or hex form
    assert c.key != str(key).encode() and c.key != key.hex.encode()


def test_central_known_gdid_key(central5: Router) -> None:
    key = g("1293:3:57")
    assert central5.locate_central(key).hash == ref_fnv1a_64(bytes.fromhex("0000050d3000000000000039"))


def test_central_reaches_every_shard(central5: Router) -> None:
    seen = {central5.locate_central(f"user{i}@example.com").server for i in range(500)}
    assert seen == {"c0", "c1", "c2", "c3", "c4"}


# -- scale --------------------------------------------------------------------------------------------------------


def test_area_with_10000_partitions(capsys: pytest.CaptureFixture[str]) -> None:
    n = 10_000
    width = 1_000
    # built as data, not YAML text: PyYAML's pure-Python composer would dominate the run time
    doc = {
        "version": 1,
        "servers": {"c": {"primary": "sqlite:///c.db"}} | {f"s{i}": {"primary": f"sqlite:///s{i}.db"} for i in range(n)},
        "areas": {
            "central": {"kind": "central", "shards": ["c"]},
            "big": {"partitions": [{"start": f"0:0:{i * width}", "shards": [f"s{i}"]} for i in range(n)]},
        },
    }
    t0 = time.perf_counter()
    router = Router(PartitionMap.model_validate(doc))
    t1 = time.perf_counter()
    rng = random.Random(7)
    values = [rng.randrange(1, n * width * 2) for _ in range(n)]
    gdids = [GDID.from_sharding_value(v, rng.randrange(16)) for v in values]
    t2 = time.perf_counter()
    placements = [router.locate("big", x) for x in gdids]
    t3 = time.perf_counter()
    for v, p in zip(values, placements):
        i = min(v // width, n - 1)
        assert p.server == f"s{i}"
        assert p.partition_start == GDID(0, 0, i * width)
        assert p.shard_index == 0 and p.shard_count == 1
    with capsys.disabled():
        print(f"\n10,000 partitions: validate+build {t1 - t0:.2f}s, 10,000 locates {1e6 * (t3 - t2) / n:.1f} us each")
