"""Maps and Stores behind a transaction-mode PgBouncer, for the tests/test_pgbouncer_*.py suites.

Every server of such a map is the same database twice: ``primary:`` through PgBouncer with
``pooler: transaction`` (what the application uses) and ``direct:`` beside it (what the tools
use, see docs/operations.md "Behind PgBouncer").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.mapfiles import PartitionList, map_dict, write_map
from support.moves import Cluster

from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.pgbouncer import PgBouncer

__all__ = ["THROUGH_PGBOUNCER", "Direct", "PooledCluster", "Pooling", "make_pooled_cluster", "pooled_servers", "tools_store", "write_pooled_map"]


def pooled_servers(
    pgbouncer: Callable[..., PgBouncer], direct: Mapping[str, str], pool_size: int = 3
) -> tuple[PgBouncer, dict[str, str]]:
    """One PgBouncer in front of every database of ``direct`` (server name -> URL); returns it
    and server name -> pooled URL."""
    bouncer = pgbouncer(list(direct.values()), pool_size=pool_size)
    return bouncer, dict(zip(direct, bouncer.pooled_urls, strict=True))


def write_pooled_map(
    directory: str | Path,
    pooled: Mapping[str, str],
    direct: Mapping[str, str],
    *,
    central: list[str],
    partitions: PartitionList = (),
    version: int = 1,
    filename: str = "map.yaml",
    **kwargs: Any,
) -> Path:
    """:func:`support.mapfiles.write_map`, every server marked ``pooler: transaction`` with its ``direct:`` URL."""
    data = map_dict(pooled, central=central, partitions=partitions, version=version, **kwargs)
    return _write(Path(directory) / filename, _pooled(data, direct))


def _pooled(data: dict[str, Any], direct: Mapping[str, str]) -> dict[str, Any]:
    for name, spec in data["servers"].items():
        spec["pooler"] = "transaction"
        if direct:
            spec["direct"] = direct[name]
    return data


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path


def tools_store(store_factory: Callable[[], Any]) -> Any:
    """A Store as the tools open it: its engines use the ``direct:`` URLs."""
    store = store_factory()
    store.engines.use_direct()
    return store


@dataclass
class PooledCluster(Cluster):
    """:class:`support.moves.Cluster` behind PgBouncer: ``urls`` are the pooled URLs; ``direct`` the
    databases' own URLs, written as ``direct:`` when ``tools_direct`` (else the tools, too, go
    through PgBouncer)."""

    direct: dict[str, str] = field(default_factory=dict)
    tools_direct: bool = True

    def write(self, partitions: Sequence[tuple[str, Sequence[str]]], version: int) -> Path:
        data = map_dict(self.urls, central=self.central, partitions=partitions, version=version)
        data["models"] = ["mdb.demo.models"]
        return _write(self.path, _pooled(data, self.direct if self.tools_direct else {}))

    def tools(self) -> Store:
        """A Store as the CLI tools open one (direct URLs where the map has them)."""
        return tools_store(self.store)  # type: ignore[no-any-return]


def make_pooled_cluster(
    pgbouncer: Callable[..., PgBouncer], direct: Mapping[str, str], tmp_path: Path,
    partitions: Sequence[tuple[str, Sequence[str]]], *, tools_direct: bool = True, central: Sequence[str] = ("c",),
) -> PooledCluster:
    """:func:`support.moves.make_cluster` behind one PgBouncer (pool of 3 per database)."""
    _, pooled = pooled_servers(pgbouncer, direct)
    cluster = PooledCluster(pooled, tmp_path / "map.yaml", list(central), dict(direct), tools_direct)
    cluster.write(partitions, 1)
    with cluster.tools() as store:
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return cluster


THROUGH_PGBOUNCER = pytest.mark.parametrize("pg_route", ["direct", "pgbouncer"], indirect=True)
"""Runs a test twice, on direct connections and through one transaction-mode PgBouncer: the test's
suite builds its databases and maps with the ``pg_route`` fixture (tests/support/plugin.py)."""


class Direct:
    """The direct route of ``pg_route``: fresh databases, maps written as they are."""

    name = "direct"

    def __init__(self, pg_databases: Callable[[int], list[str]]) -> None:
        self._pg_databases = pg_databases

    def databases(self, n: int) -> list[str]:
        return self._pg_databases(n)

    def write_map(self, directory: str | Path, servers: Mapping[str, str], **kwargs: Any) -> Path:
        return write_map(directory, servers, **kwargs)


class Pooling:
    """Fresh databases behind one PgBouncer, and a drop-in for :func:`support.mapfiles.write_map` that
    writes any of them as ``primary:`` through PgBouncer (``pooler: transaction``) with the
    database's own URL as ``direct:``. Patched into an existing suite's module, it runs that
    suite's own fixtures and tests through PgBouncer unchanged (the ``pgbouncer`` route of
    ``pg_route``)."""

    name = "pgbouncer"

    def __init__(self, pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer]) -> None:
        self._pg_databases = pg_databases
        self._pgbouncer = pgbouncer
        self.bouncer: PgBouncer | None = None
        self.pooled: dict[str, str] = {}
        """direct URL -> pooled URL."""

    def databases(self, n: int) -> list[str]:
        """``pg_databases(n)``, each also put behind the PgBouncer; returns the direct URLs."""
        urls = self._pg_databases(n)
        if self.bouncer is None:
            self.bouncer = self._pgbouncer(urls)
            pooled = self.bouncer.pooled_urls
        else:
            pooled = self.bouncer.add(urls)
        self.pooled.update(zip(urls, pooled, strict=True))
        return urls

    def write_map(self, directory: str | Path, servers: Mapping[str, str], *, filename: str = "map.yaml", **kwargs: Any) -> Path:
        data = map_dict(servers, **kwargs)
        for spec in data["servers"].values():
            direct = spec["primary"]
            if direct in self.pooled:
                spec.update(primary=self.pooled[direct], pooler="transaction", direct=direct)
        assert any(spec.get("pooler") == "transaction" for spec in data["servers"].values()), "no server of the map is behind PgBouncer"
        return _write(Path(directory) / filename, data)
