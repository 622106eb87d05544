"""Maps and Stores behind a transaction-mode PgBouncer, for the tests/test_pgbouncer_*.py suites.

Every server of such a map is the same database twice: ``primary:`` through PgBouncer with
``pooler: transaction`` (what the application uses) and ``direct:`` beside it (what the tools
use, see docs/operations.md "Behind PgBouncer").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from mapfiles import PartitionList, map_dict

from mdb.testing.pgbouncer import PgBouncer

__all__ = ["pooled_servers", "tools_store", "write_pooled_map"]


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
    """:func:`mapfiles.write_map`, every server marked ``pooler: transaction`` with its ``direct:`` URL."""
    data = map_dict(pooled, central=central, partitions=partitions, version=version, **kwargs)
    for name, spec in data["servers"].items():
        spec["pooler"] = "transaction"
        spec["direct"] = direct[name]
    path = Path(directory) / filename
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
