"""Partition map loading and validation: every error names the file, the line and the problem.

Each broken map below marks the line the error must point at with a ``#<`` comment, so the
expected line number is computed from the text rather than hard-coded.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import mdb
from mdb import GDID, MapError, PartitionMap, load_map, parse_map
from mdb.partition_map import ServerSpec

REPO = Path(__file__).resolve().parents[2]
MAPS = REPO / "partition_maps"
MARK = "#<"


def marked_line(text: str) -> int:
    lines = [i for i, line in enumerate(text.splitlines(), start=1) if MARK in line]
    assert len(lines) == 1, "a test map must mark exactly one line"
    return lines[0]


def expect_map_error(tmp_path: Path, text: str, problem: str, name: str = "broken.yaml") -> str:
    """Load ``text`` from a file; the error must name the file, the marked line and match ``problem``."""
    text = textwrap.dedent(text)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    line = marked_line(text)
    with pytest.raises(MapError) as info:
        load_map(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, mdb.MdbError)
    assert f"{path}:{line}:" in message, f"expected {path}:{line} in: {message}"
    assert re.search(problem, message), f"expected /{problem}/ in: {message}"
    assert "\n" not in message, "a map error is one message on one line"
    assert "Traceback" not in message and "pydantic" not in message.lower()
    return message


GOOD = """\
version: 3
servers:
  central-a: {primary: "sqlite:///c.db"}
  central-b: {primary: "sqlite:///c2.db"}
  s1: {primary: "sqlite:///s1.db"}
  s2: {primary: "sqlite:///s2.db", replica: "sqlite:///s2r.db"}
  s3: {primary: "sqlite:///s3.db"}
  s4: {primary: "sqlite:///s4.db"}
areas:
  central:
    kind: central
    shards: [central-a, central-b]
  user:
    partitions:
      - {start: "0:0:0", shards: [s1, s2]}
      - {start: "0:0:1000", shards: [s3]}
  archive:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [s1]}]
      - breakpoint: "1:0:0"
        partitions:
          - {start: "0:0:0", shards: [s2, s3]}
          - {start: "0:0:500", shards: [s4]}
"""


def test_good_map_loads(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    m = load_map(path)
    assert isinstance(m, PartitionMap)
    assert m.version == 3
    assert m.central_area == "central"
    assert list(m.areas) == ["central", "user", "archive"]
    # a relative SQLite path means "next to the map file", wherever mdb runs from
    assert m.servers["s2"].replica == f"sqlite:///{(tmp_path / 's2r.db').resolve()}"
    assert m.servers["s1"].replica is None
    user = m.areas["user"]
    assert [p.start for p in user.partitions] == [GDID(0, 0, 0), GDID(0, 0, 1000)]
    assert [p.shards for p in user.partitions] == [("s1", "s2"), ("s3",)]
    archive = m.areas["archive"].effective_range_sets()
    assert [rs.breakpoint for rs in archive] == [GDID(0, 0, 0), GDID(1, 0, 0)]
    # plain partitions are one range set with breakpoint 0
    (only,) = user.effective_range_sets()
    assert only.breakpoint == GDID.ZERO and only.partitions == user.partitions
    assert m.source == str(path)


def test_parse_map_names_its_source() -> None:
    with pytest.raises(MapError, match=r"^inline\.yaml:1: version"):
        parse_map("version: 0\nservers: {}\nareas: {}\n", "inline.yaml")


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    m = parse_map(GOOD, "good.yaml")
    again = parse_map(m.to_yaml(), "again.yaml")
    assert again.model_dump() == m.model_dump()


@pytest.mark.parametrize("path", sorted(MAPS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_maps_load(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_PG_PASSWORD", "example-secret")
    m = load_map(path)
    assert m.central_area
    mdb.Router(m)  # and the router accepts it


def test_example_map_is_the_design_example() -> None:
    m = load_map(MAPS / "example.yaml")
    assert m.version == 3
    assert [(str(p.start), p.shards) for p in m.areas["user"].partitions] == [
        ("0:0:0", ("user-1", "user-2")),
        ("0:0:250000", ("user-3", "user-4", "user-5")),
    ]
    sets = m.areas["archive"].range_sets
    assert [str(rs.breakpoint) for rs in sets] == ["0:0:0", "0:0:100000000"]
    assert [(str(p.start), p.shards) for p in sets[1].partitions] == [
        ("0:0:0", ("user-7", "user-8")),
        ("0:0:50000", ("user-9",)),
    ]


def test_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "missing.yaml"
    with pytest.raises(MapError) as info:
        load_map(missing)
    assert str(missing) in str(info.value)


def test_directory_is_not_a_map(tmp_path: Path) -> None:
    with pytest.raises(MapError) as info:
        load_map(tmp_path)
    assert str(tmp_path) in str(info.value)


# -- ${NAME} expansion and secrets --------------------------------------------------------------------

SECRET = "s3cr3t-Pa55word"

SECRET_MAP = """\
version: 1
servers:
  c: {primary: "postgresql+psycopg://mdb:${MDB_TEST_PW}@10.0.0.5/central"}
  u: {primary: "postgresql+psycopg://mdb:${MDB_TEST_PW}@10.0.0.6/u", replica: "postgresql+psycopg://ro:${MDB_TEST_PW}@10.0.0.7/u?sslmode=${MDB_TEST_SSL}"}
areas:
  central: {kind: central, shards: [c]}
  user:
    partitions: [{start: "0:0:0", shards: [u]}]
"""


def test_env_expansion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_TEST_PW", SECRET)
    monkeypatch.setenv("MDB_TEST_SSL", "require")
    m = parse_map(SECRET_MAP, "secret.yaml")
    assert m.servers["c"].primary == f"postgresql+psycopg://mdb:{SECRET}@10.0.0.5/central"
    assert m.servers["u"].replica == f"postgresql+psycopg://ro:{SECRET}@10.0.0.7/u?sslmode=require"


def test_env_expansion_is_not_recursive_and_leaves_other_dollars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_TEST_PW", "${MDB_TEST_OTHER}")
    monkeypatch.delenv("MDB_TEST_OTHER", raising=False)
    monkeypatch.setenv("MDB_TEST_SSL", "x")
    m = parse_map(SECRET_MAP.replace("mdb:${MDB_TEST_PW}@10.0.0.5", "mdb:$PLAIN@10.0.0.5"), "s.yaml")
    assert m.servers["c"].primary == "postgresql+psycopg://mdb:$PLAIN@10.0.0.5/central"
    assert "${MDB_TEST_OTHER}" in m.servers["u"].primary


def test_repr_never_shows_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_TEST_PW", SECRET)
    monkeypatch.setenv("MDB_TEST_SSL", "require")
    m = parse_map(SECRET_MAP, "secret.yaml")
    for text in (repr(m), str(m), repr(m.servers), repr(m.servers["u"]), str(m.servers["u"]), repr(m.servers["c"])):
        assert SECRET not in text
    assert "***" in repr(m.servers["u"])
    assert "10.0.0.7" in repr(m.servers["u"])  # masked, not dropped
    assert SECRET not in m.servers["u"].masked_primary
    assert SECRET not in (m.servers["u"].masked_replica or "")


def test_server_spec_repr_masks() -> None:
    spec = ServerSpec(primary=f"postgresql://a:{SECRET}@h/db", replica=f"postgresql://b:{SECRET}@r/db")
    assert SECRET not in repr(spec) and SECRET not in str(spec)
    assert "h/db" in repr(spec) and "r/db" in repr(spec)


def test_errors_in_a_map_with_secrets_do_not_leak_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDB_TEST_PW", SECRET)
    monkeypatch.setenv("MDB_TEST_SSL", "require")
    broken = SECRET_MAP.replace("shards: [u]}]", "shards: [u, nope]}]  #<")
    message = expect_map_error(tmp_path, broken, r"unknown server 'nope'")
    assert SECRET not in message


# -- every map error: file, line, problem --------------------------------------------------------------

HEAD = """\
version: 1
servers:
  c: {primary: "sqlite:///c.db"}
  a: {primary: "sqlite:///a.db"}
  b: {primary: "sqlite:///b.db"}
  d: {primary: "sqlite:///d.db"}
areas:
  central:
    kind: central
    shards: [c]
"""


def test_unknown_server(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - start: "0:0:0"
        shards: [a, b]
      - start: "0:0:10"
        shards:
          - a2   #<
""",
        r"unknown server 'a2'",
    )


def test_unknown_server_in_central(tmp_path: Path) -> None:
    text = HEAD.replace("    shards: [c]\n", "    shards: [c, zz]   #<\n")
    expect_map_error(tmp_path, text, r"unknown server 'zz'")


def test_duplicate_start(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - start: "0:0:0"
        shards: [a]
      - start: "0:0:100"
        shards: [b]
      - start: "0:0:100"   #<
        shards: [d]
""",
        r"duplicate partition start 0:0:100",
    )


def test_duplicate_start_written_differently(tmp_path: Path) -> None:
    # the same GDID in hex is still a duplicate
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - {start: "0:0:0", shards: [a]}
      - {start: "0:0:255", shards: [b]}
      - {start: "0000000000000000000000ff", shards: [d]}   #<
""",
        r"duplicate partition start",
    )


def test_unsorted_start(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - {start: "0:0:0", shards: [a]}
      - {start: "0:0:500", shards: [b]}
      - {start: "0:0:499", shards: [d]}   #<
""",
        r"unsorted partition start 0:0:499.*strictly increase",
    )


def test_unsorted_start_across_eras(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - {start: "1:0:0", shards: [a]}
      - {start: "0:0:1152921504606846975", shards: [b]}   #<
""",
        r"unsorted partition start",
    )


def test_start_with_authority(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - {start: "0:0:0", shards: [a]}
      - {start: "0:3:100", shards: [b]}   #<
""",
        r"partition start 0:3:100 must have authority 0",
    )


def test_breakpoint_with_authority(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [a]}]
      - breakpoint: "0:1:0"   #<
        partitions: [{start: "0:0:0", shards: [b]}]
""",
        r"breakpoint 0:1:0 must have authority 0",
    )


def test_empty_shard_list(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - start: "0:0:0"
        shards: []   #<
""",
        r"areas\.user\.partitions\[0\]\.shards: the shards list is empty",
    )


def test_empty_central_shard_list(tmp_path: Path) -> None:
    text = HEAD.replace("    shards: [c]\n", "    shards: []   #<\n")
    expect_map_error(tmp_path, text, r"central area needs a non-empty shards")


def test_empty_partition_list(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions: []   #<
""",
        r"the partitions list is empty",
    )


def test_empty_range_set_list(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets: []   #<
""",
        r"the range_sets list is empty",
    )


def test_empty_partitions_in_a_range_set(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: []   #<
""",
        r"the partitions list is empty",
    )


def test_same_server_twice_in_one_partition(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - start: "0:0:0"
        shards:
          - a
          - b
          - a   #<
""",
        r"server 'a' is used twice in area 'user'",
    )


def test_same_server_twice_across_partitions(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions:
      - {start: "0:0:0", shards: [a, b]}
      - {start: "0:0:50", shards: [d, b]}   #<
""",
        r"server 'b' is used twice in area 'user'.*partitions\[0\]\.shards\[1\]",
    )


def test_same_server_twice_across_range_sets(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [a, b]}]
      - breakpoint: "0:0:1000"
        partitions:
          - {start: "0:0:0", shards: [d]}
          - {start: "0:0:10", shards: [b]}   #<
""",
        r"server 'b' is used twice in area 'user'",
    )


def test_same_server_in_central_twice(tmp_path: Path) -> None:
    text = HEAD.replace("    shards: [c]\n", "    shards: [c, c]   #<\n")
    expect_map_error(tmp_path, text, r"server 'c' is used twice in area 'central'")


def test_same_server_in_two_areas_is_fine() -> None:
    m = parse_map(
        HEAD
        + """\
  user:
    partitions: [{start: "0:0:0", shards: [a, b]}]
  other:
    partitions: [{start: "0:0:0", shards: [b, a]}]
""",
        "ok.yaml",
    )
    assert m.areas["other"].partitions[0].shards == ("b", "a")


def test_missing_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MDB_TEST_SURELY_UNSET", raising=False)
    text = HEAD.replace(
        '  d: {primary: "sqlite:///d.db"}\n',
        '  d:\n    primary: "postgresql://u:${MDB_TEST_SURELY_UNSET}@h/db"   #<\n',
    )
    expect_map_error(tmp_path, text, r"servers\.d\.primary: environment variable MDB_TEST_SURELY_UNSET is not set")


def test_no_central_area(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        """\
version: 1
servers:
  a: {primary: "sqlite:///a.db"}
areas:   #<
  user:
    partitions: [{start: "0:0:0", shards: [a]}]
""",
        r"exactly one .*central.*found none",
    )


def test_two_central_areas(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        """\
version: 1
servers:
  a: {primary: "sqlite:///a.db"}
  b: {primary: "sqlite:///b.db"}
areas:   #<
  central: {kind: central, shards: [a]}
  central2: {kind: central, shards: [b]}
""",
        r"exactly one central area, found 2: central, central2",
    )


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('"0:0"', r"invalid GDID '0:0'"),
        ('"0:16:0"', r"invalid GDID '0:16:0'.*authority"),
        ('"-1:0:0"', r"invalid GDID '-1:0:0'"),
        ('"zz"', r"invalid GDID 'zz'"),
        ('"0:0:1152921504606846976"', r"invalid GDID '0:0:1152921504606846976'.*counter"),
        ("17", r"invalid GDID 17"),
    ],
)
def test_bad_gdid_text(tmp_path: Path, bad: str, problem: str) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + f"""\
  user:
    partitions:
      - start: "0:0:0"
        shards: [a]
      - start: {bad}   #<
        shards: [b]
""",
        r"areas\.user\.partitions\[1\]\.start: " + problem,
    )


def test_bad_breakpoint_text(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:x"   #<
        partitions: [{start: "0:0:0", shards: [a]}]
""",
        r"range_sets\[0\]\.breakpoint: invalid GDID '0:0:x'",
    )


def test_unknown_top_level_key(tmp_path: Path) -> None:
    expect_map_error(tmp_path, HEAD + "verison: 2   #<\n", r"unknown key 'verison'")


def test_source_is_not_a_map_key(tmp_path: Path) -> None:
    expect_map_error(tmp_path, HEAD + "source: elsewhere.yaml   #<\n", r"unknown key 'source'")


@pytest.mark.parametrize(
    "text, key",
    [
        (HEAD.replace('  b: {primary: "sqlite:///b.db"}', '  b: {primary: "sqlite:///b.db", replika: "x"}   #<'), "replika"),
        (HEAD.replace("    kind: central\n", "    kind: central\n    shard_count: 3   #<\n"), "shard_count"),
        (HEAD + '  user:\n    partitions:\n      - {start: "0:0:0", shards: [a], weight: 2}   #<\n', "weight"),
        (
            HEAD
            + '  user:\n    range_sets:\n      - breakpoint: "0:0:0"\n        start_over: true   #<\n'
            + '        partitions: [{start: "0:0:0", shards: [a]}]\n',
            "start_over",
        ),
    ],
    ids=["server", "area", "partition", "range_set"],
)
def test_unknown_nested_keys(tmp_path: Path, text: str, key: str) -> None:
    expect_map_error(tmp_path, text, rf"unknown key '{key}'")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    partitions: [{start: "0:0:0", shards: [a]}]
  user:   #<
    partitions: [{start: "0:0:0", shards: [b]}]
""",
        r"duplicate key 'user'",
    )


@pytest.mark.parametrize(
    "text",
    [
        HEAD + "  user: *nowhere   #<\n",
        HEAD.replace("version: 1\n", "version: 1\n  bad: indent   #<\n"),
        HEAD + "  user: {partitions: [}   #<\n",
    ],
    ids=["undefined-alias", "indentation", "flow"],
)
def test_invalid_yaml(tmp_path: Path, text: str) -> None:
    expect_map_error(tmp_path, text, r"invalid YAML")


def test_an_unclosed_bracket_is_traced_to_the_line_that_opened_it(tmp_path: Path) -> None:
    """The parser notices a missing ``}`` only at the next line; the message also names the
    line where the flow mapping started, where the fix goes."""
    path = tmp_path / "unclosed.yaml"
    path.write_text('version: 1\nservers:\n  a: {primary: "sqlite:///a.db"\n  b: {primary: "sqlite:///b.db"}\n')
    with pytest.raises(MapError, match=re.escape(f"{path}:4: invalid YAML") + r".*flow mapping at line 3, column 6"):
        load_map(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(MapError, match=re.escape(str(path)) + r".*empty"):
        load_map(path)


def test_not_a_mapping(tmp_path: Path) -> None:
    expect_map_error(tmp_path, "- version   #<\n- 1\n", r"must be a mapping")


def test_missing_required_keys(tmp_path: Path) -> None:
    expect_map_error(tmp_path, "version: 1   #<\n", r"servers: required key is missing")


def test_breakpoints_not_increasing(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [a]}]
      - breakpoint: "0:0:1000"
        partitions: [{start: "0:0:0", shards: [b]}]
      - breakpoint: "0:0:1000"   #<
        partitions: [{start: "0:0:0", shards: [d]}]
""",
        r"breakpoint 0:0:1000 must be above the previous breakpoint 0:0:1000",
    )


def test_breakpoints_decreasing(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "1:0:0"
        partitions: [{start: "0:0:0", shards: [a]}]
      - breakpoint: "0:0:5"   #<
        partitions: [{start: "0:0:0", shards: [b]}]
""",
        r"breakpoint 0:0:5 must be above the previous breakpoint 1:0:0",
    )


@pytest.mark.parametrize("offset", ["0:0:1000", "0:0:1001", "1:0:0"])
def test_partition_start_at_or_after_next_breakpoint(tmp_path: Path, offset: str) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + f"""\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions:
          - {{start: "0:0:0", shards: [a]}}
          - {{start: "{offset}", shards: [d]}}   #<
      - breakpoint: "0:0:1000"
        partitions: [{{start: "0:0:0", shards: [b]}}]
""",
        rf"partition start {offset} .*at or past the next breakpoint",
    )


def test_partition_start_just_below_next_breakpoint_is_fine() -> None:
    parse_map(
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:500"
        partitions:
          - {start: "0:0:0", shards: [a]}
          - {start: "0:0:499", shards: [d]}
      - breakpoint: "0:0:1000"
        partitions: [{start: "0:0:0", shards: [b]}]
""",
        "ok.yaml",
    )


def test_later_range_set_must_start_at_offset_zero(tmp_path: Path) -> None:
    # otherwise GDIDs between the breakpoint and its first start could not be routed at all
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [a]}]
      - breakpoint: "0:0:1000"
        partitions:
          - {start: "0:0:5", shards: [b]}   #<
""",
        r"first partition of range set 0:0:1000 must start at offset 0:0:0",
    )


def test_start_past_the_largest_gdid(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [a]}]
      - breakpoint: "4294967295:0:0"
        partitions:
          - {start: "0:0:0", shards: [b]}
          - {start: "1:0:0", shards: [d]}   #<
""",
        r"past the largest GDID",
    )


def test_central_area_with_partitions(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        """\
version: 1
servers:
  a: {primary: "sqlite:///a.db"}
areas:
  central:   #<
    kind: central
    shards: [a]
    partitions: [{start: "0:0:0", shards: [a]}]
""",
        r"a central area has shards:, not partitions",
    )


def test_partitioned_area_with_both_partitions_and_range_sets(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD
        + """\
  user:   #<
    partitions: [{start: "0:0:0", shards: [a]}]
    range_sets:
      - breakpoint: "0:0:0"
        partitions: [{start: "0:0:0", shards: [b]}]
""",
        r"areas\.user: a partitioned area needs exactly one of partitions: or range_sets:",
    )


def test_partitioned_area_with_neither(tmp_path: Path) -> None:
    expect_map_error(tmp_path, HEAD + "  user: {}   #<\n", r"needs exactly one of partitions: or range_sets:")


def test_partitioned_area_with_shards(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD + '  user:\n    partitions: [{start: "0:0:0", shards: [a]}]\n    shards: [b]   #<\n',
        r"shards: belongs to a central area",
    )


def test_unknown_area_kind(tmp_path: Path) -> None:
    expect_map_error(
        tmp_path,
        HEAD + '  user:\n    kind: sharded   #<\n    partitions: [{start: "0:0:0", shards: [a]}]\n',
        r"areas\.user\.kind",
    )


@pytest.mark.parametrize("version", ["0", "-3"])
def test_version_below_one(tmp_path: Path, version: str) -> None:
    expect_map_error(tmp_path, HEAD.replace("version: 1\n", f"version: {version}   #<\n"), r"version: .*greater than or equal to 1")


def test_version_must_be_an_integer(tmp_path: Path) -> None:
    expect_map_error(tmp_path, HEAD.replace("version: 1\n", "version: 2.5   #<\n"), r"version: ")


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    text = HEAD + """\
  user:
    partitions:
      - {start: "0:0:0", shards: [a, ghost]}   #<
      - {start: "0:0:0", shards: [b]}
"""
    message = expect_map_error(tmp_path, text, r"unknown server 'ghost'")
    assert "duplicate partition start" in message
    assert f"{tmp_path / 'broken.yaml'}:{marked_line(text) + 1}:" in message
