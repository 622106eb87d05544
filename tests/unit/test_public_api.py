"""What ``import mdb`` costs and gives (docs/reference.md): names loaded on first use, no optional plug-in (MongoDB is one)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest

import mdb
import mdb.ops


def _modules_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys; {code}; print(*sorted(sys.modules), sep=chr(10))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_import_mdb_loads_no_mongodb_module() -> None:
    assert [m for m in _modules_after("import mdb") if "mongo" in m] == []


def test_import_mdb_loads_none_of_its_names_until_used() -> None:
    loaded = _modules_after("import mdb")
    assert "mdb.store" not in loaded and "sqlalchemy" not in loaded
    assert "mdb.store" in _modules_after("from mdb import Store")


@pytest.mark.parametrize("namespace", [mdb, mdb.ops], ids=["mdb", "mdb.ops"])
def test_every_public_name_resolves_to_the_object_its_module_defines(namespace: ModuleType) -> None:
    assert sorted(namespace.__all__) == sorted(namespace._WHERE)
    for name, module in namespace._WHERE.items():
        assert getattr(namespace, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        getattr(namespace, "nothing_here")


def test_the_root_keeps_operator_tools_out_of_the_application_api() -> None:
    assert not set(mdb.__all__) & set(mdb.ops.__all__)
    assert "apply_map" not in mdb.__all__ and "EngineRegistry" not in mdb.__all__
