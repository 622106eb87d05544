"""Shared by test_moves_documents_cli and the suites beside it (moved out of test_moves_documents_cli, which used to be imported by other test modules)."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
import pytest
import yaml
from support.mapfiles import map_dict
from support.moves import run_cli
from mdb import Store
from mdb.mongo import MongoStore
from mdb.testing.mongo import FakeMongo
from mdb.registry import default_registry
from mdb.mongo.types import DOCUMENT_TYPES, DocumentBriefcaseType

SHARDS = ("m1", "m2", "m3")
MODELS = '''
from mdb.mongo import DocumentBriefcaseType, MongoIndex


class CliDocs(DocumentBriefcaseType):
    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = (MongoIndex("orders", [("user_id", 1), ("number", 1)], unique=True),)
'''


@pytest.fixture(autouse=True)
def forget_cli_docs() -> Iterator[None]:
    """Each :class:`Env` declares its own ``CliDocs``; unregistered after the test, so a later
    test's Store that takes every registered type does not find two types of area ``docs``."""
    before = set(default_registry.names(DOCUMENT_TYPES))
    yield
    for name in set(default_registry.names(DOCUMENT_TYPES)) - before:
        default_registry.remove(DOCUMENT_TYPES, name)


class Env:
    """A map with SQLite CENTRAL and three fake MongoDB servers kept in ``tmp/fake``; models beside the map.

    ``shards``: the servers of the area's one partition (the others are spares).
    """

    def __init__(self, tmp_path: Path, shards: tuple[str, ...] = SHARDS) -> None:
        self.fake_dir = tmp_path / "fake"
        module = f"cli_docmodels_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(MODELS, encoding="utf-8")
        sys.path.insert(0, str(tmp_path))
        try:
            self.dtype: type[DocumentBriefcaseType] = importlib.import_module(module).CliDocs
        finally:
            sys.path.remove(str(tmp_path))
        servers = {"c": f"sqlite:///{tmp_path / 'central.db'}", **{m: f"mongodb://fake-{m}/{m}" for m in SHARDS}}
        data = map_dict(servers, central=["c"], partitions=[("0:0:0", list(shards))], area="docs")
        data["models"] = [module]
        self.map_path = tmp_path / "map.yaml"
        self.map_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        self.env = {"MDB_MONGO_FAKE_DIR": str(self.fake_dir), "MDB_TEST_MONGO_URI": ""}

    def store(self) -> Store:
        """A fresh Store in this process on the same fake servers (it reads what the CLI wrote)."""
        store = Store.from_yaml(self.map_path, types=[])
        MongoStore.attach(store, client_factory=FakeMongo(path=self.fake_dir), types=[self.dtype])
        return store

    def cli(self, *args: str, fault: str | None = None) -> tuple[int, str, str]:
        """Run ``mdb ARGS`` (``MAP``: this map's path) in a process of its own: (exit code, stdout, stderr)."""
        env = dict(self.env)
        if fault is not None:
            env["MDB_FAULT_POINT"] = fault
        run = run_cli([str(self.map_path) if a == "MAP" else a for a in args], env=env)
        return run.returncode, run.stdout, run.stderr


