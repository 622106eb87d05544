"""CENTRAL index declarations, key normalizers and the index table.

An index maps a string key (an email) to the GDID of a briefcase. It is declared as a class so
that every process agrees on its name, its normalization and its uniqueness:

    class EmailIndex(CentralIndex):
        name = "user_email"
        area = "user"
        unique = True
        normalize = strip_casefold
        root_column = "email"

Normalization is always explicit (docs/design.md: never implicit): the normalized key is what is
stored, hashed for the CENTRAL shard (FNV-1a-64 of its UTF-8 bytes) and compared. The
``root_column`` names the column of the briefcase root that carries the key; it is the source
of truth the cache and ``mdb central check`` confirm entries against.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from types import FunctionType
from typing import Any, ClassVar, Final, NamedTuple

from sqlalchemy import Column, Float, Index, String, Table

from mdb.briefcase import BriefcaseType
from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.sqltypes import GDIDType
from mdb.system_tables import central_metadata
from mdb.registry import Kind, Registry, default_registry

__all__ = [
    "STATE_LIVE",
    "STATE_PENDING",
    "CentralIndex",
    "IndexRef",
    "IndexRow",
    "RootProbe",
    "casefold",
    "central_index",
    "exact",
    "index_by_name",
    "nfkc_strip_casefold",
    "registered_indexes",
    "strip",
    "strip_casefold",
]

MAX_KEY_LENGTH: Final = 512

STATE_PENDING: Final = "pending"
"""Reserved by a creation (or a rename) that has not finished; valid only if the root confirms it."""
STATE_LIVE: Final = "live"
"""Confirmed: the briefcase exists and carries the key."""

central_index = Table(
    "mdb_central_index",
    central_metadata,
    Column("index_name", String(63), primary_key=True),
    Column("key", String(MAX_KEY_LENGTH), primary_key=True),
    # GDID.ZERO for a unique index (so the primary key makes the key unique), the target GDID
    # for a non-unique one (so one key may point at many briefcases, each once).
    Column("slot", GDIDType, primary_key=True),
    Column("gdid", GDIDType, nullable=False),
    Column("state", String(8), nullable=False),
    # Epoch seconds by the writer's clock: only compared against a grace period of a minute or
    # so, which dwarfs ordinary clock skew (documented in docs/central.md).
    Column("created_at", Float, nullable=False),
    Index("ix_mdb_central_index_gdid", "index_name", "gdid"),
)


# -- normalizers: named so a declaration says exactly what it does -------------------------------


def exact(key: str) -> str:
    """No change: the key is compared byte for byte."""
    return key


def strip(key: str) -> str:
    """Surrounding whitespace removed."""
    return key.strip()


def casefold(key: str) -> str:
    """Unicode case folding (``"Straße"`` and ``"STRASSE"`` are one key)."""
    return key.casefold()


def strip_casefold(key: str) -> str:
    """Whitespace stripped, then case folded: the usual choice for emails."""
    return key.strip().casefold()


def nfkc_strip_casefold(key: str) -> str:
    """NFKC compatibility normalization, strip, casefold: for user-typed names and handles."""
    return unicodedata.normalize("NFKC", key).strip().casefold()


class CentralIndex:
    """Declare an index by subclassing; validation runs at class creation."""

    name: ClassVar[str]
    area: ClassVar[str]
    unique: ClassVar[bool] = True
    normalize: ClassVar[Callable[[str], str]]
    briefcase: ClassVar[type[BriefcaseType] | None] = None
    """The briefcase type the keys point at; optional when the area holds one type."""
    root_column: ClassVar[str | None] = None
    """Root column that carries the key (compared after ``normalize``); None: existence only."""

    def __init_subclass__(cls, registry: Registry | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        label = cls.__name__
        for attr in ("name", "area", "normalize"):
            if not hasattr(cls, attr):
                raise SchemaError(
                    f"CENTRAL index {label} must set {attr!r}"
                    + (" (normalization is explicit: e.g. normalize = strip_casefold, or exact)" if attr == "normalize" else "")
                )
        fn = cls.__dict__.get("normalize")
        if isinstance(fn, FunctionType):
            cls.normalize = staticmethod(fn)
        if not callable(cls.normalize):
            raise SchemaError(f"CENTRAL index {label}: normalize must be a function str -> str")
        if not isinstance(cls.name, str) or not cls.name or len(cls.name) > 63:
            raise SchemaError(f"CENTRAL index {label}: name must be a non-empty string of at most 63 characters")
        if cls.briefcase is not None:
            if cls.briefcase.area != cls.area:
                raise SchemaError(
                    f"CENTRAL index {label}: area {cls.area!r} differs from briefcase type "
                    f"{cls.briefcase.__name__}'s area {cls.briefcase.area!r}"
                )
            root_table = cls.briefcase.tables[0]
            if cls.root_column is not None and cls.root_column not in root_table.c:
                raise SchemaError(
                    f"CENTRAL index {label}: root_column {cls.root_column!r} is not a column of "
                    f"{cls.briefcase.__name__}'s root table {root_table.name!r}"
                )
        (registry or default_registry).add(CENTRAL_INDEXES, cls.name, cls, clash=_declared_twice)

    @classmethod
    def key_of(cls, key: str) -> str:
        """The normalized key, refusing what cannot be stored."""
        if not isinstance(key, str):
            raise ValueError(f"CENTRAL index {cls.name!r}: a key must be a str, got {type(key).__name__}: {key!r}")
        normalized = cls.normalize(key)
        if not normalized:
            raise ValueError(f"CENTRAL index {cls.name!r}: key {key!r} is empty after normalization")
        if len(normalized) > MAX_KEY_LENGTH:
            raise ValueError(
                f"CENTRAL index {cls.name!r}: key {key[:40]!r}... is {len(normalized)} characters long "
                f"(at most {MAX_KEY_LENGTH})"
            )
        return normalized

    @classmethod
    def slot(cls, gdid: GDID) -> GDID:
        return GDID.ZERO if cls.unique else gdid


CENTRAL_INDEXES: Kind[type[CentralIndex]] = Kind("CENTRAL index")


def _declared_twice(old: type[CentralIndex], new: type[CentralIndex]) -> str | None:
    """One index name, two classes: refused (the same class declared again, a module re-imported, is not)."""
    if (old.__module__, old.__qualname__) == (new.__module__, new.__qualname__):
        return None
    return (f"CENTRAL index name {new.name!r} is declared twice: {old.__module__}.{old.__qualname__} "
            f"and {new.__module__}.{new.__qualname__}")


def registered_indexes(registry: Registry | None = None) -> list[type[CentralIndex]]:
    """Every index declared so far in ``registry`` (the default one)."""
    return (registry or default_registry).items(CENTRAL_INDEXES)


def index_by_name(name: str, registry: Registry | None = None) -> type[CentralIndex]:
    reg = registry or default_registry
    found = reg.get(CENTRAL_INDEXES, name)
    if found is None:
        known = ", ".join(sorted(reg.names(CENTRAL_INDEXES))) or "none"
        raise SchemaError(
            f"unknown CENTRAL index {name!r} (declared: {known}); import the module that declares it "
            "(the map's models: list or --models)"
        )
    return found


# -- entries: one row of mdb_central_index, as the service and its creation protocol pass it around --

IndexRef = type[CentralIndex] | str


class IndexRow(NamedTuple):
    index_name: str
    key: str
    slot: GDID
    gdid: GDID
    state: str
    created_at: float


class RootProbe(NamedTuple):
    exists: bool
    key: str | None
    """The root column's value after the index's normalization (None without a root column)."""
