"""CENTRAL test maps, shared by the CENTRAL index, creation and repository suites."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml
from support.mapfiles import write_map
from mdb import Store
from mdb.demo.models import UserBriefcase
from mdb.schema import apply_schema

MODELS = ["mdb.demo.models", "mdb.demo.repositories"]


def make_map(tmp_path: Path, urls: list[str], write: Callable[..., Path] = write_map) -> Path:
    """central: 2 shards (so keys spread); user: one partition of the remaining servers. ``write``:
    support.mapfiles.write_map, or a ``pg_route``'s (through PgBouncer)."""
    names = [f"s{i}" for i in range(len(urls))]
    path = write(tmp_path, dict(zip(names, urls)), central=names[:2], partitions=[("0:0:0", names[2:])])
    data = yaml.safe_load(path.read_text())
    data["models"] = MODELS
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def open_store(path: Path) -> Store:
    store = Store.from_yaml(path, types=[UserBriefcase])
    assert all(r.ok for r in apply_schema(store))
    return store

