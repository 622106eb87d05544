"""Hostile and broken map files (issue 11, items 7, 14-17): one error line, exit 2, bounded cost.

Each case goes through the one loader (``load_map``) that both the CLI and ``Store.from_yaml``
use, and through the installed ``mdb`` console script, whose whole stderr must be one
``error:`` line. The billion-laughs and deep-nesting files never finish (or end in a
RecursionError traceback) on a loader without the bounds, so those tests carry a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdb import MapError, Store, load_map
from mdb.partition_map import MAX_ALIAS_NODES, MAX_DEPTH, MAX_PROBLEMS_LISTED, parse_map

MDB = Path(sys.executable).parent / "mdb"
SECRET = "Sw0rdfish-hostile"

GOOD_TAIL = """\
areas:
  central: {kind: central, shards: [c]}
  user:
    partitions:
      - {start: "0:0:0", shards: [u]}
"""


def billion_laughs(levels: int) -> str:
    """The classic: each level is nine aliases of the level below (9**levels strings in all)."""
    text = 'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels + 1):
        text += f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]\n"
    return text


def run_mdb(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "MDB_TEST_HOSTILE_PW": SECRET}
    return subprocess.run([str(MDB), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


HOSTILE: dict[str, tuple[bytes, str]] = {
    "billion-laughs": (billion_laughs(8).encode(), f"aliases expand to more than {MAX_ALIAS_NODES} nodes"),
    "nested": (b"[" * 1000, f"nests deeper than {MAX_DEPTH} levels"),
    "nested-mappings": (b"".join(b"  " * i + b"k:\n" for i in range(200)), f"nests deeper than {MAX_DEPTH} levels"),
    "recursive-alias": (b"a: &a [*a]\n", "recursive YAML"),
    "latin-1": ('version: 1\nservers:\n  c: {primary: "sqlite:///caf\xe9.db"}\n'.encode("latin-1"),
                ":3: the map is not UTF-8 text: byte 0xe9 at offset 49"),
    "huge-int": (b"version: " + b"1" * 5000 + b"\n", "version: cannot read this value"),
    "python-tag": (b"version: !!python/name:os.system x\n", "version: cannot read this value"),
    # Past BIGINT: accepted, it made `schema apply` die with an OverflowError traceback.
    "version-past-bigint": (b"version: 9223372036854775808\nservers: {}\nareas: {}\n", "version: Input should be less than or equal to 9223372036854775807"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_file_is_one_line_exit_2(tmp_path: Path, name: str) -> None:
    data, needle = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(data)
    with pytest.raises(MapError, match=needle.replace("*", r"\*")):
        load_map(path)
    with pytest.raises(MapError, match=needle.replace("*", r"\*")):
        Store.from_yaml(path)  # the same loader
    line = one_error_line(run_mdb("map", "check", str(path), cwd=tmp_path))
    assert needle in line and len(line) < 500


def test_aliases_that_reuse_a_small_list_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        'version: 1\nservers:\n  c: {primary: "sqlite:///c.db"}\n  u: {primary: "sqlite:///u.db"}\n'
        "areas:\n  central: {kind: central, shards: [c]}\n"
        '  user: {partitions: [{start: "0:0:0", shards: &us [u]}]}\n'
        '  more: {partitions: [{start: "0:0:0", shards: *us}]}\n'
    )
    m = load_map(path)
    assert [p.shards for a in ("user", "more") for p in m.areas[a].partitions or ()] == [("u",), ("u",)]


def test_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.write(b"# " + b"x" * (9 * 1024 * 1024) + b"\n")
    with pytest.raises(MapError, match="larger than 8 MiB"):
        load_map(path)


# -- URLs mdb cannot use (item 7) and secrets in them (item 14) ---------------------------------------


@pytest.mark.parametrize(
    "url, needle",
    [
        ("sqlit:///x.db", "mdb does not support 'sqlit' servers"),
        ("postgresql+psycopg2://u@h/x", "mdb does not support the 'psycopg2' driver (use postgresql+psycopg)"),
        ("mysql://u@h/x", "mdb does not support 'mysql' servers"),
        ("not a url", "'not a url' is not a database URL"),
        ("sqlite+aiosqlite:///x.db", "mdb does not support the 'aiosqlite' driver"),
        ("mongodb://u:p@", "mongodb://u:***@: not a valid MongoDB URL: Empty host"),
        ("mongodb://h:99999/x", "not a valid MongoDB URL: Port must be an integer"),
        ("sqlite:///", "a SQLite server needs a file path"),
        ("sqlite:///:memory:", "an in-memory database keeps nothing"),
    ],
)
def test_unsupported_url_names_server_and_line(tmp_path: Path, url: str, needle: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(f'version: 1\nservers:\n  c: {{primary: "sqlite:///c.db"}}\n  u: {{primary: "{url}"}}\n' + GOOD_TAIL)
    line = one_error_line(run_mdb("map", "check", str(path), cwd=tmp_path))
    assert f"{path}:4: servers.u.primary: server 'u': " in line and needle in line


def test_url_with_empty_scheme_is_refused_and_masked(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        'version: 1\nservers:\n  c: {primary: "://postgres:${MDB_TEST_HOSTILE_PW}@127.0.0.1:2/x"}\n'
        '  u: {primary: "sqlite:///u.db"}\n' + GOOD_TAIL
    )
    for args in (["map", "check", str(path)], ["route", str(path), "user", "0:0:1"], ["map", "show", str(path)]):
        proc = run_mdb(*args, cwd=tmp_path)
        line = one_error_line(proc)
        assert SECRET not in proc.stderr + proc.stdout
        assert "servers.c.primary: server 'c': '://postgres:***@127.0.0.1:2/x' is not a database URL" in line


def test_supported_urls_load(tmp_path: Path) -> None:
    m = parse_map(
        'version: 1\nservers:\n  c: {primary: "postgresql://u@h/c"}\n  u: {primary: "postgres://u@h/u", '
        'replica: "postgresql+psycopg://u@h2/u"}\n' + GOOD_TAIL
    )
    assert m.servers["u"].replica == "postgresql+psycopg://u@h2/u"


# -- what one error line says ------------------------------------------------------------------------


def test_problem_list_is_capped(tmp_path: Path) -> None:
    parts = "".join(f'      - {{start: "0:0:{i}", shards: [u, u]}}\n' for i in range(100))
    text = 'version: 1\nservers:\n  c: {primary: "sqlite:///c.db"}\n  u: {primary: "sqlite:///u.db"}\n' \
           "areas:\n  central: {kind: central, shards: [c]}\n  user:\n    partitions:\n" + parts
    with pytest.raises(MapError) as info:
        parse_map(text, "m.yaml")
    message = str(info.value)
    assert message.count("is used twice") == MAX_PROBLEMS_LISTED
    assert message.endswith(f"... and {100 + 99 - MAX_PROBLEMS_LISTED} more") and len(message) < 3000


def test_a_missing_variable_is_named_once_with_its_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MDB_TEST_NOPE", raising=False)
    text = "version: 1\nservers:\n" + "".join(
        f'  s{i}: {{primary: "postgresql://u:${{MDB_TEST_NOPE}}@h/s{i}"}}\n' for i in range(5)
    ) + "areas:\n  central: {kind: central, shards: [s0]}\n"
    with pytest.raises(MapError) as info:
        parse_map(text, "m.yaml")
    message = str(info.value)
    assert message.count("MDB_TEST_NOPE") == 1
    assert message == "m.yaml:3: servers.s0.primary: environment variable MDB_TEST_NOPE is not set (also used on lines 4, 5, 6, 7)"


def test_a_bad_gdid_does_not_claim_the_list_is_empty() -> None:
    text = 'version: 1\nservers:\n  c: {primary: "sqlite:///c.db"}\n  u: {primary: "sqlite:///u.db"}\n' \
           'areas:\n  central: {kind: central, shards: [c]}\n  user:\n    partitions:\n      - {start: "0:x:0", shards: [u]}\n'
    with pytest.raises(MapError) as info:
        parse_map(text, "m.yaml")
    assert "invalid GDID '0:x:0'" in str(info.value) and "empty" not in str(info.value)


# -- any input: a map or one MapError, nothing else ------------------------------------------------------

YAML_SOUP = st.text(alphabet="[]{}&*!|>-:?,'\"#%@` \n\t\\x01\u00e9\u2028abc019", max_size=200)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=200), YAML_SOUP.map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_any_bytes_load_or_raise_one_map_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        load_map(path)
    except MapError as exc:
        assert "\n" not in str(exc)  # one line, whatever the input
