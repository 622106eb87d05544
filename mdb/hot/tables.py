"""Table factories of the hot-data patterns, for CENTRAL and for briefcases.

Each pattern's tables come in two shapes built by one factory:

- **briefcase** (``key_column="user_id"``): the tables carry the briefcase key and their
  primary key is ``(key, <row id>)`` with GDID columns only, as ``mdb.briefcase`` demands, so
  an application lists the mapped classes (``*_models``) in its BriefcaseType's ``children``
  and ``mdb move`` carries the rows with the briefcase;
- **CENTRAL** (``key_column=None``): the same tables without the key, on ``central_metadata``
  (built-in ones below, created by ``mdb schema apply``); rows live on the CENTRAL shard that
  ``router.locate_central(<counter id | stream key>)`` names.

Row ids that are not application GDIDs (a counter slot, a snapshot, a lock record) are
*derived* GDIDs (:func:`derived_gdid`): a hash of the row's natural key, so the primary key
stays a GDID, nothing auto-increments and a row keeps its id when its briefcase moves. The
natural key also has a unique constraint. Two unique indexes mean a conflict clause with a
target covers only one of them; see :mod:`mdb.hot.counters` (slot rows are created with K
and increments only UPDATE them) and the target-less ``DO NOTHING`` of
:func:`mdb.hot.scope.insert_once`, which also turns a derived-id clash (the id already held
by a row with another natural key) into an error instead of "already there".

Names that become parts of a derived id (counter ids, streams, event ids, states,
calculations) are checked by :func:`check_name`: no control characters, so the separator of
the hash input can never occur inside a part and the derivation is injective.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    func,
    text,
)

from mdb.errors import SchemaError, StatsError
from mdb.gdid import GDID
from mdb.sqltypes import GDIDType

__all__ = [
    "DERIVED_AUTHORITY",
    "CounterTables",
    "EventLogTables",
    "StatsLockTables",
    "check_name",
    "counter_models",
    "counter_tables",
    "derived_gdid",
    "event_log_models",
    "event_log_tables",
    "stats_lock_models",
    "stats_lock_tables",
]

DERIVED_AUTHORITY = 15
"""Authority nibble of derived GDIDs: tells them apart from generated ones (never zero)."""

NAME_LENGTH = 200
"""Longest counter id, stream or event id."""
LABEL_LENGTH = 64
"""Longest state, calculation or event kind."""


ID_SEPARATOR = "\x1f"
"""Joins the parts of a derived id's hash input (ASCII unit separator)."""


def derived_gdid(*parts: str | int) -> GDID:
    """A GDID that is a 92-bit hash of ``parts`` (era = 32 bits, counter = 60 bits).

    The hash input is the parts joined with :data:`ID_SEPARATOR`. Joining is injective only
    while no part contains the separator: ``("a\\x1fb", "c")`` and ``("a", "b\\x1fc")`` would
    be one input, one id, and the second key's row would be taken for the first's. So a part
    holding the separator is refused (the operations refuse every control character earlier,
    naming the argument: :func:`check_name`). Refusing rather than re-encoding keeps the ids
    of all existing rows: for the parts accepted, the input is the same bytes as before.
    """
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise StatsError(f"derived id: parts must be strings or integers, got {type(part).__name__} {part!r}")
        if isinstance(part, str) and ID_SEPARATOR in part:
            raise StatsError(f"derived id: part {part!r} contains the separator U+001F (two keys would share one id)")
    digest = hashlib.blake2b(ID_SEPARATOR.join(str(p) for p in parts).encode("utf-8"), digest_size=12).digest()
    era = int.from_bytes(digest[:4], "big")
    counter = int.from_bytes(digest[4:], "big") & ((1 << 60) - 1)
    return GDID(era, DERIVED_AUTHORITY, counter)


def check_name(what: str, value: object, limit: int, *, write: bool = True) -> str:
    """``value`` if it can name a hot-data row (counter id, stream, event id, state, ...), else a
    StatsError naming ``what``.

    A name must be a non-empty string of at most ``limit`` characters. Writes refuse control
    characters: the unit separator would make two keys share one derived id, a NUL cannot be
    stored in PostgreSQL text at all, and none belongs in an identifier. Reads
    (``write=False``) refuse only what no database can hold (NUL, lone surrogates), so rows
    written before this check, whose names may hold other control characters, stay readable.
    """
    if not isinstance(value, str):
        raise StatsError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if not value or len(value) > limit:
        raise StatsError(f"{what} must be 1..{limit} characters, got {len(value)}: {value[:60]!r}")
    for char in value:
        category = unicodedata.category(char)
        if category == "Cs":
            raise StatsError(f"{what} {value[:60]!r} contains an unpaired surrogate (U+{ord(char):04X}): not encodable")
        if char == "\x00" or (write and category == "Cc"):
            raise StatsError(f"{what} {value[:60]!r} contains the control character {char!r} (U+{ord(char):04X})")
    return value


def _key_columns(key_column: str | None, id_column: str) -> list[Column[Any]]:
    cols: list[Column[Any]] = []
    if key_column is not None:
        cols.append(Column(key_column, GDIDType, nullable=False))
    cols.append(Column(id_column, GDIDType, nullable=False))
    return cols


def _pk(name: str, key_column: str | None, id_column: str) -> PrimaryKeyConstraint:
    return PrimaryKeyConstraint(*([key_column] if key_column else []), id_column, name=f"pk_{name}")


def _natural(key_column: str | None, *columns: str) -> list[str]:
    return [*([key_column] if key_column else []), *columns]


def _check_name(what: str, name: str) -> None:
    if not name.isidentifier() or len(name) > 50:
        raise SchemaError(f"{what} table name {name!r} must be an identifier of at most 50 characters")


# -- logically sharded counters -------------------------------------------------------------------


@dataclass(frozen=True)
class CounterTables:
    """A counter family: slot rows (one value column per named value) and the per-counter K."""

    rows: Table
    config: Table
    values: tuple[str, ...]
    key_column: str | None

    @property
    def tables(self) -> tuple[Table, Table]:
        return (self.rows, self.config)


def counter_tables(
    metadata: MetaData, name: str, values: Sequence[str] = ("value",), *, key_column: str | None = None
) -> CounterTables:
    """Tables ``{name}`` (slot rows) and ``{name}_config`` (K per counter) on ``metadata``."""
    _check_name("counter", name)
    values = tuple(values)
    if not values or len(set(values)) != len(values):
        raise SchemaError(f"counter table {name!r}: values must be distinct names, got {list(values)}")
    reserved = {"row_id", "counter", "slot", key_column}
    bad = [v for v in values if v in reserved or not v.isidentifier()]
    if bad:
        raise SchemaError(f"counter table {name!r}: value names {bad} are reserved or not identifiers")
    rows = Table(
        name,
        metadata,
        *_key_columns(key_column, "row_id"),
        Column("counter", String(NAME_LENGTH), nullable=False),
        Column("slot", Integer, nullable=False),
        *(Column(v, BigInteger, nullable=False, server_default=text("0")) for v in values),
        _pk(name, key_column, "row_id"),
        UniqueConstraint(*_natural(key_column, "counter", "slot"), name=f"uq_{name}_slot"),
    )
    config = Table(
        f"{name}_config",
        metadata,
        *_key_columns(key_column, "config_id"),
        Column("counter", String(NAME_LENGTH), nullable=False),
        Column("slots", Integer, nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
        _pk(f"{name}_config", key_column, "config_id"),
        UniqueConstraint(*_natural(key_column, "counter"), name=f"uq_{name}_config_counter"),
    )
    return CounterTables(rows, config, values, key_column)


# -- stats lock -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatsLockTables:
    """One row per (event id, state, calculation) that has been applied."""

    locks: Table
    key_column: str | None

    @property
    def tables(self) -> tuple[Table]:
        return (self.locks,)


def stats_lock_tables(metadata: MetaData, name: str = "stats_lock", *, key_column: str | None = None) -> StatsLockTables:
    _check_name("stats lock", name)
    locks = Table(
        name,
        metadata,
        *_key_columns(key_column, "lock_id"),
        Column("event_id", String(NAME_LENGTH), nullable=False),
        Column("state", String(LABEL_LENGTH), nullable=False),
        Column("calculation", String(LABEL_LENGTH), nullable=False),
        Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
        _pk(name, key_column, "lock_id"),
        UniqueConstraint(*_natural(key_column, "event_id", "state", "calculation"), name=f"uq_{name}_record"),
    )
    return StatsLockTables(locks, key_column)


# -- event log + snapshots ------------------------------------------------------------------------


@dataclass(frozen=True)
class EventLogTables:
    """Append-only events (with the fold marker ``snapshot_seq``) and their incremental snapshots."""

    events: Table
    snapshots: Table
    key_column: str | None

    @property
    def tables(self) -> tuple[Table, Table]:
        return (self.events, self.snapshots)


def event_log_tables(metadata: MetaData, name: str = "event_log", *, key_column: str | None = None) -> EventLogTables:
    """Tables ``{name}`` (events) and ``{name}_snapshots`` on ``metadata``."""
    _check_name("event log", name)
    stream_cols = _natural(key_column, "stream")
    events = Table(
        name,
        metadata,
        *_key_columns(key_column, "event_id"),
        Column("stream", String(NAME_LENGTH), nullable=False),
        Column("kind", String(LABEL_LENGTH), nullable=False),
        Column("payload", JSON, nullable=False),
        Column("appended_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
        # NULL until a snapshot job folds the event into snapshot number ``snapshot_seq``: the
        # only column of an event that is ever written after its append.
        Column("snapshot_seq", BigInteger, nullable=True),
        _pk(name, key_column, "event_id"),
        Index(f"ix_{name}_fold", *stream_cols, "snapshot_seq"),
    )
    snapshots = Table(
        f"{name}_snapshots",
        metadata,
        *_key_columns(key_column, "snapshot_id"),
        Column("stream", String(NAME_LENGTH), nullable=False),
        # 0 is the stream's head row: the initial state, and the row snapshot jobs lock to
        # serialize on the stream; 1, 2, ... are the incremental snapshots.
        Column("seq", BigInteger, nullable=False),
        Column("state", JSON, nullable=False),
        Column("events", BigInteger, nullable=False),
        Column("total_events", BigInteger, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
        _pk(f"{name}_snapshots", key_column, "snapshot_id"),
        UniqueConstraint(*stream_cols, "seq", name=f"uq_{name}_snapshots_seq"),
    )
    return EventLogTables(events, snapshots, key_column)


# -- mapped classes for briefcase types -----------------------------------------------------------


def _map(base: type[Any], table: Table) -> type[Any]:
    class_name = "".join(part.capitalize() for part in table.name.split("_"))
    return type(class_name, (base,), {"__table__": table})


def counter_models(base: type[Any], name: str, values: Sequence[str], *, key_column: str) -> tuple[CounterTables, tuple[type[Any], ...]]:
    """(tables, mapped classes) of a counter family inside a briefcase; list the classes in ``children``."""
    tables = counter_tables(base.metadata, name, values, key_column=key_column)
    return tables, tuple(_map(base, t) for t in tables.tables)


def stats_lock_models(base: type[Any], name: str = "stats_lock", *, key_column: str) -> tuple[StatsLockTables, tuple[type[Any], ...]]:
    tables = stats_lock_tables(base.metadata, name, key_column=key_column)
    return tables, tuple(_map(base, t) for t in tables.tables)


def event_log_models(base: type[Any], name: str = "event_log", *, key_column: str) -> tuple[EventLogTables, tuple[type[Any], ...]]:
    tables = event_log_tables(base.metadata, name, key_column=key_column)
    return tables, tuple(_map(base, t) for t in tables.tables)
