"""mdb.maps.text: the one place a map file is written (atomic write, backup before a rewrite).

A reshard and ``mdb map pull -o`` both write through it; these tests pin what they rely on:
the old file is kept under ``<stem>.v<N>.before-<tag><suffix>`` and reported *before* the file
is replaced (a reshard journals it), a file already at the version (or newer) is left alone, and
no ``.tmp`` file is left behind.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from mdb.gdid import GDID
from mdb.maps.text import backup_map_file, new_map_text, rewrite_map_file, write_map_file
from mdb.partition_map import parse_map

MAP_V1 = """\
# the team's comments, which YAML written as data loses
version: 1
servers:
  c0: {primary: "sqlite:///c0.db"}
  a: {primary: "sqlite:///a.db"}
  b: {primary: "sqlite:///b.db"}
areas:
  central: {kind: central, shards: [c0]}
  user:
    kind: partitioned
    partitions:
      - {start: "0:0:0", shards: [a]}
"""


def _v2() -> str:
    return new_map_text(MAP_V1, "user", GDID(0, 0, 0), ["a", "b"], 2)


def test_new_map_text_changes_exactly_the_partition_and_the_version() -> None:
    text = _v2()
    new = parse_map(text, "<v2>")
    assert new.version == 2
    assert new.areas["user"].effective_range_sets()[0].partitions[0].shards == ("a", "b")
    assert parse_map(MAP_V1, "<v1>").servers == new.servers


def test_write_map_file_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    path.write_text("old", encoding="utf-8")
    write_map_file(path, MAP_V1)
    assert path.read_text(encoding="utf-8") == MAP_V1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.yaml"]


def test_rewrite_keeps_the_old_file_and_reports_it_before_replacing(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    path.write_text(MAP_V1, encoding="utf-8")
    seen: list[tuple[Path, str]] = []

    def on_backup(backup: Path) -> None:
        seen.append((backup, path.read_text(encoding="utf-8")))  # the file is not replaced yet

    rewrite_map_file(path, _v2(), 2, tag="reshard-x", on_backup=on_backup)
    backup = tmp_path / "map.v1.before-reshard-x.yaml"
    assert seen == [(backup, MAP_V1)]
    assert backup.read_text(encoding="utf-8") == MAP_V1
    assert parse_map(path.read_text(encoding="utf-8"), str(path)).version == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.v1.before-reshard-x.yaml", "map.yaml"]


def test_rewrite_is_idempotent_and_never_lowers_the_version(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    path.write_text(_v2(), encoding="utf-8")
    calls: list[Path] = []
    rewrite_map_file(path, _v2(), 2, tag="again", on_backup=calls.append)  # a resumed reshard
    rewrite_map_file(path, MAP_V1, 1, tag="older", on_backup=calls.append)
    assert calls == []
    assert path.read_text(encoding="utf-8") == _v2()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.yaml"]


def test_rewrite_of_a_missing_file_writes_it_without_a_backup(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    calls: list[Path] = []
    rewrite_map_file(path, _v2(), 2, tag="r", on_backup=calls.append)
    assert calls == [] and path.read_text(encoding="utf-8") == _v2()


def test_a_backup_is_never_overwritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "map.yaml"
    first = backup_map_file(path, "first", 1, "r")
    with caplog.at_level(logging.WARNING):
        again = backup_map_file(path, "second", 1, "r")
    assert first == again == tmp_path / "map.v1.before-r.yaml"
    assert first.read_text(encoding="utf-8") == "first"
    assert "without its comments" in caplog.text


@pytest.mark.parametrize("module", ["diff", "text", "history", "high_water"])
def test_lower_map_modules_never_import_the_store_or_the_apply(module: str) -> None:
    """History and high water sit below the Store (it calls them on refresh); diff and text are core."""
    source = (Path(__file__).parents[2] / "mdb" / "maps" / f"{module}.py").read_text(encoding="utf-8")
    imported = {
        node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom) and node.module
    } | {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for alias in node.names}
    forbidden = {"mdb.store", "mdb.schema", "mdb.maps.apply", "mdb.moves", "mdb.cli"}
    if module in ("diff", "text"):
        forbidden |= {"mdb.cluster", "mdb.idgen", "mdb.maps.history", "mdb.maps.high_water", "mdb.engines", "mdb.session"}
    assert not {m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)}
