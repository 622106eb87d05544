"""Registries (mdb.registry): declarations reach only the Store they are handed to.

Before registries, every declaration filled a module global, so a type one test module declared
was taken by another module's Store (commit 6738626 fixed one such leak by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from support.mapfiles import write_map
from mdb import GDID, Store
from mdb.briefcase import BriefcaseType, registered_types
from mdb.central import CentralIndex, exact
from mdb.central.indexes import index_by_name, registered_indexes
from mdb.errors import SchemaError
from mdb.registry import Kind, Registry, default_registry
from mdb.sqltypes import GDIDType


class Base(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class Gadget(Base):
    __tablename__ = "reg_gadget"
    gadget_id: Mapped[GDID] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(40))


APP_A = Registry()
APP_B = Registry()


class GadgetBriefcase(BriefcaseType, registry=APP_A):
    area = "user"
    key = "gadget_id"
    root = Gadget


class GadgetLabel(CentralIndex, registry=APP_A):
    name = "reg_gadget_label"
    area = "user"
    normalize = exact
    briefcase = GadgetBriefcase


def test_a_declaration_joins_only_the_registry_it_names() -> None:
    assert registered_types(APP_A) == [GadgetBriefcase]
    assert GadgetBriefcase not in registered_types()  # the default registry
    assert registered_types(APP_B) == []
    assert registered_indexes(APP_A) == [GadgetLabel]
    assert index_by_name("reg_gadget_label", APP_A) is GadgetLabel
    with pytest.raises(SchemaError, match="unknown CENTRAL index 'reg_gadget_label'"):
        index_by_name("reg_gadget_label")


def test_a_store_serves_the_registry_it_is_given(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    urls = tmp_sqlite_urls(2)
    path = write_map(tmp_path, {"c": urls[0], "s": urls[1]}, central=["c"], partitions=[("0:0:0", ["s"])])
    with Store.from_yaml(path, registry=APP_A) as a, Store.from_yaml(path, registry=APP_B) as b:
        assert a.types_of("user") == [GadgetBriefcase]
        assert b.types_of("user") == []
        assert a.central.index("reg_gadget_label") is GadgetLabel
        with pytest.raises(SchemaError, match="unknown CENTRAL index"):
            b.central.index("reg_gadget_label")
    with Store.from_yaml(path) as default:
        assert default.registry is default_registry
        assert GadgetBriefcase not in default.types


def test_one_index_name_twice_in_one_registry_is_refused_but_not_across_registries() -> None:
    with pytest.raises(SchemaError, match="CENTRAL index name 'reg_gadget_label' is declared twice"):
        class Again(CentralIndex, registry=APP_A):  # noqa: F841
            name = "reg_gadget_label"
            area = "user"
            normalize = exact

    class Elsewhere(CentralIndex, registry=APP_B):
        name = "reg_gadget_label"
        area = "user"
        normalize = exact

    assert index_by_name("reg_gadget_label", APP_B) is Elsewhere
    assert index_by_name("reg_gadget_label", APP_A) is GadgetLabel
    assert registered_indexes(APP_A) == [GadgetLabel]  # the refused one did not land


def test_kinds_are_separate_keys_and_keep_declaration_order() -> None:
    reg = Registry()
    first: Kind[int] = Kind("first")
    second: Kind[int] = Kind("second")
    reg.add(first, "b", 2)
    reg.add(first, "a", 1)
    reg.add(second, "a", 10)
    assert reg.items(first) == [2, 1] and reg.names(first) == ["b", "a"]
    assert reg.get(second, "a") == 10 and reg.get(second, "b") is None
    reg.remove(first, "b")
    assert reg.items(first) == [1]
