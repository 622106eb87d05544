"""The ownership check every briefcase session runs on its shard (docs/design.md invariant 2).

A process routes with the map and relocations it has cached; that cache may be stale. So the
session asks the shard itself, inside the session's own transaction: "is this briefcase still
here?" (no fence, no unfinished incoming copy) and "do you own it under the layout I routed
with?" (area, partition start and end, shard index, shard count). On PostgreSQL the check is a
prelude sent with BEGIN in one simple-protocol string (:class:`Prelude`, which the engine's BEGIN
runs through the typed hook :class:`mdb.engines.BeginPrelude`), as ``EXECUTE`` of
statements prepared once per pooled connection (:data:`PG_PREPARED`), after a shared
advisory lock on the briefcase, so a move's exclusive lock makes new sessions wait and the
check, a later statement with a fresh snapshot, then sees the fence the move committed. Behind
a transaction-pooling pooler (``pooler: transaction``) nothing prepared survives a transaction,
so the same check is a call of a PL/pgSQL function instead (:data:`PG_FUNCTIONS`).

Write sessions also take a SHARED advisory lock on their partition (:func:`partition_lock_key_sql`)
and read the partition's freeze marker (a state row ``frozen`` under the zero GDID, which is
never a briefcase): a reshard's final phase takes that key EXCLUSIVE on each old shard, which
waits for in-flight writers, and commits the marker, which turns new writers away with a
retryable :class:`BriefcaseMovingError` until the new map is in place (see docs/moves.md).
Read-only sessions ignore the marker: reads cannot strand a briefcase.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import Connection

from mdb.engines import KnownRows, PreparedNames, Rows, simple_query
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.gdid import GDID
from mdb.router import Placement
from mdb.system_tables import (
    CHECK_VERSION_TABLE, STATE_FROZEN, STATE_GONE, STATE_INCOMING, STATE_RESIDENT, briefcase_state, shard_layout,
)

__all__ = [
    "FREEZE_GDID", "KEPT_CHECKS", "OwnershipCheck", "Prelude", "check_ownership", "confirming_row", "freeze_holder", "freeze_mark", "frozen_for",
    "check_helpers_missing", "install_pg_functions", "install_sqlite_check_version", "lock_key_sql", "lock_keys_sql", "ownership_prelude", "partition_lock_key_sql",
]

FREEZE_GDID = GDID(0, 0, 0)
"""The state-row key of a partition freeze marker: the zero GDID is never a briefcase."""

_STAYS = "@"
"""Separates a freeze marker's reshard id from the new layout's slot of its server (see :func:`freeze_mark`)."""


def freeze_mark(reshard_id: str, new_shards: Iterable[str] | None, server: str) -> str:
    """What a reshard's freeze marker on ``server`` records: its id and, with ``new_shards``, which briefcases stay.

    ``reshard-…@3:0``: under the new list of 3 shards this server is slot 0, so a write session
    of a briefcase with ``v mod 3 == 0`` goes on (the briefcase is where the new map puts it, so
    neither writing nor creating it here can strand it); every other write of the partition
    waits, as under a marker without the suffix (``@3:-1``: the server leaves the partition).
    The freeze then pauses only the writes of briefcases that still have to move (stragglers),
    not the whole partition (issue 31: a reshard's end stalled every writer for the final
    sweep and the map apply, 0.6 s at 100k briefcases, growing with N).
    """
    if new_shards is None:
        return reshard_id
    shards = list(new_shards)
    return f"{reshard_id}{_STAYS}{len(shards)}:{shards.index(server) if server in shards else -1}"


APPLYING_PREFIX: Final = "map-apply-"
"""The holder prefix of a plain map apply's markers (:func:`applying_mark`)."""


def applying_mark(version: int) -> str:
    """The marker ``mdb map apply`` puts on each shard whose stamp it changes, until it has published the map.

    Slot 0 of 1: it turns no write session away (every ``v mod 1`` is 0), but like a reshard's
    freeze marker it tells a session that meets a stamp other than its map's that a map is
    being applied: a bounded wait with a map re-read, not a StaleRouteError (issue 31).
    """
    return f"{APPLYING_PREFIX}v{version}{_STAYS}1:0"


def freeze_holder(mark: str) -> str:
    """The reshard id of a freeze marker's value (:func:`freeze_mark`)."""
    return mark.partition(_STAYS)[0]


def frozen_for(mark: str, gdid: GDID) -> bool:
    """Whether a freeze marker on a server turns away write sessions of ``gdid`` (see :func:`freeze_mark`)."""
    _, sep, slot = mark.partition(_STAYS)
    if not sep:
        return True  # the whole partition (a marker of an older mdb)
    count, _, index = slot.partition(":")
    return gdid.sharding_value % int(count) != int(index)


@dataclass(frozen=True)
class Prelude:
    """The ownership check's statements, run right after BEGIN in the same round trip.

    A :class:`mdb.engines.BeginPrelude`: the engine's BEGIN calls the method of its kind. On
    PostgreSQL it sends BEGIN and the statements as ONE parameterless multi-statement string,
    which psycopg sends with the simple query protocol: one round trip.

    ``prepare`` maps the names of server-side prepared statements the statements ``EXECUTE``
    to their definitions, ``(argument types) AS query`` (PostgreSQL only). They are prepared
    once per pooled connection, on first use and outside any transaction, so a session pays
    for parsing and planning the check once per connection instead of once per BEGIN.
    """

    statements: tuple[str, ...]
    prepare: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    """Named parameters of the statements (SQLite only: a PostgreSQL prelude travels as one
    simple-protocol string, which takes none, so its values are inlined)."""
    unprepared: tuple[str, ...] = ()
    """The same with no prepared statement behind them (PostgreSQL): what an engine behind a
    transaction-pooling pooler sends, where nothing prepared outlives a transaction."""
    begin: str = "BEGIN"
    """How the transaction starts on PostgreSQL (a readonly session's takes one snapshot: see
    :func:`ownership_prelude`)."""

    @property
    def read_only(self) -> bool:
        """Its BEGIN makes the transaction unable to write (:attr:`mdb.engines.BeginPrelude.read_only`)."""
        return self.begin.endswith(" READ ONLY")

    def begin_postgresql(self, connection: psycopg.Connection[Any], prepared: PreparedNames) -> Rows | None:
        """BEGIN and the ``EXECUTE`` statements, after preparing what this connection lacks."""
        return _begin_prepared(connection, prepared, self.prepare, "; ".join([self.begin, *self.statements]))

    def begin_postgresql_pooled(self, connection: psycopg.Connection[Any]) -> Rows | None:
        """BEGIN and the unprepared form (the check as a call of its PL/pgSQL function)."""
        return simple_query(connection, "; ".join([self.begin, *(self.unprepared or self.statements)]))

    def begin_sqlite(self, cursor: sqlite3.Cursor, begin: str, known: KnownRows) -> Rows | None:
        """``begin``, then the check with its named parameters (sqlite3 caches the text), as :class:`OwnershipCheck`."""
        (statement,) = self.statements  # one statement on SQLite (ownership_prelude)
        return _sqlite_rows(cursor, begin, statement, self.params, known, (statement, *self.params.values()))


def _begin_prepared(connection: psycopg.Connection[Any], prepared: PreparedNames, prepare: Mapping[str, str],
                    sql: str) -> Rows | None:
    """``sql`` (BEGIN and ``EXECUTE`` statements) in one round trip, after preparing what the connection lacks."""
    known = prepared.known
    if known is None or not known.issuperset(prepare):
        _pg_prepare(connection, prepared, prepare)
    try:
        return simple_query(connection, sql, prepared)
    except psycopg.errors.InvalidSqlStatementName:
        # Our statements were dropped behind our back. psycopg itself does it: a ROLLBACK
        # on a connection where it auto-prepared statements sends DEALLOCATE ALL. So do
        # DISCARD ALL and a pooler that swaps server sessions. Prepare them again, once.
        simple_query(connection, "ROLLBACK")
        prepared.known = None
        _pg_prepare(connection, prepared, prepare)
        return simple_query(connection, sql, prepared)


def _pg_prepare(connection: psycopg.Connection[Any], prepared: PreparedNames, prepare: Mapping[str, str]) -> None:
    """Prepare the statements this connection lacks, in one round trip before BEGIN.

    PREPARE is not transactional: of several in one string, those before a failure stay. So
    after a failure, or when statements went missing, the next call first asks the server
    which ones exist instead of trusting the record.
    """
    known = prepared.known
    if not prepare:
        return
    try:
        if known is None:
            names = ", ".join(f"'{name}'" for name in prepare)  # our own names: [a-z_] only
            rows = simple_query(connection, f"SELECT name FROM pg_prepared_statements WHERE name IN ({names})") or []
            known = {str(name) for (name,) in rows}
        missing = [name for name in prepare if name not in known]
        if missing:
            simple_query(connection, "; ".join(f"PREPARE {name} {prepare[name]}" for name in missing))
            known.update(missing)
    except BaseException:
        prepared.known = None
        raise
    prepared.known = known


def _pg_bytea(gdid: GDID) -> str:
    return f"'\\x{gdid.hex}'::bytea"


def _lock_key(area: str, gdid: GDID) -> str:
    return f"{area}:{gdid.hex}"


def _partition_lock_key(area: str, partition_start: GDID) -> str:
    # ``#`` cannot occur in an area name, so this never equals a briefcase key's text.
    return f"{area}#partition:{partition_start.hex}"


def lock_key_sql(area: str, gdid: GDID) -> str:
    """SQL for the briefcase's advisory lock key (PostgreSQL); moves lock the same key.

    Area names are restricted by the map to a safe alphabet, so inlining them is safe.
    """
    return f"hashtextextended('{_lock_key(area, gdid)}', 0)"


def lock_keys_sql(area: str, gdids: Iterable[GDID]) -> str:
    """SQL for an array of the briefcases' advisory lock keys, in a fixed order (a batched cutover locks them all).

    Sorted by GDID, so two lockers of overlapping sets take the keys in the same order.
    """
    return "ARRAY[" + ", ".join(lock_key_sql(area, g) for g in sorted(set(gdids))) + "]::bigint[]"


def partition_lock_key_sql(area: str, partition_start: GDID) -> str:
    """SQL for a partition's advisory lock key (PostgreSQL); a reshard's freeze locks it EXCLUSIVE."""
    return f"hashtextextended('{_partition_lock_key(area, partition_start)}', 0)"


def _check_sql(area: str, gdid: str, frozen_peer: str | None, freeze_gdid: str, cast: str = "") -> str:
    """The check query; the arguments are SQL (literals, ``$n`` parameters or variables).

    ``frozen_peer`` is None for read sessions: they are never refused for a freeze, but read
    whether the area is frozen on the server (any partition: one reshard per area at a time),
    so that a stamp newer than their map while a reshard applies its map is a wait, not a stale
    route (``cast``: of that column, for a PL/pgSQL result type).
    """
    frozen = (
        f"(SELECT f.move_id FROM mdb_briefcase_state AS f WHERE f.area = {area} AND f.gdid = {freeze_gdid} "
        f"AND f.state = '{STATE_FROZEN}' LIMIT 1){cast}"
    )
    freeze_join = ""
    if frozen_peer is not None:
        frozen = "f.move_id"
        freeze_join = (
            f" LEFT JOIN mdb_briefcase_state AS f ON f.area = {area} AND f.gdid = {freeze_gdid} "
            f"AND f.state = '{STATE_FROZEN}' AND f.peer = {frozen_peer}"
        )
    return (
        f"SELECT l.partition_start, l.partition_end, l.shard_index, l.shard_count, s.state, s.peer, {frozen} "
        "FROM (SELECT 1 AS one) AS x "
        f"LEFT JOIN mdb_shard_layout AS l ON l.area = {area} "
        f"LEFT JOIN mdb_briefcase_state AS s ON s.area = {area} AND s.gdid = {gdid}" + freeze_join
    )


_PG_FREEZE = _pg_bytea(FREEZE_GDID)
_PG_CHECKS: dict[str, tuple[str, Callable[..., str]]] = {
    "mdb_ownership_lock": (
        "text, text",
        lambda partition_key, briefcase_key: f"SELECT pg_advisory_xact_lock_shared(hashtextextended({partition_key}, 0)), "
        f"pg_advisory_xact_lock_shared(hashtextextended({briefcase_key}, 0))",
    ),
    # An exclusive session (``store.briefcase(..., exclusive=True)``): the briefcase key EXCLUSIVE,
    # so writers of one briefcase run one after the other; the partition key stays SHARED.
    "mdb_ownership_lock_x": (
        "text, text",
        lambda partition_key, briefcase_key: f"SELECT pg_advisory_xact_lock_shared(hashtextextended({partition_key}, 0)), "
        f"pg_advisory_xact_lock(hashtextextended({briefcase_key}, 0))",
    ),
    "mdb_ownership_read": ("text, bytea", lambda area, gdid: _check_sql(area, gdid, None, _PG_FREEZE)),
    "mdb_ownership_write": ("text, bytea, text", lambda area, gdid, start: _check_sql(area, gdid, start, _PG_FREEZE)),
}
"""The PostgreSQL check statements: name -> (argument types, query from its arguments as SQL);
the source of both :data:`PG_PREPARED` and :data:`PG_FUNCTIONS`."""

PG_PREPARED: dict[str, str] = {
    name: f"({types}) AS " + query(*(f"${n}" for n in range(1, types.count(",") + 2)))
    for name, (types, query) in _PG_CHECKS.items()
}
"""The check as server-side prepared statements (name -> ``(argument types) AS query``).

Parsing and planning the check per session cost more than the whole BEGIN round trip; prepared
once per pooled connection, a session only sends ``EXECUTE`` with its literals.
"""


_PG_RESULT = (
    "TABLE(o_partition_start bytea, o_partition_end bytea, o_shard_index integer, o_shard_count integer, "
    "o_state varchar, o_peer varchar, o_frozen_by varchar)"
)
def _pg_write_function(lock: str) -> tuple[str, str]:
    """A write check function taking the locks of ``_PG_CHECKS[lock]``.

    The locks first, then the check: in a VOLATILE function each statement takes a new
    snapshot, so a session that waited for a move's lock sees the fence it committed.
    """
    return (
        "p_partition_key text, p_briefcase_key text, p_area text, p_gdid bytea, p_start text",
        "BEGIN PERFORM " + _PG_CHECKS[lock][1]("p_partition_key", "p_briefcase_key").removeprefix("SELECT ")
        + "; RETURN QUERY " + _check_sql("p_area", "p_gdid", "p_start", _PG_FREEZE) + "; END",
    )


PG_FUNCTIONS: dict[str, tuple[str, str]] = {
    "mdb_check_read": (
        "p_area text, p_gdid bytea",
        "BEGIN RETURN QUERY " + _check_sql("p_area", "p_gdid", None, _PG_FREEZE, "::varchar") + "; END",
    ),
    "mdb_check_write": _pg_write_function("mdb_ownership_lock"),
    "mdb_check_write_x": _pg_write_function("mdb_ownership_lock_x"),
}
"""The check as PL/pgSQL functions (name -> (arguments, body)), for servers behind a transaction
pooler: ``mdb schema apply`` creates them (:func:`install_pg_functions`). PL/pgSQL caches the
plans of its queries per server session, invisibly to the client, so a call costs little more
than ``EXECUTE`` of a prepared statement (measured: read 143 µs vs 92 prepared and 211 with the
check inlined as SQL; write 165 vs 130 and 259) and needs nothing of the client's session."""


def install_pg_functions(conn: Connection) -> list[str]:
    """Create or update the check functions on a PostgreSQL server; returns the names changed.

    Unchanged ones are left alone: ``CREATE OR REPLACE`` of the same function by two
    concurrent ``mdb schema apply`` runs can fail with "tuple concurrently updated".
    """
    changed = _pg_functions_to_install(conn)
    for name in changed:
        args, body = PG_FUNCTIONS[name]
        conn.exec_driver_sql(
            f"CREATE OR REPLACE FUNCTION {name}({args}) RETURNS {_PG_RESULT} LANGUAGE plpgsql VOLATILE AS $mdb${body}$mdb$"
        )
    return changed


def _pg_prelude_statements(placement: Placement, lock: bool, pooled: bool, exclusive: bool = False) -> tuple[str, ...]:
    """``EXECUTE`` of the prepared check (direct connections), or a call of its function (pooled)."""
    area, gdid = placement.area, placement.gdid
    if not lock:  # a read session: no lock keys to render
        check = f"'{area}', {_pg_bytea(gdid)}"
        return (f"SELECT * FROM mdb_check_read({check})",) if pooled else (f"EXECUTE mdb_ownership_read({check})",)
    start = placement.partition_start
    keys = f"'{_partition_lock_key(area, start)}', '{_lock_key(area, gdid)}'"
    check = f"'{area}', {_pg_bytea(gdid)}, '{start}'"
    if pooled:
        return (f"SELECT * FROM {'mdb_check_write_x' if exclusive else 'mdb_check_write'}({keys}, {check})",)
    lock_name = "mdb_ownership_lock_x" if exclusive else "mdb_ownership_lock"
    return (f"EXECUTE {lock_name}({keys})", f"EXECUTE mdb_ownership_write({check})")


_SQLITE_READ = _check_sql(":area", ":gdid", None, ":freeze")
_SQLITE_WRITE = _check_sql(":area", ":gdid", ":start", ":freeze")
"""The check on SQLite, with named parameters (a write session's also reads the freeze marker)."""
_SQLITE_FREEZE = bytes(FREEZE_GDID)

_CHECKED_TABLES: Final = {"layout": shard_layout.name, "state": briefcase_state.name}
_VERSION_TRIGGERS: Final = {
    f"{CHECK_VERSION_TABLE}_{short}_{op}": (op, table)
    for short, table in _CHECKED_TABLES.items() for op in ("insert", "update", "delete")
}
_SQLITE_VERSION = f"SELECT token FROM {CHECK_VERSION_TABLE} WHERE id = 1"
_VERSION_OBJECTS = f"sqlite_master WHERE name IN ({', '.join(repr(n) for n in (CHECK_VERSION_TABLE, *_VERSION_TRIGGERS))})"
_SQLITE_VERSIONED = f"SELECT count(*) FROM {_VERSION_OBJECTS}"
KEPT_CHECKS: Final = 4096
"""Check results an engine keeps (:class:`mdb.engines.KnownRows`; all dropped when full): about
400 bytes each, so at most ~1.6 MB per SQLite engine."""


def _pg_functions_to_install(conn: Connection) -> list[str]:
    """The check functions missing on a PostgreSQL server, or there with another body (an older mdb's)."""
    names = list(PG_FUNCTIONS)
    rows = conn.execute(
        text("SELECT proname, prosrc FROM pg_proc WHERE proname = ANY(:names) AND pronamespace = current_schema()::regnamespace"),
        {"names": names},
    )
    current = {str(name): str(source) for name, source in rows}
    return [name for name in names if current.get(name) != PG_FUNCTIONS[name][1]]


def _version_objects_present(conn: Connection) -> set[str]:
    """Which of :data:`CHECK_VERSION_TABLE` and its triggers a SQLite server has."""
    return {str(name) for (name,) in conn.exec_driver_sql(f"SELECT name FROM {_VERSION_OBJECTS}")}


def check_helpers_missing(conn: Connection) -> list[str]:
    """What ``mdb schema apply`` would install for the ownership check on this server, as names.

    On PostgreSQL the check functions a transaction pooler's sessions call (missing or of another
    body); on SQLite :data:`CHECK_VERSION_TABLE`, its row and its triggers. What their absence
    does differs (SQLite sessions read the whole check, pooled PostgreSQL sessions fail), so
    ``mdb schema check`` says it per server (:func:`mdb.schema.check_schema`). Reads only.
    """
    if conn.dialect.name == "postgresql":
        return _pg_functions_to_install(conn)
    if conn.dialect.name != "sqlite":
        return []
    present = _version_objects_present(conn)
    missing = [name for name in (CHECK_VERSION_TABLE, *_VERSION_TRIGGERS) if name not in present]
    if CHECK_VERSION_TABLE in present and conn.exec_driver_sql(_SQLITE_VERSION).first() is None:
        missing.append(f"{CHECK_VERSION_TABLE} row")
    return missing


def install_sqlite_check_version(conn: Connection) -> list[str]:
    """Create :data:`CHECK_VERSION_TABLE` and its triggers on a SQLite server where missing; returns the names created.

    ``mdb schema apply`` runs it with the system tables, in their transaction, so a database has
    all of them or none; sessions on a database without them run the whole check every time.
    """
    present = _version_objects_present(conn)
    created: list[str] = []
    if CHECK_VERSION_TABLE not in present:
        conn.exec_driver_sql(
            f"CREATE TABLE {CHECK_VERSION_TABLE} (id INTEGER PRIMARY KEY CHECK (id = 1), token INTEGER NOT NULL)"
        )
        created.append(CHECK_VERSION_TABLE)
    conn.exec_driver_sql(f"INSERT OR IGNORE INTO {CHECK_VERSION_TABLE} (id, token) VALUES (1, random())")
    for name, (op, table) in _VERSION_TRIGGERS.items():
        if name not in present:
            conn.exec_driver_sql(
                f"CREATE TRIGGER {name} AFTER {op.upper()} ON {table} "
                f"BEGIN UPDATE {CHECK_VERSION_TABLE} SET token = random() WHERE id = 1; END"
            )
            created.append(name)
    return created


def _sqlite_rows(cursor: sqlite3.Cursor, begin: str, sql: str, params: Mapping[str, Any], known: KnownRows,
                 key: Hashable) -> Rows:
    """``begin`` and the check's rows: those an earlier transaction read under the token this one reads, or read now.

    Costs one lookup of a one-row table where the rows are kept (the common case: no move or map
    change since this briefcase's last session on this engine); the whole check otherwise, and on
    a database without :data:`CHECK_VERSION_TABLE` (asked once per connection). Every part runs in
    the session's transaction: the token and, when read, the rows come from its one snapshot.
    ``key``: what the rows are kept under, the text and the values of ``params`` (made once by the caller).
    """
    cursor.execute(begin)
    versioned = known.versioned
    if versioned is None:
        cursor.execute(_SQLITE_VERSIONED)
        versioned = known.versioned = cursor.fetchone()[0] == 1 + len(_VERSION_TRIGGERS)
    if versioned:
        cursor.execute(_SQLITE_VERSION)
        token = cursor.fetchone()
        if token is not None:  # (a deleted row is never changed by the triggers: keep nothing then)
            shared = known.shared
            kept = shared.get(key)
            if kept is not None and kept[0] == token[0]:
                return kept[1]
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            if len(shared) >= KEPT_CHECKS:
                shared.clear()
            shared[key] = (token[0], rows)
            return rows
    cursor.execute(sql, params)
    return cursor.fetchall()


_PG_READ_BEGIN = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"


def _pg_begin(lock: bool) -> str:
    """A write session's BEGIN, or a read session's one-snapshot, read-only BEGIN (see :func:`ownership_prelude`)."""
    return "BEGIN" if lock else _PG_READ_BEGIN


def ownership_prelude(backend: str, placement: Placement, lock: bool, exclusive: bool = False) -> Prelude:
    """Statements to run right after BEGIN; the last one returns the row :func:`check_ownership` reads.

    ``lock`` (write sessions): take the partition's and the briefcase's advisory keys SHARED
    first, and read the partition's freeze marker. The lock is its own statement, before the
    check, so that the check's snapshot is taken after any wait for a move's exclusive lock.
    ``exclusive`` (with ``lock``): take the briefcase's key EXCLUSIVE instead, so exclusive
    sessions of one briefcase (and a move) run one at a time; the check, a later statement,
    then reads a snapshot taken after the previous holder committed. On SQLite nothing changes:
    BEGIN IMMEDIATE already serializes every write transaction of the database file.

    Without ``lock`` (readonly sessions) nothing holds a move off, so on PostgreSQL the
    transaction is REPEATABLE READ: its one snapshot is taken by the check, and every read after
    it sees the briefcase as the check found it. Under READ COMMITTED a move's commit point
    (fence, source rows deleted) landing between the check and a read made that read find an
    empty briefcase on a shard that had just said it owned it (seen by ``bench.py
    reshard_impact``). A transaction that only reads never fails to serialize. A SQLite read
    transaction already reads one snapshot. It is also ``READ ONLY``: a readonly session cannot
    write even through ``text()`` (the server refuses it, as a replica would), so its COMMIT
    changes nothing and the engine sends it without waiting for the answer
    (:func:`mdb.engines.commit_unwaited`, docs/dev/0023-readonly-sessions-end-unwaited.md).
    """
    if backend == "postgresql":
        # Both renderings: the engine sends the function call when it is behind a transaction
        # pooler (mdb.engines), where a statement prepared in one transaction's server session
        # is not there in the next one's.
        return Prelude(
            _pg_prelude_statements(placement, lock, pooled=False, exclusive=exclusive), PG_PREPARED,
            unprepared=_pg_prelude_statements(placement, lock, pooled=True, exclusive=exclusive),
            begin=_pg_begin(lock),
        )
    area, start = placement.area, placement.partition_start
    # SQLite: BEGIN IMMEDIATE already serializes write sessions with a reshard's freeze. The
    # check is one text per kind with named parameters, so sqlite3's statement cache parses it
    # once per connection; with the values inlined every briefcase was a new text (24 µs per
    # check instead of 9, measured).
    params: dict[str, Any] = {"area": area, "gdid": bytes(placement.gdid), "freeze": bytes(FREEZE_GDID)}
    if lock:
        params["start"] = str(start)
    return Prelude((_SQLITE_WRITE if lock else _SQLITE_READ,), params=params)


@dataclass(frozen=True)
class OwnershipCheck:
    """A session's ownership check as a :class:`mdb.engines.BeginPrelude` for any SQL engine.

    The engine's BEGIN calls the method of its own kind, so the caller (the Store) needs no
    ``dialect.name`` branch: the check is rendered for the kind that runs it
    (:func:`ownership_prelude`), on its first run, and kept with the object: a Store keeps a
    briefcase's check between its sessions (``Store.session_routes``), so the next session of
    that briefcase sends the same text without rendering it again. What it asks the shard is
    the same in every session.
    """

    placement: Placement
    lock: bool
    exclusive: bool = False

    @cached_property
    def _direct_sql(self) -> str:
        # Only the rendering this engine sends (not both, as ownership_prelude builds them).
        statements = _pg_prelude_statements(self.placement, self.lock, pooled=False, exclusive=self.exclusive)
        return "; ".join((_pg_begin(self.lock), *statements))

    @cached_property
    def _pooled_sql(self) -> str:
        statements = _pg_prelude_statements(self.placement, self.lock, pooled=True, exclusive=self.exclusive)
        return "; ".join((_pg_begin(self.lock), *statements))

    @cached_property
    def _sqlite_params(self) -> tuple[str, dict[str, Any], tuple[Any, ...]]:
        # The check's one text per kind, its values as named parameters (as ownership_prelude
        # renders it, without building a Prelude), and what its rows are kept under. sqlite3
        # only reads the dict.
        placement = self.placement
        params: dict[str, Any] = {"area": placement.area, "gdid": bytes(placement.gdid), "freeze": _SQLITE_FREEZE}
        if self.lock:
            params["start"] = str(placement.partition_start)
        sql = _SQLITE_WRITE if self.lock else _SQLITE_READ
        return sql, params, (sql, *params.values())

    def begin_postgresql(self, connection: psycopg.Connection[Any], prepared: PreparedNames) -> Rows | None:
        return _begin_prepared(connection, prepared, PG_PREPARED, self._direct_sql)

    def begin_postgresql_pooled(self, connection: psycopg.Connection[Any]) -> Rows | None:
        return simple_query(connection, self._pooled_sql)

    def begin_sqlite(self, cursor: sqlite3.Cursor, begin: str, known: KnownRows) -> Rows | None:
        sql, params, key = self._sqlite_params
        return _sqlite_rows(cursor, begin, sql, params, known, key)

    @property
    def read_only(self) -> bool:
        """A readonly session's check: its PostgreSQL BEGIN is ``READ ONLY`` (:func:`_pg_begin`)."""
        return not self.lock


def _gdid(value: Any) -> GDID | None:
    return None if value is None else GDID.from_bytes(value)


def confirming_row(placement: Placement) -> tuple[Any, ...] | None:
    """The check's row that confirms ``placement`` at once in :func:`check_ownership` (its first
    return: the stamp as routed, no state row, no freeze marker), for a caller that keeps it
    between sessions and compares the row with it before calling; None for a relocated
    placement (its target must show a ``resident`` row: always the whole check)."""
    return None if placement.relocated else (*placement.stamp, None, None, None)


def check_ownership(rows: list[tuple[Any, ...]] | None, placement: Placement, map_version: int, *, write: bool = True) -> None:
    """Raise a retryable error unless the shard confirms it holds the briefcase as routed.

    ``write``: a write session, which a reshard's freeze turns away unless the briefcase stays
    on this shard under the new layout; a read session is never turned away by a freeze.
    """
    if not rows:
        raise RuntimeError("the ownership check returned no row; the BEGIN prelude did not run")
    start, end, index, count, state, peer, *rest = rows[0]
    mark = rest[0] if rest else None
    # A reshard holds the partition (area, for reads) frozen here: its map apply may re-stamp the
    # shard before the new map is published, so a stamp that differs is a wait, not a stale route.
    applying = mark is not None
    frozen_by = mark if write and mark is not None and frozen_for(str(mark), placement.gdid) else None
    if state is None and frozen_by is None and not placement.relocated and (start, end, index, count) == placement.stamp:
        # The common case (no state row, no freeze that stops this session, routed by the map, the
        # stamp as routed): the row's bytes compared as they came (no GDIDs built), no message
        # built for an error not raised.
        return
    what = f"briefcase {placement.area}/{placement.gdid} on server {placement.server!r}"
    if state == STATE_GONE:
        raise StaleRouteError(f"{what}: fenced, it moved to server {peer!r}", moved_to=None if peer is None else str(peer))
    if state == STATE_INCOMING:
        raise BriefcaseMovingError(f"{what}: a move into this server is not finished yet")
    if frozen_by is not None:
        raise BriefcaseMovingError(
            f"{what}: partition {placement.partition_start} is frozen for writes by reshard {freeze_holder(str(frozen_by))}"
        )
    if placement.relocated:
        if state != STATE_RESIDENT:
            raise StaleRouteError(f"{what}: routed here away from its default shard (a fence or the relocation directory) but the server holds no resident record")
        return
    if start is None:
        raise StaleRouteError(
            f"{what}: the server carries no layout stamp for area {placement.area!r} (if the map's URL for it reaches "
            "the right database, run `mdb schema apply`)"
        )
    stamped = (_gdid(start), _gdid(end), int(index), int(count))
    expected = (placement.partition_start, placement.partition_end, placement.shard_index, placement.shard_count)
    if stamped != expected and applying:
        # Frozen by a reshard that is applying its map: this shard is re-stamped before the map is
        # published (or the process read the new map first). Re-read the map and retry until both
        # agree, a bounded wait (move_wait_seconds), never the few immediate stale retries.
        raise BriefcaseMovingError(
            f"{what}: {freeze_holder(str(mark))} is applying partition {placement.partition_start}'s new map; the "
            f"server's stamp and map version {map_version} differ until that map is published and read",
            refresh=True,
        )
    if stamped != expected:
        def fmt(t: tuple[Any, ...]) -> str:
            return f"partition [{t[0]}, {t[1] or 'open'}) shard {t[2]} of {t[3]}"

        raise StaleRouteError(
            f"{what}: the server is stamped {fmt(stamped)} but map version {map_version} routed it to {fmt(expected)}"
        )
