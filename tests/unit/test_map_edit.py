"""Map edit safety (docs/design.md invariant 4), pure part: ``diff_maps`` against the router itself.

The property tests generate a map and random edits of it, then compare ``Router`` placements
of GDIDs at and below the high-water mark (boundaries included) before and after: an edit the
diff accepts must leave every one of them where it was; an edit that moves one must be refused.
A second property checks the other direction for the safe kinds of edit (they are accepted), so
the first cannot pass by refusing everything.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

from mdb.errors import MapEditError, MapError, RoutingError
from mdb.gdid import GDID
from mdb.maps.diff import diff_maps
from mdb.maps.text import _literal_secret, recordable_yaml
from mdb.partition_map import PartitionMap, parse_map
from mdb.router import Router

E60 = 2**60
POOL = [f"s{i}" for i in range(24)]
VALUES = st.one_of(st.integers(0, 3000), st.integers(E60 - 3, E60 + 3))


def g(v: int, authority: int = 0) -> GDID:
    return GDID.from_sharding_value(v, authority)


def to_map(data: dict[str, Any]) -> PartitionMap:
    return parse_map(yaml.safe_dump(data, sort_keys=False), "<test>")


@st.composite
def base_maps(draw: st.DrawFn) -> dict[str, Any]:
    n_sets = draw(st.integers(1, 2))
    bps = [0] + sorted(draw(st.sets(VALUES.filter(lambda v: v > 0), min_size=n_sets - 1, max_size=n_sets - 1)))
    free = list(POOL)
    sets = []
    for r, bp in enumerate(bps):
        limit = bps[r + 1] - bp if r + 1 < len(bps) else 4000
        first = 0 if r > 0 or limit <= 5 else draw(st.sampled_from([0, 0, 5]))
        extra = draw(st.sets(st.integers(first + 1, max(first + 1, limit - 1)), max_size=2)) if limit > first + 1 else set()
        parts = []
        for off in [first, *sorted(extra)]:
            n = draw(st.integers(1, 3))
            shards, free = free[:n], free[n:]
            parts.append({"start": str(g(off)), "shards": shards})
        sets.append({"breakpoint": str(g(bp)), "partitions": parts})
    return {
        "version": 1,
        "servers": {**{s: {"primary": f"sqlite:///{s}.db"} for s in POOL}, "c0": {"primary": "sqlite:///c0.db"},
                    "c1": {"primary": "sqlite:///c1.db"}},
        "areas": {"central": {"kind": "central", "shards": ["c0"]}, "user": {"range_sets": sets}},
    }


def _unused(data: dict[str, Any]) -> list[str]:
    used = {s for rs in data["areas"]["user"]["range_sets"] for p in rs["partitions"] for s in p["shards"]}
    return [s for s in data["servers"] if s not in used and not s.startswith("c")]


def apply_edit(data: dict[str, Any], draw: st.DrawFn) -> str:
    """Apply one random edit in place; returns its name (for the failure note)."""
    sets = data["areas"]["user"]["range_sets"]
    kind = draw(st.sampled_from([
        "add_partition", "add_partition", "remove_partition", "change_start", "change_shards",
        "add_range_set", "remove_range_set", "change_breakpoint", "central", "server_url", "add_server",
        "remove_server", "add_area",
    ]))
    if not sets:
        return "none (no range set left)"
    r = draw(st.integers(0, len(sets) - 1))
    parts = sets[r]["partitions"]
    bp = GDID.parse(sets[r]["breakpoint"]).sharding_value
    if kind == "add_partition":
        off = draw(VALUES)
        n = draw(st.integers(1, 2))
        parts.append({"start": str(g(off)), "shards": _unused(data)[:n]})
        parts.sort(key=lambda p: GDID.parse(p["start"]).sharding_value)
    elif kind == "remove_partition":
        parts.pop(draw(st.integers(0, len(parts) - 1)))
        if not parts:
            sets.pop(r)
    elif kind == "change_start":
        i = draw(st.integers(0, len(parts) - 1))
        parts[i]["start"] = str(g(draw(VALUES)))
        parts.sort(key=lambda p: GDID.parse(p["start"]).sharding_value)
    elif kind == "change_shards":
        p = parts[draw(st.integers(0, len(parts) - 1))]
        how = draw(st.sampled_from(["reorder", "replace", "grow", "shrink"]))
        if how == "reorder":
            p["shards"] = list(reversed(p["shards"]))
        elif how == "replace":
            p["shards"][0] = _unused(data)[0]
        elif how == "grow":
            p["shards"].append(_unused(data)[0])
        elif len(p["shards"]) > 1:
            p["shards"].pop()
    elif kind == "add_range_set":
        new_bp = draw(VALUES.filter(lambda v: v > 0))
        sets.append({"breakpoint": str(g(new_bp)), "partitions": [{"start": "0:0:0", "shards": _unused(data)[:1]}]})
        sets.sort(key=lambda rs: GDID.parse(rs["breakpoint"]).sharding_value)
    elif kind == "remove_range_set":
        sets.pop(r)
    elif kind == "change_breakpoint":
        sets[r]["breakpoint"] = str(g(draw(VALUES)))
        sets.sort(key=lambda rs: GDID.parse(rs["breakpoint"]).sharding_value)
    elif kind == "central":
        data["areas"]["central"]["shards"] = draw(st.sampled_from([["c1"], ["c0", "c1"], ["c1", "c0"]]))
    elif kind == "server_url":
        name = draw(st.sampled_from(sorted(data["servers"])))
        data["servers"][name]["primary"] = f"sqlite:///moved/{name}.db"
    elif kind == "add_server":
        data["servers"][f"n{len(data['servers'])}"] = {"primary": "sqlite:///n.db"}
    elif kind == "remove_server":
        name = draw(st.sampled_from(sorted(data["servers"])))
        del data["servers"][name]
    elif kind == "add_area":
        data["areas"]["archive"] = {"partitions": [{"start": "0:0:0", "shards": _unused(data)[-1:]}]}
    del bp
    return kind


def placement(router: Router, v: int, authority: int) -> tuple[Any, ...] | None:
    try:
        p = router.default_placement("user", g(v, authority))
    except RoutingError:
        return None
    return (p.server, p.shard_index, p.shard_count, p.partition_start, p.range_set)


def boundaries(m: PartitionMap) -> set[int]:
    out = set()
    for rs in m.areas["user"].effective_range_sets():
        out.add(rs.breakpoint.sharding_value)
        for p in rs.partitions:
            out.add(rs.breakpoint.sharding_value + p.start.sharding_value)
    return out


def moved_gdids(old: PartitionMap, new: PartitionMap, hw: int, extra: list[int], authority: int) -> list[GDID]:
    """GDIDs at or below ``hw`` (that the old map can route) whose placement differs."""
    if "user" not in new.areas or new.areas["user"].kind != "partitioned":
        return [g(max(hw, 1))]
    ro, rn = Router(old), Router(new)
    candidates = {hw, *extra}
    for b in boundaries(old) | boundaries(new):
        candidates.update({b - 1, b, b + 1})
    out = []
    for v in sorted(c for c in candidates if 1 <= c <= hw):
        before = placement(ro, v, authority)
        if before is not None and before != placement(rn, v, authority):
            out.append(g(v, authority))
    return out


@st.composite
def edits(draw: st.DrawFn) -> tuple[PartitionMap, PartitionMap, int | None, list[str]]:
    data = draw(base_maps())
    old = to_map(data)
    new_data = copy.deepcopy(data)
    names = [apply_edit(new_data, draw) for _ in range(draw(st.integers(1, 3)))]
    new_data["version"] = draw(st.sampled_from([2, 2, 2, 1]))
    try:
        new = to_map(new_data)
    except MapError:
        assume(False)
        raise
    hw = draw(st.one_of(st.none(), VALUES, st.sampled_from(sorted(boundaries(old)))))
    return old, new, hw, names


@pytest.mark.slow  # 150 Hypothesis examples, each building two maps: ~34 s at load 13 on 2 cores
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(edits(), st.lists(VALUES, max_size=8), st.integers(0, 15))
def test_accepted_edits_never_move_an_existing_gdid(
    case: tuple[PartitionMap, PartitionMap, int | None, list[str]], extra: list[int], authority: int
) -> None:
    old, new, hw, names = case
    diff = diff_maps(old, new, None if hw is None else {"user": g(hw)})
    note(f"edits={names} hw={hw} changes={[c.to_json() for c in diff.changes]}")
    moved = moved_gdids(old, new, hw if hw is not None else 2 * E60, extra, authority)
    event("accepted" if diff.ok else ("refused, moves a GDID" if moved else "refused, moves none"))
    if diff.ok:
        assert moved == [], f"accepted edit moved {moved}"
    if moved:
        assert not diff.ok


@st.composite
def safe_edits(draw: st.DrawFn) -> tuple[PartitionMap, PartitionMap, int]:
    data = draw(base_maps())
    old = to_map(data)
    top = max(boundaries(old))
    hw = draw(st.integers(0, top + 50))
    new_data = copy.deepcopy(data)
    sets = new_data["areas"]["user"]["range_sets"]
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["partition", "range_set", "server", "url", "area"]))
        if what == "partition":
            rs = sets[-1]
            bp = GDID.parse(rs["breakpoint"]).sharding_value
            lo = max(hw + 1, max(bp + GDID.parse(p["start"]).sharding_value for p in rs["partitions"]) + 1)
            off = draw(st.integers(lo, lo + 100)) - bp
            rs["partitions"].append({"start": str(g(off)), "shards": _unused(new_data)[:2]})
        elif what == "range_set":
            last = max(boundaries(to_map(new_data)))
            sets.append({"breakpoint": str(g(draw(st.integers(max(hw, last) + 1, max(hw, last) + 100)))),
                         "partitions": [{"start": "0:0:0", "shards": _unused(new_data)[:1]}]})
        elif what == "server":
            new_data["servers"][f"n{len(new_data['servers'])}"] = {"primary": "sqlite:///n.db"}
        elif what == "url":
            new_data["servers"]["s0"]["replica"] = "sqlite:///s0-replica.db"
        else:
            new_data["areas"]["archive"] = {"partitions": [{"start": "0:0:0", "shards": ["s23"]}]}
    new_data["version"] = 7
    return old, to_map(new_data), hw


@settings(max_examples=60, deadline=None)
@given(safe_edits())
def test_safe_edits_are_accepted(case: tuple[PartitionMap, PartitionMap, int]) -> None:
    old, new, hw = case
    diff = diff_maps(old, new, {"user": g(hw)})
    assert diff.ok, diff.refusal_text()
    assert moved_gdids(old, new, hw, [], 0) == []


# -- focused refusals ------------------------------------------------------------------------------

BASE = """
version: 3
servers:
  c: {primary: "sqlite:///c.db"}
  c2: {primary: "sqlite:///c2.db"}
  u1: {primary: "sqlite:///u1.db"}
  u2: {primary: "sqlite:///u2.db"}
  u3: {primary: "sqlite:///u3.db"}
  u4: {primary: "sqlite:///u4.db"}
  spare: {primary: "sqlite:///spare.db"}
areas:
  central: {kind: central, shards: [c]}
  user:
    partitions:
      - {start: "0:0:0", shards: [u1, u2]}
      - {start: "0:0:1000", shards: [u3]}
"""
HW = {"user": g(1500)}


def edited(**replace: str) -> PartitionMap:
    text = BASE
    for old, new in replace.items():
        old_text = old.replace("__", " ")
        assert old_text in text, old_text
        text = text.replace(old_text, new)
    return parse_map(text.replace("version: 3", "version: 4", 1) if "version: 3" in text else text, "<new>")


def refusals(new: PartitionMap, hw: dict[str, GDID] | None = HW, **kw: Any) -> list[tuple[str, str]]:
    d = diff_maps(parse_map(BASE, "<old>"), new, hw, **kw)
    return [(c.kind, c.reason) for c in d.refused]


def test_add_partition_above_mark_is_accepted_and_at_mark_refused() -> None:
    add = '      - {start: "0:0:1000", shards: [u3]}\n      - {start: "0:0:1501", shards: [u4]}\n'
    new = edited(**{'      - {start: "0:0:1000", shards: [u3]}\n': add})
    assert refusals(new) == []
    assert Router(new).default_placement("user", g(1500)).partition_end == g(1501)
    at_mark = edited(**{'      - {start: "0:0:1000", shards: [u3]}\n': add.replace("1501", "1500")})
    [(kind, reason)] = refusals(at_mark)
    assert kind == "partition-added" and "at or below the high-water mark 0:0:1500" in reason


def test_unknown_mark_refuses_new_partition_and_says_so() -> None:
    add = '      - {start: "0:0:1000", shards: [u3]}\n      - {start: "0:0:99999", shards: [u4]}\n'
    new = edited(**{'      - {start: "0:0:1000", shards: [u3]}\n': add})
    [(kind, reason)] = refusals(new, hw=None)
    assert kind == "partition-added" and "high-water mark of area 'user' is unknown" in reason
    [(kind, _)] = refusals(new, hw={"other": g(1)})
    assert kind == "partition-added"


def test_removed_partition_changed_start_and_shard_lists_are_refused() -> None:
    assert [k for k, _ in refusals(edited(**{'      - {start: "0:0:1000", shards: [u3]}\n': ""}))] == ["partition-removed"]
    [(kind, reason)] = refusals(edited(**{'"0:0:1000"': '"0:0:2000"'}))
    assert kind == "partition-start-changed" and "0:0:1000 changes to 0:0:2000" in reason
    [(kind, reason)] = refusals(edited(**{"[u1, u2]": "[u2, u1]"}))
    assert kind == "shards-changed" and "reordered" in reason and "reshard" in reason
    [(kind, reason)] = refusals(edited(**{"[u1, u2]": "[u1, u2, u4]"}))
    assert kind == "shards-changed" and "changed" in reason


def test_allow_reshard_of_accepts_exactly_that_partition() -> None:
    new = edited(**{"[u1, u2]": "[u1, u2, u4]"})
    assert refusals(new, allow_reshard_of=("user", g(0))) == []
    both = edited(**{"[u1, u2]": "[u1, u2, u4]", "[u3]": "[u3, spare]"})
    assert [k for k, _ in refusals(both, allow_reshard_of=("user", g(0)))] == ["shards-changed"]
    [(kind, _)] = refusals(new, allow_reshard_of=("user", g(1000)))[-1:]
    assert kind == "reshard-target"
    # The server a reshard empties keeps its stamp until an apply withdraws it: it may not
    # leave servers: in the same version.
    leaving = edited(**{"[u1, u2]": "[u1, u4]", '  u2: {primary: "sqlite:///u2.db"}\n': ""})
    [(kind, reason)] = refusals(leaving, allow_reshard_of=("user", g(0)))
    assert kind == "server-removed" and "uses it in area(s) user" in reason


def test_range_set_changes() -> None:
    as_sets = BASE.replace(
        '    partitions:\n      - {start: "0:0:0", shards: [u1, u2]}\n      - {start: "0:0:1000", shards: [u3]}\n',
        '    range_sets:\n      - breakpoint: "0:0:0"\n        partitions:\n          - {start: "0:0:0", shards: [u1, u2]}\n'
        '          - {start: "0:0:1000", shards: [u3]}\n      - breakpoint: "0:0:5000"\n'
        '        partitions: [{start: "0:0:0", shards: [u4]}]\n',
    ).replace("version: 3", "version: 4")
    assert refusals(parse_map(as_sets)) == []
    low = parse_map(as_sets.replace('"0:0:5000"', '"0:0:1200"'))
    [(kind, reason)] = refusals(low)
    assert kind == "range-set-added" and "high-water mark" in reason
    old = parse_map(as_sets)
    moved = parse_map(as_sets.replace('"0:0:5000"', '"0:0:6000"').replace("version: 4", "version: 5"))
    d = diff_maps(old, moved, HW)
    assert [c.kind for c in d.refused] == ["breakpoint-changed"]
    removed = parse_map(as_sets.replace('      - breakpoint: "0:0:5000"\n        partitions: [{start: "0:0:0", shards: [u4]}]\n', "").replace("version: 4", "version: 5"))
    assert [c.kind for c in diff_maps(old, removed, HW).refused] == ["range-set-removed"]


def test_central_area_server_and_version_refusals() -> None:
    [(kind, reason)] = refusals(edited(**{"shards: [c]}": "shards: [c, c2]}"}))
    assert kind == "central-shards" and "FNV-1a" in reason
    no_user = parse_map(BASE.split("  user:")[0].replace("version: 3", "version: 4"))
    assert [k for k, _ in refusals(no_user)] == ["area-removed"]
    [(kind, _)] = refusals(parse_map(BASE))  # same version
    assert kind == "version"
    lower = parse_map(BASE.replace("version: 3", "version: 2"))
    assert [k for k, _ in refusals(lower)] == ["version"]
    no_spare = edited(**{'  spare: {primary: "sqlite:///spare.db"}\n': ""})
    assert refusals(no_spare) == []
    assert [k for k, _ in refusals(no_spare, relocated_to={"spare"})] == ["server-removed"]


def test_urls_are_masked_in_changes() -> None:
    new = edited(**{'u1: {primary: "sqlite:///u1.db"}': 'u1: {primary: "postgresql://mdb:hunter2@db/u1"}'})
    d = diff_maps(parse_map(BASE), new, HW)
    assert d.ok
    assert "hunter2" not in repr(d.to_json()) and "***" in repr(d.to_json())


def test_new_area_and_server_are_accepted() -> None:
    text = BASE.replace("version: 3", "version: 4").replace(
        "  spare:", '  n1: {primary: "sqlite:///n1.db"}\n  spare:'
    ) + '  archive:\n    partitions: [{start: "0:0:0", shards: [n1]}]\n'
    d = diff_maps(parse_map(BASE), parse_map(text), None)
    assert d.ok, d.refusal_text()
    assert {c.kind for c in d.changes} == {"version", "server-added", "area-added"}


def test_recorded_text_never_holds_a_literal_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_TEST_PW", "s3cret")
    raw = BASE.replace('u1: {primary: "sqlite:///u1.db"}', 'u1: {primary: "postgresql://mdb:${MDB_TEST_PW}@db/u1"}')
    m = parse_map(raw)
    assert m.servers["u1"].primary == "postgresql://mdb:s3cret@db/u1"
    assert recordable_yaml(m, raw) == raw
    derived = recordable_yaml(m, None, [raw])
    assert "${MDB_TEST_PW}" in derived and "s3cret" not in derived
    with pytest.raises(MapEditError, match="literal password") as info:
        recordable_yaml(m, None, [])
    assert "s3cret" not in str(info.value)
    assert _literal_secret("postgresql://u:pw@h/db") and not _literal_secret("postgresql://u:${X}@h/db")
    assert _literal_secret("postgresql://u@h/db?password=pw") and not _literal_secret("sqlite:///x.db")
