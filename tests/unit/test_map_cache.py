"""The map file is parsed once per change, not on every Store refresh (issue 19).

Parses are counted by wrapping :func:`mdb.partition_map.parse_map`, which every loader calls;
the assertions are about what the Store routes with, so a cache that served a stale map fails.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map

import mdb.partition_map as partition_map
from mdb import Store
from mdb.demo.models import UserBriefcase
from mdb.schema import apply_schema


def count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every parse_map call from now on appends its source."""
    calls: list[str] = []
    real: Callable[..., Any] = partition_map.parse_map

    def counting(text: str, source: str = "<map>", **kwargs: Any) -> partition_map.PartitionMap:
        calls.append(source)
        return real(text, source, **kwargs)

    monkeypatch.setattr(partition_map, "parse_map", counting)
    return calls


def test_refresh_does_not_parse_an_unchanged_map_again(
    tmp_path: Path, tmp_sqlite_urls: Callable[[int], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = tmp_sqlite_urls(3)
    path = write_map(tmp_path, {"c": urls[0], "u1": urls[1], "u2": urls[2]}, central=["c"],
                     partitions=[("0:0:0", ["u1"])])
    calls = count_parses(monkeypatch)
    store = Store.from_yaml(path, types=[UserBriefcase])
    try:
        assert all(r.ok for r in apply_schema(store))
        for _ in range(3):  # e.g. three stale-route retries
            store.refresh()
        assert len(calls) == 1, calls
        assert store.map.version == 1

        # A new version of the file is parsed (once) and routed with.
        write_map(tmp_path, {"c": urls[0], "u1": urls[1], "u2": urls[2]}, central=["c"],
                  partitions=[("0:0:0", ["u2"])], version=2)
        store.refresh()
        store.refresh()
        assert len(calls) == 2, calls
        assert store.map.version == 2
        assert [list(shards) for _start, _end, shards in store.router.partitions("user")] == [["u2"]]
    finally:
        store.close()


def test_a_changed_environment_variable_is_parsed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``${NAME}`` is expanded by the parse, so the same text with another value is another map."""
    path = tmp_path / "map.yaml"
    path.write_text(
        "version: 1\nservers:\n  c: {primary: 'sqlite:///${MDB_TEST_DB}'}\n"
        "areas:\n  central: {kind: central, shards: [c]}\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("MDB_TEST_DB", str(tmp_path / "a.db"))
    first = partition_map.load_map_cached(path)
    assert partition_map.load_map_cached(path) is first
    monkeypatch.setenv("MDB_TEST_DB", str(tmp_path / "b.db"))
    second = partition_map.load_map_cached(path)
    assert second.servers["c"].primary.endswith("b.db")
    assert first.servers["c"].primary.endswith("a.db")


def test_a_broken_file_is_reported_every_time(tmp_path: Path) -> None:
    path = tmp_path / "map.yaml"
    path.write_text("version: 1\nservers: {}\nareas: {}\nbogus: 1\n", encoding="utf-8")
    for _ in range(2):
        with pytest.raises(partition_map.MapError, match="bogus"):
            partition_map.load_map_cached(path)
