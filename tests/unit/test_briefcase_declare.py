"""Declaring briefcase types: invariant 1 is enforced when the class is created.

Every refusal names the type, the table and what is wrong. Valid test types are removed from
the process-wide registry afterwards, so Stores built with the default type list elsewhere in
the suite never see them.
"""

from __future__ import annotations

import types

import pytest
from sqlalchemy import ForeignKeyConstraint, Identity, Integer, Sequence, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdb.briefcase import BriefcaseType, registered_types, types_by_area
from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.registry import Registry
from mdb.sqltypes import GDIDType


REGISTRY = Registry()
"""This module's declarations: none of them reaches the default registry other modules' Stores read."""


class Base(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class Owner(Base):
    __tablename__ = "decl_owner"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(50))


class Pet(Base):
    __tablename__ = "decl_pet"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    pet_id: Mapped[GDID] = mapped_column(primary_key=True)
    __table_args__ = (ForeignKeyConstraint(["owner_id"], ["decl_owner.owner_id"]),)


class NoKey(Base):
    __tablename__ = "decl_nokey"
    thing_id: Mapped[GDID] = mapped_column(primary_key=True)


class TextKey(Base):
    __tablename__ = "decl_textkey"
    owner_id: Mapped[str] = mapped_column(String(20), primary_key=True)
    x_id: Mapped[GDID] = mapped_column(primary_key=True)


class AutoPk(Base):
    __tablename__ = "decl_autopk"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner_id: Mapped[GDID]


class WithIdentity(Base):
    __tablename__ = "decl_identity"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    row_id: Mapped[GDID] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, Identity())


class WithSequence(Base):
    __tablename__ = "decl_sequence"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    row_id: Mapped[GDID] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, Sequence("decl_seq"))


class WideRoot(Base):
    __tablename__ = "decl_wideroot"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    other_id: Mapped[GDID] = mapped_column(primary_key=True)


class Toy(Base):
    __tablename__ = "decl_toy"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    toy_id: Mapped[GDID] = mapped_column(primary_key=True)
    __table_args__ = (ForeignKeyConstraint(["owner_id"], ["decl_owner.owner_id"]),)


class Shop(Base):
    __tablename__ = "decl_shop"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)


def _new(name: str, body: dict[str, object]) -> type[BriefcaseType]:
    """``class name(BriefcaseType, registry=REGISTRY)`` with ``body``."""
    return types.new_class(name, (BriefcaseType,), {"registry": REGISTRY}, lambda ns: ns.update(body))


def _declare(children: tuple[type, ...], root: type = Owner, key: str = "owner_id", name: str = "T") -> type[BriefcaseType]:
    return _new(name, {"area": "decl", "key": key, "root": root, "children": children})


def test_valid_type_registers_with_tables_and_models() -> None:
    btype = _declare((Pet,), name="OwnerBriefcase")
    assert btype.models == (Owner, Pet)
    assert [t.name for t in btype.tables] == ["decl_owner", "decl_pet"]
    assert btype.key_column(Pet.__table__).name == "owner_id"
    assert btype in registered_types(REGISTRY)
    assert btype not in registered_types()  # the default registry: declared elsewhere


@pytest.mark.parametrize(
    ("child", "fragment"),
    [
        (NoKey, "table 'decl_nokey': missing the briefcase key column 'owner_id'"),
        (TextKey, "table 'decl_textkey': briefcase key column 'owner_id' must be a GDIDType column"),
        (AutoPk, "table 'decl_autopk': primary key column 'id' auto-increments"),
        (WithIdentity, "table 'decl_identity': column 'seq' auto-increments"),
        (WithSequence, "table 'decl_sequence': column 'seq' auto-increments"),
    ],
)
def test_bad_child_table_is_refused(child: type, fragment: str) -> None:
    before = registered_types(REGISTRY)
    with pytest.raises(SchemaError) as info:
        _declare((Pet, child), name="BadBriefcase")
    message = str(info.value)
    assert "briefcase type BadBriefcase" in message
    assert fragment in message
    assert registered_types(REGISTRY) == before  # a refused type is not registered


def test_root_primary_key_must_be_exactly_the_key() -> None:
    with pytest.raises(SchemaError, match=r"table 'decl_wideroot': the root table's primary key must be exactly the briefcase key 'owner_id'"):
        _declare((), root=WideRoot)


def test_non_gdid_primary_key_column_is_refused() -> None:
    class StrPk(Base):
        __tablename__ = "decl_strpk"
        owner_id: Mapped[GDID] = mapped_column(primary_key=True)
        code: Mapped[str] = mapped_column(String(10), primary_key=True)

    with pytest.raises(SchemaError, match=r"primary key column 'code' must be a GDIDType column"):
        _declare((StrPk,))


def test_missing_declaration_attribute_and_unmapped_class() -> None:
    with pytest.raises(SchemaError, match=r"briefcase type NoArea must set 'area'"):
        _new("NoArea", {"key": "owner_id", "root": Owner})
    with pytest.raises(SchemaError, match=r"is not a SQLAlchemy mapped class"):
        _declare((int,))


def test_table_listed_twice_is_refused() -> None:
    with pytest.raises(SchemaError, match=r"a table is listed twice"):
        _declare((Pet, Pet))


def test_area_with_two_briefcase_types() -> None:
    owners = _declare((Pet,), name="OwnerBriefcase")
    shops = _new("ShopBriefcase", {"area": "decl", "key": "owner_id", "root": Shop, "children": (Toy,)})
    grouped = types_by_area([owners, shops])
    assert grouped == {"decl": [owners, shops]}


def test_types_of_one_area_sharing_a_table_are_refused() -> None:
    first = _declare((Pet,), name="First")
    second = _declare((Toy, Pet), name="Second")
    with pytest.raises(SchemaError) as info:
        types_by_area([first, second])
    message = str(info.value)
    assert "First" in message and "Second" in message and "'decl'" in message
    assert "decl_owner" in message and "decl_pet" in message
    # In different areas the same tables are fine (each area has its own servers).
    other_area = _new("Elsewhere", {"area": "decl2", "key": "owner_id", "root": Owner, "children": (Pet,)})
    assert set(types_by_area([first, other_area])) == {"decl", "decl2"}


def test_types_of_one_area_must_share_their_root_id_sequence() -> None:
    """One GDID space per area: a second root sequence would re-issue the first one's ids."""
    owners = _declare((Pet,), name="OwnerBriefcase")
    assert owners.id_sequence == "ids"
    shops = _new("ShopBriefcase", {"area": "decl", "key": "owner_id", "root": Shop, "id_sequence": "shop_ids"})
    with pytest.raises(SchemaError, match=r"OwnerBriefcase and ShopBriefcase of area 'decl' draw root GDIDs from different sequences"):
        types_by_area([owners, shops])
    with pytest.raises(SchemaError, match=r"briefcase type Bad: invalid GDID sequence 'no/slash'"):
        _new("Bad", {"area": "decl", "key": "owner_id", "root": Shop, "id_sequence": "no/slash"})
