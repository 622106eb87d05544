"""SQLAlchemy column type for GDIDs.

A GDID is stored as its 12-byte form (BYTEA on PostgreSQL, BLOB on SQLite) because byte order
equals GDID order: a B-tree index on the column sorts exactly like the ids, range scans over a
partition are index range scans, and there is no sign or width trouble with 92-bit values.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import LargeBinary, event
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper
from sqlalchemy.types import TypeDecorator

from mdb.dialects import sql_dialect
from mdb.gdid import GDID

__all__ = ["GDIDType"]


class GDIDType(TypeDecorator[GDID]):
    """Stores a :class:`~mdb.GDID` as 12 bytes; accepts GDIDs or their text/hex forms on write."""

    impl = LargeBinary(12)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> bytes | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = GDID.parse(value)
        if not isinstance(value, GDID):
            raise TypeError(f"GDIDType column expects a GDID, got {type(value).__name__}: {value!r}")
        return bytes(value)

    def literal_processor(self, dialect: Dialect) -> Any:
        # LargeBinary's own literal rendering quotes the raw bytes as a text string, so a
        # statement compiled with literal_binds would silently compare against the wrong value.
        def process(value: Any) -> str:
            if value is None:
                return "NULL"
            gdid = GDID.parse(value) if isinstance(value, str) else value
            if not isinstance(gdid, GDID):
                raise TypeError(f"GDIDType column expects a GDID, got {type(value).__name__}: {value!r}")
            return sql_dialect(dialect).gdid_literal(gdid.hex)

        return process

    def process_result_value(self, value: Any, dialect: Dialect) -> GDID | None:
        if value is None:
            return None
        return GDID.from_bytes(value)

    @property
    def python_type(self) -> type[GDID]:
        return GDID


def parse_gdid_text(_target: Any, value: Any, _old: Any, _initiator: Any) -> Any:
    """Attribute ``set`` listener of every ORM attribute mapped to a GDIDType column.

    The column type parses text on the way to the database, but the attribute used to keep the
    string, so a row built with ``account_id="0:0:8"`` compared unequal to ``GDID(0, 0, 8)``
    everywhere in Python (the briefcase guard reported it as another briefcase's row, the
    identity map keyed it by the string). Parsing on assignment makes the attribute a GDID from
    the start; bad text raises :class:`~mdb.errors.GDIDError` (a ValueError) quoting it, right
    where it was assigned.
    """
    return GDID.parse(value) if isinstance(value, str) else value


@event.listens_for(Mapper, "after_mapper_constructed")
def _parse_text_on_assignment(mapper: Mapper[Any], class_: type[Any]) -> None:
    # ``mapper.columns`` (attribute name -> column) is filled at construction; ``column_attrs``
    # would configure every mapper of the registry now, before related classes exist.
    for key, column in mapper.columns.items():
        if isinstance(column.type, GDIDType):
            attribute = getattr(class_, key)
            if not event.contains(attribute, "set", parse_gdid_text):
                event.listen(attribute, "set", parse_gdid_text, retval=True)
