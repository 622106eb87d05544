"""ORM objects built from rows of their columns, detached: what a Session that loaded them and closed leaves.

Why (issue 34): an ORM fan-out top-N over S shards reads up to N rows per shard and keeps N.
Loading every shard's rows through a Session of its own built S x N objects, where the merge
needs the N it returns and the S stream heads it compares. With this, a shard's rows stay
column values until the merge asks for one (:mod:`mdb.fanout`).

Only SQLAlchemy's public instance API is used: ``new_instance`` (no ``__init__``, as a load),
``set_committed_value`` (no history, no attribute events) and ``make_transient_to_detached``
(the identity key from the primary key; every attribute not set is expired, so a relationship
raises ``DetachedInstanceError`` on access, as on an object whose Session closed). A mapper
whose load is more than its columns (a ``load`` or ``refresh`` listener, a ``@reconstructor``)
gets no loader: those fan-outs load through a Session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Column
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import ColumnProperty, Mapper, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.exc import UnmappedColumnError

__all__ = ["DetachedLoader"]


class DetachedLoader:
    """Builds detached instances of one mapper from tuples of its column values, in a fixed order."""

    __slots__ = ("mapper", "keys")

    def __init__(self, mapper: Mapper[Any], keys: list[str]) -> None:
        self.mapper = mapper
        self.keys = keys

    @classmethod
    def of(cls, entity: Any, columns: Sequence[Sequence[Any]]) -> DetachedLoader | None:
        """A loader of ``entity`` for rows whose i-th value belongs to ``columns[i]`` (the objects a
        compiled result column stands for); None when a row of them is not simply an instance:
        load events, a value that is no column attribute of the mapper, a primary key not read."""
        info = sa_inspect(entity)
        if not isinstance(info, Mapper):  # an aliased class: its columns are the alias's
            return None
        manager = info.class_manager
        if manager.dispatch.load or manager.dispatch.refresh:
            return None
        keys: list[str] = []
        for objects in columns:
            prop = None
            for candidate in objects:
                if isinstance(candidate, Column):
                    try:
                        prop = info.get_property_by_column(candidate)
                    except UnmappedColumnError:
                        return None
                    break
            if not isinstance(prop, ColumnProperty) or prop.key in keys:
                return None
            keys.append(prop.key)
        if not {info.get_property_by_column(c).key for c in info.primary_key} <= set(keys):
            return None
        return cls(info, keys)

    def __call__(self, values: Sequence[Any]) -> Any:
        instance = self.mapper.class_manager.new_instance()
        for key, value in zip(self.keys, values):
            set_committed_value(instance, key, value)
        make_transient_to_detached(instance)
        return instance
