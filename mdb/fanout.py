"""Fan-out reads: one SELECT run on every shard of an area, merged as one database would answer.

SQLAlchemy's horizontal_shard extension concatenates per-shard results, so ``ORDER BY ... LIMIT
10`` over three shards gives up to 30 rows in shard order. Here each shard gets the statement
with ``LIMIT limit+offset`` (and no OFFSET), the per-shard sorted streams are k-way merged in
the global order, and OFFSET/LIMIT are applied once to the merged stream. Aggregates
(count, sum, min, max, avg) are computed per shard and combined (avg as sum/count). Any other
aggregate, however it is spelled, is refused, never combined wrongly: the check reads the
statement's compiled SQL (``count(DISTINCT x)`` written as ``func.count(func.distinct(x))``
is the same SQL as ``func.count(distinct(x))``, and both are refused).

Which shards: every server of the area's partitions (only partitions that can hold a GDID at or
past ``from_gdid`` when it is given) plus every server the relocation directory names for the
area. Rows of briefcases that are being copied onto a shard (``mdb_briefcase_state`` says
'incoming') are filtered out there: the source still holds the authoritative copy.

A fan-out read is NOT a consistent snapshot: each shard is read in its own transaction, at
slightly different moments (see docs/fan-out.md).
"""

from __future__ import annotations

import heapq
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import Enum, String, and_, func, or_, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection, Dialect, Engine, Row
from sqlalchemy.engine.result import IteratorResult, SimpleResultMetaData
from sqlalchemy.exc import CompileError, DBAPIError
from sqlalchemy.util import LRUCache
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable, operators
from sqlalchemy.sql.elements import BinaryExpression, ColumnElement, Label, UnaryExpression, _textual_label_reference
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.schema import Table
from sqlalchemy.sql.selectable import Alias, Join, Select

from mdb import telemetry
from mdb.backends import Servers, backend_of, servers_where
from mdb.dberrors import translated
from mdb.dialects import SqlDialect, sql_dialect
from mdb.detached import DetachedLoader
from mdb.engines import one_statement
from mdb.scatter import CompiledRead, compile_key, compile_read, has_idle_connection, read_many
from mdb.errors import CapacityError, MdbError, QueryError
from mdb.gdid import GDID, MAX_AUTHORITY, MAX_COUNTER, MAX_ERA
from mdb.router import Router
from mdb.system_tables import STATE_INCOMING, briefcase_state
from mdb.urls import mask_secrets

if TYPE_CHECKING:
    from mdb.cluster import Cluster

__all__ = [
    "FanOutPlan", "FanOutResult", "ShardFailure", "ShardQuery", "SortKey", "SortTerm", "fan_out", "fan_out_aggregate",
    "fan_out_result", "fan_out_servers", "gather", "merge_sorted", "plan_fan_out", "run_shard", "scatter_shards", "settle",
    "warm_up",
]

AGGREGATES = frozenset({"count", "sum", "min", "max", "avg"})
# Aggregates that cannot be combined from per-shard partial results: refused, not mis-combined.
# PostgreSQL's and SQLite's built-in aggregates (a user-defined aggregate has a name mdb cannot
# know: docs/fan-out.md).
_OTHER_AGGREGATES = frozenset(
    {"array_agg", "string_agg", "group_concat", "bool_and", "bool_or", "every", "json_agg", "jsonb_agg",
     "json_object_agg", "jsonb_object_agg", "json_group_array", "json_group_object", "jsonb_group_array",
     "jsonb_group_object", "xmlagg", "bit_and", "bit_or", "bit_xor", "any_value", "range_agg",
     "range_intersect_agg", "stddev", "stddev_pop", "stddev_samp", "variance", "var_pop", "var_samp",
     "percentile_cont", "percentile_disc", "mode", "rank", "dense_rank", "percent_rank", "cume_dist",
     "total", "corr", "covar_pop", "covar_samp", "regr_avgx", "regr_avgy", "regr_count", "regr_intercept",
     "regr_r2", "regr_slope", "regr_sxx", "regr_sxy", "regr_syy", "median"}
)
# In compiled SQL (quoted names and string literals blanked): a call of an aggregate, and the
# words that make even count/sum/min/max/avg uncombinable (DISTINCT values may repeat across
# shards; OVER is a per-shard window; FILTER/WITHIN GROUP/a subquery are not merged).
_AGGREGATE_CALL = re.compile(r"\b(" + "|".join(sorted(AGGREGATES | _OTHER_AGGREGATES)) + r")\s*\(", re.IGNORECASE)
_WINDOW = re.compile(r"\bOVER\s*\(", re.IGNORECASE)
_NOT_COMBINABLE = re.compile(r"\b(DISTINCT|OVER|FILTER|WITHIN|SELECT)\b", re.IGNORECASE)
_QUOTED = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")
DEFAULT_MAX_WORKERS = 16
_BINARY_COLLATIONS = frozenset({"C", "POSIX", "BINARY", "UCS_BASIC"})
R = TypeVar("R")


@dataclass(frozen=True)
class ShardFailure:
    """A shard whose part of a fan-out failed; ``error`` is masked (no secrets)."""

    server: str
    error: str


@dataclass
class FanOutResult:
    """Merged rows of a fan-out, plus the shards that failed (only with ``allow_partial``)."""

    rows: list[Row[Any]]
    failed: list[ShardFailure] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    """The servers that were queried (failed ones included)."""

    @property
    def complete(self) -> bool:
        return not self.failed

    def scalars(self) -> list[Any]:
        """The first element of each row (e.g. the ORM objects of ``select(Order)``)."""
        return [row[0] for row in self.rows]

    def __iter__(self) -> Iterator[Row[Any]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


# -- which shards -------------------------------------------------------------------------------


def fan_out_servers(router: Router, area: str, from_gdid: GDID | None = None) -> list[str]:
    """Servers holding data of ``area`` (from ``from_gdid`` on, in sharding order), deduplicated.

    Map order first (partition by partition), then the servers the relocation directory sends
    briefcases of ``area`` to (from ``from_gdid`` on), by name. Read from the directory's summary
    per server (``router.relocation_reach``), never its entries: a process that fans out holds
    nothing per moved briefcase (docs/design.md invariant 8).
    """
    v = None if from_gdid is None else from_gdid.sharding_value
    out: dict[str, None] = {}
    for _start, end, shards in router.partitions(area):
        if v is not None and end is not None and end.sharding_value <= v:
            continue
        out.update(dict.fromkeys(shards))
    for (reloc_area, server), reach in sorted(router.relocation_reach.items(), key=lambda item: item[0]):
        if reloc_area == area and (v is None or reach.high >= v):
            out[server] = None
    return list(out)


def _from_condition(key: ColumnElement[Any], start: GDID) -> ColumnElement[bool]:
    """``sharding_value(key) >= sharding_value(start)`` as byte-range predicates on the GDID column.

    GDIDs are stored as 12 bytes ordered by (era, authority, counter), but routing orders them
    by (era, counter): authority never influences placement. So "from this GDID on" is, per
    authority, one byte range in the start's era, plus everything in later eras.
    """
    if start.counter == 0:
        return key >= GDID(start.era, 0, 0)
    ranges: list[ColumnElement[bool]] = [key.between(GDID(start.era, a, start.counter), GDID(start.era, a, MAX_COUNTER)) for a in range(MAX_AUTHORITY + 1)]
    if start.era < MAX_ERA:
        ranges.append(key >= GDID(start.era + 1, 0, 0))
    return or_(*ranges)


# -- statement rewriting -----------------------------------------------------------------------


def _briefcase_columns(statement: Select[Any], keys: dict[str, str]) -> list[tuple[ColumnElement[Any], bool]]:
    """(key column, nullable side of an outer join) of each briefcase table in the statement's FROM."""
    out: list[tuple[ColumnElement[Any], bool]] = []

    def walk(from_: Any, nullable: bool) -> None:
        if isinstance(from_, Join):
            walk(from_.left, nullable or from_.full)
            walk(from_.right, nullable or from_.isouter or from_.full)
            return
        table = from_.element if isinstance(from_, Alias) else from_
        if isinstance(table, Table) and table.name in keys and keys[table.name] in from_.c:
            out.append((from_.c[keys[table.name]], nullable))

    try:
        froms = statement.get_final_froms()
    except CompileError as exc:
        raise QueryError(f"fan-out statement does not compile: {exc}") from None
    for from_ in froms:
        walk(from_, False)
    return out


def _restrict(statement: Select[Any], store: Cluster, area: str, from_gdid: GDID | None) -> Select[Any]:
    """Add the 'not incoming here' filter (and the from-GDID range) for every briefcase table."""
    keys = {t.name: btype.key for btype in store.types_of(area) for t in btype.tables}
    columns = _briefcase_columns(statement, keys)
    if not columns:
        known = ", ".join(sorted(keys)) or "none registered"
        raise QueryError(
            f"fan-out over area {area!r}: the statement reads no briefcase table of the area "
            f"(tables of its briefcase types: {known})"
        )
    incoming = select(briefcase_state.c.gdid).where(
        briefcase_state.c.area == area, briefcase_state.c.state == STATE_INCOMING
    )
    conditions = []
    for column, nullable in columns:
        condition: ColumnElement[bool] = column.not_in(incoming)
        if from_gdid is not None:
            condition = and_(condition, _from_condition(column, from_gdid))
        conditions.append(or_(column.is_(None), condition) if nullable else condition)
    return statement.where(*conditions)


@dataclass(frozen=True)
class _Order:
    """One ORDER BY term: how to read its value off a result row, and where it sorts."""

    get: Callable[[Row[Any]], Any]
    descending: bool
    nulls_first: bool
    sql: ColumnElement[Any]  # the expression itself (labels resolved), for the per-shard rewrite
    position: int | None  # the row position it reads, when it reads a whole column


def _unwrap(clause: Any) -> tuple[Any, bool, bool | None]:
    descending, nulls_first = False, None
    while isinstance(clause, UnaryExpression) and clause.modifier in (
        operators.asc_op, operators.desc_op, operators.nulls_first_op, operators.nulls_last_op,
    ):
        if clause.modifier is operators.desc_op:
            descending = True
        elif clause.modifier is operators.nulls_first_op:
            nulls_first = True
        elif clause.modifier is operators.nulls_last_op:
            nulls_first = False
        clause = clause.element
    if isinstance(clause, BinaryExpression) and clause.operator is operators.collate:
        # The merge orders strings by code point; a binary collation says the same, any other
        # one would make the shards and the merge disagree.
        collation = str(getattr(clause.right, "collation", "")).strip('"')
        if collation.upper() not in _BINARY_COLLATIONS:
            raise QueryError(
                f"fan-out merges strings in code point order: ORDER BY ... COLLATE {collation!r} cannot be "
                f"merged (use COLLATE \"C\" or no COLLATE)"
            )
        clause = clause.left
    return clause, descending, nulls_first


def _clause(expr: Any) -> Any:
    return expr.__clause_element__() if hasattr(expr, "__clause_element__") else expr


def _resolve(term: Any, descriptions: Sequence[dict[str, Any]]) -> tuple[Callable[[Row[Any]], Any], ColumnElement[Any], int | None]:
    """Find an ORDER BY term among the statement's result columns (by label, identity or structure)."""
    name: str | None = None
    if isinstance(term, _textual_label_reference):
        name = term.element
    elif isinstance(term, Label):
        name = term.name
    for i, d in enumerate(descriptions):
        expr = _clause(d["expr"])
        is_entity = d["entity"] is not None and d["expr"] is d["entity"]
        if is_entity:
            ann = getattr(term, "_annotations", {})
            parent = ann.get("parententity")
            if parent is not None and parent is sa_inspect(d["entity"]) and "proxy_key" in ann:
                key = ann["proxy_key"]
                return (lambda row, i=i, key=key: getattr(row[i], key)), term, None
            continue
        if (name is not None and d["name"] == name) or expr is term or (
            isinstance(term, ColumnElement) and expr.compare(term)
        ):
            sql = expr.element if isinstance(expr, Label) else expr
            return (lambda row, i=i: row[i]), sql, i
        if isinstance(expr, Label) and isinstance(term, ColumnElement) and expr.element.compare(term):
            return (lambda row, i=i: row[i]), expr.element, i
    shown = name if name is not None else str(term)
    raise QueryError(
        f"fan-out cannot merge by ORDER BY {shown!r}: order by a selected column, an attribute of a "
        f"selected entity, or a selected labelled expression (the merge reads sort values off the rows)"
    )


def _orders(statement: Select[Any], descriptions: Sequence[dict[str, Any]]) -> list[_Order]:
    out = []
    for clause in statement._order_by_clauses:
        term, descending, nulls_first = _unwrap(clause)
        get, sql, position = _resolve(term, descriptions)
        # Unspecified NULL placement: PostgreSQL's rule (NULL sorts above every value), made
        # explicit on every shard so SQLite shards and the merge agree with it.
        out.append(_Order(get, descending, descending if nulls_first is None else nulls_first, sql, position))
    return out


def _is_string(expr: ColumnElement[Any]) -> bool:
    return isinstance(expr.type, String) and not isinstance(expr.type, Enum)


def _shard_order_by(orders: list[_Order], dialect: SqlDialect) -> list[ColumnElement[Any]]:
    """ORDER BY terms for a shard: explicit NULL placement; binary string order on PostgreSQL.

    The merge compares Python values, and Python orders str by code point: PostgreSQL's
    ``COLLATE "C"`` is that order (UTF-8 bytes), SQLite's default BINARY collation already is.
    """
    terms: list[ColumnElement[Any]] = []
    for o in orders:
        expr = o.sql
        if _is_string(expr):
            expr = dialect.bytewise(expr)
        term = expr.desc() if o.descending else expr.asc()
        terms.append(term.nulls_first() if o.nulls_first else term.nulls_last())
    return terms


@dataclass(frozen=True)
class SortTerm:
    """Direction and NULL placement of one sort term, as every shard sorted by it."""

    descending: bool
    nulls_first: bool = False


class SortKey:
    """Ordering of merged results (SQL rows, documents): term by term, as the shards sorted.

    ``values`` are what each term compares (a SQL value, or a document field's BSON sort key);
    ``None`` sorts by the term's NULL placement.
    """

    __slots__ = ("values", "terms")

    def __init__(self, values: Sequence[Any], terms: Sequence[SortTerm]) -> None:
        self.values = values
        self.terms = terms

    def __lt__(self, other: SortKey) -> bool:
        for t, a, b in zip(self.terms, self.values, other.values):
            if a is None or b is None:
                if a is None and b is None:
                    continue
                return (a is None) == t.nulls_first
            if a == b:
                continue
            return bool(a > b) if t.descending else bool(a < b)
        return False


def _row_key(orders: list[_Order]) -> Callable[[Row[Any]], SortKey]:
    """The merge key of a SQL row under ``orders``."""
    terms = [SortTerm(o.descending, o.nulls_first) for o in orders]
    return lambda row: SortKey([o.get(row) for o in orders], terms)


# -- the plan: sans-IO, run by a thread pool (here) or by asyncio (mdb.aio.fanout) ----------------


@dataclass(frozen=True)
class ShardQuery:
    """What one shard runs: the rewritten statement, and how it must run there."""

    statement: Select[Any]
    orm: bool
    """The statement selects ORM entities: run it through a Session (objects come back)."""
    one_statement: bool
    """It runs as ONE SQL statement (no eager load or polymorphic load issues a second one), so
    it may go out without BEGIN and COMMIT: a transaction of its own on the server, one round
    trip instead of three (:func:`mdb.engines.one_statement`)."""


@dataclass
class FanOutPlan:
    """A fan-out decided before any I/O: which servers, what each runs, how the rows merge.

    Sans-IO, so the thread-pool runner (:func:`fan_out`) and the asyncio one
    (:func:`mdb.aio.fanout.fan_out`) share every decision and only differ in how they wait:
    they send the warm shards with :func:`scatter_shards`, run :meth:`query` on each other server,
    and hand every outcome to :func:`fan_out_result` (:func:`settle`'s errors and partial-failure
    policy, then :meth:`result`'s merge).
    """

    servers: list[str]
    _queries: dict[str, ShardQuery]
    _merge: Callable[[list[list[Row[Any]]]], list[Row[Any]]]

    def query(self, server: str) -> ShardQuery:
        return self._queries[server]

    def result(self, per_shard: list[list[Row[Any]]], failed: list[ShardFailure]) -> FanOutResult:
        """The merged rows of the shards that answered (in :attr:`servers` order, failed ones left out)."""
        return FanOutResult(self._merge(per_shard), failed, self.servers)


def plan_fan_out(
    cluster: Cluster, router: Router, area: str, statement: Select[Any], *, aggregate: bool = False,
    from_gdid: GDID | str | None = None, readonly: bool = False,
) -> FanOutPlan:
    """The :class:`FanOutPlan` of ``statement`` over ``area`` under ``router`` (no I/O: the
    router's relocation directory must be loaded already when it is to be read)."""
    if not isinstance(statement, Select):
        raise QueryError(f"fan-out runs a SQLAlchemy select(), got {type(statement).__name__}")
    start = GDID.parse(from_gdid) if isinstance(from_gdid, str) else from_gdid
    servers = _dedupe_by_url(cluster, fan_out_servers(router, area, start), readonly)
    restricted = _restrict(statement, cluster, area, start)
    if aggregate:
        build, merge = _aggregate_plan(statement, restricted)
    else:
        build, merge = _rows_plan(statement, restricted)
    per_backend: dict[str, ShardQuery] = {}
    queries: dict[str, ShardQuery] = {}
    for server in servers:
        backend = cluster.engines.backend(server)
        query = per_backend.get(backend)
        if query is None:
            shard = build(sql_dialect(backend))
            orm = _selects_entities(shard)
            query = per_backend[backend] = ShardQuery(shard, orm, not orm or _single_query(shard))
        queries[server] = query
    return FanOutPlan(servers, queries, merge)


def _rows_plan(statement: Select[Any], restricted: Select[Any]) -> tuple[Callable[[SqlDialect], Select[Any]], Callable[[list[list[Row[Any]]]], list[Row[Any]]]]:
    """(per-backend shard statement, merge) of a row fan-out: ``LIMIT limit+offset`` per shard,
    a heap merge of the sorted streams, OFFSET/LIMIT once."""
    _refuse_aggregates(statement)
    orders = _orders(statement, statement.column_descriptions)
    limit, offset = _limits(statement)
    key = _row_key(orders) if orders else None

    def build(dialect: SqlDialect) -> Select[Any]:
        shard = restricted.offset(None)
        if limit is not None:
            shard = shard.limit(limit + offset)
        if orders:
            shard = shard.order_by(None).order_by(*_shard_order_by(orders, dialect))
        return shard

    return build, lambda per_shard: merge_sorted(per_shard, key, offset, limit)


def merge_sorted(streams: Sequence[Sequence[R]], key: Callable[[R], SortKey] | None, offset: int, limit: int | None) -> list[R]:
    """K-way heap merge of per-shard sorted ``streams`` (concatenation without ``key``), then OFFSET/LIMIT once.

    Lazy: a top-N over S shards keys the S stream heads and then only the rows it pops
    (about N log S comparisons), never every row each shard returned.
    """
    merged: Iterator[R] = heapq.merge(*streams, key=key) if key is not None else chain.from_iterable(streams)
    return list(islice(merged, offset, None if limit is None else offset + limit))


def _limits(statement: Select[Any]) -> tuple[int | None, int]:
    if statement._fetch_clause is not None:
        raise QueryError("fan-out does not support FETCH FIRST; use .limit()")
    try:
        limit, offset = statement._limit, statement._offset
    except CompileError as exc:
        raise QueryError(f"fan-out needs literal integers for LIMIT and OFFSET: {exc}") from None
    return limit, offset or 0


def _selects_entities(statement: Select[Any]) -> bool:
    """Does the statement select ORM entities (objects), not only columns?"""
    return any(d["entity"] is not None and d["expr"] is d["entity"] for d in statement.column_descriptions)


_MORE_QUERIES = frozenset({"selectin", "subquery", "immediate"})
"""Relationship loader strategies that run further statements while the first one loads."""


def _single_query(statement: Select[Any]) -> bool:
    """Is loading this ORM statement's entities ONE SQL statement?

    Conservative: no loader options at all, and no selected mapper that is polymorphic or has
    a relationship loaded by a further query ("selectin", "subquery", "immediate"). Lazy loads
    never run: the rows come back detached. Otherwise the shard keeps its transaction, so that
    every statement of the load reads one snapshot.
    """
    if statement._with_options:
        return False
    for description in statement.column_descriptions:
        entity = description["entity"]
        if entity is None:
            continue
        mapper = sa_inspect(entity).mapper
        if mapper.inherits is not None or mapper.polymorphic_on is not None or len(mapper.polymorphic_map) > 1:
            return False
        if any(str(rel.lazy) in _MORE_QUERIES for rel in mapper.relationships):
            return False
    return True


# -- running a plan on a thread pool -----------------------------------------------------------


def run_shard(store: Cluster, server: str, query: ShardQuery, readonly: bool) -> list[Row[Any]]:
    """One shard's rows of ``query`` (the thread-pool runner's unit of work)."""
    with telemetry.fanout_shard(server):
        if query.one_statement:
            return _read(store, server, query.statement, readonly, query.orm)
        # An ORM statement that loads more than once keeps its transaction: one snapshot.
        with store.transaction(server, readonly) as conn, Session(bind=conn, expire_on_commit=False) as session:
            return list(session.execute(query.statement).all())


def _read(store: Cluster, server: str, statement: Executable, readonly: bool, orm: bool = False) -> list[Row[Any]]:
    """The rows of ONE statement on ``server``, sent without BEGIN and COMMIT (:func:`one_statement`).

    The statement is its own transaction, so it reads committed data of one moment, as before;
    the shard costs one round trip instead of three (a warm fan-out count over 128 shards: 43
    -> 34 ms, docs/fan-out.md). A pooled connection that died with its server
    (a restart) now fails on the statement instead of on BEGIN: it is replaced once, as
    ``Store`` replaces one whose BEGIN failed (nothing ran on it: the statement only reads).
    """
    engine = store.engines.engine(server, readonly)
    with translated(server):
        conn = engine.connect()
        try:
            try:
                return _one(conn, statement, orm)
            except DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
            conn.close()
            conn = engine.connect()
            return _one(conn, statement, orm)
        finally:
            conn.close()


def _one(conn: Connection, statement: Executable, orm: bool) -> list[Row[Any]]:
    one_statement(conn)
    if orm:
        with Session(bind=conn, expire_on_commit=False) as session:
            rows = list(session.execute(statement).all())
            session.commit()  # sends nothing (no transaction is open on the server); ends SQLite's
        return rows
    rows = list(conn.execute(statement).all())
    conn.commit()  # as above
    return rows


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads, kept between fan-outs.

    Starting a fresh pool per fan-out started its threads again every time (about 1 ms per
    fan-out on the measuring machine); the threads hold no state between tasks.
    """
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mdb-fanout")
        return pool


def _dedupe_by_url(store: Cluster, servers: list[str], readonly: bool) -> list[str]:
    # Two server names for one database would count its rows twice.
    seen: set[str] = set()
    out = []
    for server in servers:
        spec = store.engines.spec(server)
        url = spec.replica if readonly and spec.replica else spec.primary
        if url not in seen:
            seen.add(url)
            out.append(server)
    return out


def gather(
    cluster: Servers,
    servers: Sequence[str],
    one: Callable[[str], list[R]],
    *,
    allow_partial: bool,
    max_workers: int | None,
) -> tuple[list[list[R]], list[ShardFailure]]:
    """Run ``one(server)`` on every server on the thread pool; then :func:`settle` the outcomes.

    The one thread-pool gather of SQL and document fan-outs (the asyncio runner collects its
    outcomes on the loop and settles them the same way).
    """
    outcomes = _on_threads(servers, one, max(1, max_workers or DEFAULT_MAX_WORKERS))
    return settle(cluster, servers, outcomes, allow_partial=allow_partial)


def _on_threads(servers: Sequence[str], one: Callable[[str], list[R]], workers: int) -> list[list[R] | Exception]:
    """``one(server)`` of every server, run by up to ``workers`` threads: its rows, or what it raised."""
    pool = _pool(workers)
    outcomes: list[list[R] | Exception] = [[] for _ in servers]
    indexes = iter(range(len(servers)))  # shared by the workers: its next() is one C call, atomic under the GIL

    def drain() -> None:
        # Each worker takes the next server until none is left: one future per worker, not per
        # server (a future, its condition and its wake-up were ~40 Python calls per shard).
        for i in indexes:
            try:
                outcomes[i] = one(servers[i])
            except Exception as exc:  # settled by the caller: a server's error or a bug, asked of its backend
                outcomes[i] = exc

    for future in [pool.submit(drain) for _ in range(min(workers, len(servers)))]:
        future.result()
    return outcomes


def settle(
    cluster: Servers, servers: Sequence[str], outcomes: Sequence[list[R] | Exception], *, allow_partial: bool,
) -> tuple[list[list[R]], list[ShardFailure]]:
    """Each server's outcome (its rows, or what it raised) -> the rows in server order, plus the failed shards.

    A server's error is asked of its backend (:meth:`~mdb.backends.base.Backend.translate`): an
    error of the server (unreachable, a schema problem) is a failed shard, anything else is a
    bug and raised as it is. Failed shards are raised (the first, the others in a note) unless
    ``allow_partial``; a :class:`~mdb.errors.CapacityError` (a full server or budget) is raised
    even then, since the shard is there, only busy, and dropping its rows silently would be wrong.
    """
    results: list[list[R]] = []
    errors: list[tuple[str, MdbError]] = []
    for server, outcome in zip(servers, outcomes, strict=True):
        if not isinstance(outcome, Exception):
            results.append(outcome)
            continue
        translated = backend_of(cluster.map, server).translate(cluster, server, outcome)
        if translated is None:
            raise outcome
        errors.append((server, translated))  # names the server, masked
    capacity = [(s, e) for s, e in errors if isinstance(e, CapacityError)]
    if capacity or (errors and not allow_partial):
        errors = capacity + [(s, e) for s, e in errors if not isinstance(e, CapacityError)]
        first = errors[0][1]
        if len(errors) > 1:
            first.add_note("fan-out: other failed shards: " + "; ".join(mask_secrets(str(e)) for _, e in errors[1:]))
        raise first
    telemetry.fanout_partial(errors)
    return results, [ShardFailure(server, mask_secrets(str(exc))) for server, exc in errors]


def fan_out(
    store: Cluster,
    area: str,
    statement: Select[Any],
    *,
    aggregate: bool = False,
    from_gdid: GDID | str | None = None,
    readonly: bool = False,
    allow_partial: bool = False,
    max_workers: int | None = None,
) -> FanOutResult:
    """Run ``statement`` on every shard of ``area`` in parallel and merge as one database would.

    Rows come back in the statement's ORDER BY (k-way merge), with LIMIT/OFFSET applied to the
    merged stream. ``aggregate=True`` combines count/sum/min/max/avg (optionally grouped) across
    shards. ``from_gdid`` limits the read to partitions (and rows) from that GDID on, in routing
    order. ``readonly`` reads replicas where the map has them. A failed shard raises its
    :class:`~mdb.errors.ServerUnavailableError` (or ``SchemaError``), naming the server, unless
    ``allow_partial``: then the result lists it in ``failed`` and holds the other shards' rows.
    A :class:`~mdb.errors.CapacityError` (a full server, after its retries, or a full connection
    budget) is raised even with ``allow_partial``: the shard is there, only busy.
    """
    plan = plan_fan_out(store, store.router, area, statement, aggregate=aggregate, from_gdid=from_gdid, readonly=readonly)
    workers = max(1, max_workers or DEFAULT_MAX_WORKERS)
    outcomes, sent = scatter_shards(plan, workers, lambda server: store.engines.engine(server, readonly))
    rest = [i for i, outcome in enumerate(outcomes) if outcome is None]
    if rest:  # cold, or not sendable that way, or failed there (run again: this path translates the error)
        servers = [plan.servers[i] for i in rest]
        run = _on_threads(servers, lambda s: run_shard(store, s, plan.query(s), readonly), workers)
        for i, outcome in zip(rest, run):
            outcomes[i] = outcome
    # Every None was run on the threads above.
    return fan_out_result(store, plan, cast("list[list[Any] | Exception]", outcomes), sent,
                          aggregate=aggregate, allow_partial=allow_partial)


def fan_out_result(
    store: Cluster, plan: FanOutPlan, outcomes: list[list[Any] | Exception], sent: list[_Sendable], *,
    aggregate: bool, allow_partial: bool,
) -> FanOutResult:
    """The merged result of every shard's outcome (its rows, or its exception, for :func:`settle`),
    for the sync and the async fan-out alike; ``sent``: the sendables :func:`scatter_shards` used."""
    per_shard, failed = settle(store, plan.servers, outcomes, allow_partial=allow_partial)
    result = plan.result(per_shard, failed)
    if sent and not aggregate:  # the merged rows that scatter read are tuples or _EntityRow: as Rows now
        made = iter(sent[0].as_rows([row for row in result.rows if not isinstance(row, Row)]))
        result.rows = [row if isinstance(row, Row) else next(made) for row in result.rows]
    return result


class _EntityRow:
    """A shard's row of a one-entity ORM statement, read as column values: the instance is built
    only when the merge reads it (a stream head's sort key) or returns it (:mod:`mdb.detached`)."""

    __slots__ = ("values", "loader", "instance")

    def __init__(self, values: tuple[Any, ...], loader: DetachedLoader) -> None:
        self.values = values
        self.loader = loader
        self.instance: Any = None

    def __getitem__(self, index: int) -> Any:
        if index != 0:
            raise IndexError(index)
        if self.instance is None:
            self.instance = self.loader(self.values)
        return self.instance


@dataclass(frozen=True)
class _Sendable:
    """A shard statement that :mod:`mdb.scatter` can send on one dialect, and how its rows read back."""

    read: CompiledRead
    entity: Any = None
    """The one ORM entity it selects (its rows become detached instances); None: columns."""
    loader: DetachedLoader | None = None

    @classmethod
    def of(cls, query: ShardQuery, dialect: Dialect) -> _Sendable | None:
        """``query`` (one statement: :func:`scatter_shards` asks only for those) as sent on ``dialect``; None: not this way."""
        read = compile_read(query.statement, dialect)
        if read is None or not query.orm:
            return None if read is None else cls(read)
        descriptions = query.statement.column_descriptions
        if len(descriptions) != 1:
            return None
        loader = DetachedLoader.of(descriptions[0]["entity"], read.objects)
        return None if loader is None else cls(read, descriptions[0]["entity"], loader)

    def shape(self, rows: list[tuple[Any, ...]]) -> list[Any]:
        """A shard's rows as the merge reads them (``row[i]``, like a Row of the thread-pool path)."""
        loader = self.loader
        return rows if loader is None else [_EntityRow(values, loader) for values in rows]

    def as_rows(self, merged: list[Any]) -> list[Row[Any]]:
        """Merged rows of :meth:`shape` as SQLAlchemy rows, keyed as the thread-pool path's are."""
        if self.loader is None:
            return self.read.rows(merged)
        name = sa_inspect(self.entity).class_.__name__
        result: IteratorResult[Any] = IteratorResult(
            SimpleResultMetaData([name], extra=[(self.entity,)]), iter([(row[0],) for row in merged])
        )
        return list(result.all())


def scatter_shards(
    plan: FanOutPlan, window: int, engine_of: Callable[[str], Engine | None],
) -> tuple[list[list[Any] | Exception | None], list[_Sendable]]:
    """The shards whose statement one thread sends to all before reading any (:mod:`mdb.scatter`):
    one statement (columns, or one plain ORM entity), a PostgreSQL engine with an idle pooled
    connection. Their rows (:meth:`_Sendable.shape`), None for every other shard and for one that
    failed there; and the sendables used. ``engine_of``: the engine a shard's statement is sent
    on (an async engine's ``sync_engine``, called in a greenlet), None to leave the shard out."""
    outcomes: list[list[Any] | Exception | None] = [None] * len(plan.servers)
    picked: list[tuple[int, _Sendable]] = []
    targets: list[tuple[Engine, CompiledRead]] = []
    sendables: dict[tuple[Any, ...], _Sendable | None] = {}
    for i, server in enumerate(plan.servers):
        query = plan.query(server)
        if not query.one_statement:
            continue
        engine = engine_of(server)
        if engine is None or not has_idle_connection(engine):
            continue  # connecting here would make the shards wait for each other: the thread pool connects in parallel
        key = (id(query), compile_key(engine.dialect))
        if key not in sendables:
            sendables[key] = _Sendable.of(query, engine.dialect)
        sendable = sendables[key]
        if sendable is not None:
            picked.append((i, sendable))
            targets.append((engine, sendable.read))
    if not targets:
        return outcomes, []

    def observe(j: int, started: float, ended: float) -> None:
        telemetry.fanout_shard_read(plan.servers[picked[j][0]], started, ended)

    for (i, sendable), rows in zip(picked, read_many(targets, window, observe if telemetry.sdk_installed() else None)):
        if not isinstance(rows, Exception):
            outcomes[i] = sendable.shape(rows)
    return outcomes, [sendable for sendable in sendables.values() if sendable is not None]


def _warm(store: Cluster, server: str, readonly: bool) -> None:
    _read(store, server, _PING, readonly)


_PING = text("SELECT 1")


def warm_up(
    store: Cluster, area: str | None = None, *, readonly: bool = False, max_workers: int | None = None
) -> list[ShardFailure]:
    """Open a pooled connection to every shard of ``area`` (default: every server reached through a pool), in parallel.

    For deploys: the first fan-out of a new process otherwise pays, per shard and mostly one
    after the other, for creating the engine, connecting and authenticating, and the first
    transaction on the connection. Each connection is returned to its pool after one round
    trip. A shard that cannot be reached is returned (masked), not raised: a warm-up must not
    stop a deploy, and the first real session reports the same error in context.
    """
    if area is not None:
        servers = fan_out_servers(store.router, area)
    else:
        servers = servers_where(store.map, lambda b: b.pools_connections)
    pool = _pool(max(1, max_workers or DEFAULT_MAX_WORKERS))
    futures = [(s, pool.submit(_warm, store, s, readonly)) for s in servers]
    failed = []
    for server, future in futures:
        try:
            future.result()
        except MdbError as exc:
            failed.append(ShardFailure(server, mask_secrets(str(exc))))
    return failed


def fan_out_aggregate(store: Cluster, area: str, statement: Select[Any], **kwargs: Any) -> FanOutResult:
    """``fan_out(..., aggregate=True)``: combine count/sum/min/max/avg across shards."""
    return fan_out(store, area, statement, aggregate=True, **kwargs)


# -- aggregates --------------------------------------------------------------------------------


def _function(expr: Any) -> FunctionElement[Any] | None:
    inner = expr.element if isinstance(expr, Label) else expr
    return inner if isinstance(inner, FunctionElement) else None


def _function_name(fn: FunctionElement[Any]) -> str:
    return str(getattr(fn, "name", "")).lower()


_CHECKED_SQL: LRUCache[Any, str] = LRUCache(512)
"""What :func:`_sql` gave, per clause cache key: the fan-out's checks compiled the statement
two or three times per fan-out, uncached (~40 Python calls per shard at S=16, measured)."""


def _sql(clause: Any) -> str:
    """``clause`` as SQL, with quoted names and string literals blanked (a column may be called "distinct").

    What the shards run is SQL: the checks read it, so every Python spelling of one SQL
    construct gets the same answer. Kept per cache key (SQLAlchemy's: the structure without the
    bound values), since the checks read only the structure: which functions, DISTINCT, OVER.
    """
    cache_key = clause._generate_cache_key()
    key = None if cache_key is None else cache_key.key  # the structure; the bound values are not in it
    if key is not None:
        known = _CHECKED_SQL.get(key)
        if known is not None:
            return known
    try:
        compiled = str(clause.compile(compile_kwargs={"render_postcompile": True}))
    except CompileError as exc:
        raise QueryError(f"fan-out statement does not compile: {exc}") from None
    sql = _QUOTED.sub("''", compiled)
    if key is not None:
        _CHECKED_SQL[key] = sql
    return sql


def _statement_sql(statement: Select[Any]) -> str:
    """The statement's SQL without ORDER BY (an ORDER BY term repeats a selected column: checked there)."""
    return _sql(statement.order_by(None))


def _refuse_aggregates(statement: Select[Any]) -> None:
    """Refuse a plain (not aggregate=True) fan-out that would compute any aggregate per shard."""
    if statement._group_by_clauses:
        raise QueryError("a GROUP BY statement groups per shard: pass aggregate=True to combine groups across shards")
    for column in statement.selected_columns:
        fn = _function(column)
        if fn is not None and _function_name(fn) in AGGREGATES | _OTHER_AGGREGATES:
            raise QueryError(
                f"{_function_name(fn)}() would be computed per shard: pass aggregate=True to combine it across shards"
            )
    sql = _statement_sql(statement)
    call = _AGGREGATE_CALL.search(sql)
    if call is not None or _WINDOW.search(sql):
        what = f"{call.group(1).lower()}()" if call is not None else "a window function (OVER)"
        raise QueryError(
            f"fan-out: {what} in this statement would be computed on each shard separately and the per-shard answers "
            f"concatenated; select count/sum/min/max/avg as columns with aggregate=True, or run it on one database"
        )
    if statement._distinct:
        raise QueryError(
            "fan-out: SELECT DISTINCT is distinct per shard (a value on two shards would come back twice): "
            "GROUP BY the columns with aggregate=True instead"
        )


@dataclass(frozen=True)
class _AggSpec:
    kind: str  # "group" or an aggregate name
    positions: tuple[int, ...]  # columns of the per-shard row it reads


def _refuse_uncombinable(kind: str, fn: FunctionElement[Any]) -> None:
    """Refuse count/sum/min/max/avg whose arguments' SQL holds anything a per-shard partial cannot carry."""
    call = _sql(fn)  # the whole call: a bare DISTINCT argument compiles (without a warning) only inside it
    arguments = call[call.find("(") + 1: call.rfind(")")]
    word = _NOT_COMBINABLE.search(arguments)
    if word is not None:
        found = word.group(1).upper()
        why = ("a value may be on several shards, each counts it once" if found == "DISTINCT"
               else "per-shard partials of it cannot be combined")
        raise QueryError(f"{kind}({found} ...) cannot be combined across shards ({why}): {kind}({arguments})")
    if _AGGREGATE_CALL.search(arguments):
        raise QueryError(f"{kind}() of an aggregate cannot be combined across shards: {kind}({arguments})")


def _aggregate_columns(
    statement: Select[Any],
) -> tuple[list[str], list[ColumnElement[Any]], list[_AggSpec], dict[int, Callable[[SqlDialect], ColumnElement[Any]]]]:
    """(result names, per-shard columns, how to combine each result column, the columns each
    dialect builds for itself).

    min/max of a string reads bytewise on every shard (:meth:`SqlDialect.bytewise`, ``COLLATE
    "C"`` on PostgreSQL): the combine step compares Python strings (code points), as the row
    merge does, and a shard answering in its own collation would make that a mix of two orders.
    """
    if statement._having_criteria:
        raise QueryError("fan-out aggregates cannot apply HAVING to per-shard partial groups; filter the combined rows")
    if statement._distinct:
        raise QueryError("fan-out aggregates do not support SELECT DISTINCT")
    for d in statement.column_descriptions:
        if d["entity"] is not None and d["expr"] is d["entity"]:
            raise QueryError(f"fan-out aggregates select columns, not the entity {d['name']}")
    groups = [_clause(g) for g in statement._group_by_clauses]
    names = list(statement.selected_columns.keys())
    shard_columns: list[ColumnElement[Any]] = []
    specs: list[_AggSpec] = []
    grouped: list[ColumnElement[Any]] = []
    bytewise: dict[int, Callable[[SqlDialect], ColumnElement[Any]]] = {}
    calls = 0
    for i, column in enumerate(statement.selected_columns):
        fn = _function(column)
        kind = None if fn is None else _function_name(fn)
        if fn is not None and kind in AGGREGATES:
            _refuse_uncombinable(kind, fn)
            calls += 1
            if kind == "avg":
                args = list(fn.clauses.clauses)
                pos = len(shard_columns)
                shard_columns += [func.sum(*args).label(f"_mdb_sum_{i}"), func.count(*args).label(f"_mdb_n_{i}")]
                specs.append(_AggSpec("avg", (pos, pos + 1)))
            else:
                specs.append(_AggSpec(kind, (len(shard_columns),)))
                args = list(fn.clauses.clauses)
                if kind in ("min", "max") and len(args) == 1 and _is_string(args[0]):
                    bytewise[len(shard_columns)] = partial(_bytewise_extreme, kind, args[0], names[i])
                shard_columns.append(column)
            continue
        inner = column.element if isinstance(column, Label) else column
        if not any(inner.compare(g) or column.compare(g) for g in groups):
            raise QueryError(
                f"cannot combine column {names[i]!r} across shards: select count/sum/min/max/avg or a GROUP BY expression"
            )
        grouped.append(inner)
        specs.append(_AggSpec("group", (len(shard_columns),)))
        shard_columns.append(column)
    for g in groups:
        if not any(g.compare(s) for s in grouped):
            raise QueryError(f"GROUP BY {g} must also be selected, so groups from different shards can be matched")
    sql = _statement_sql(statement)
    found = [m.group(1).lower() for m in _AGGREGATE_CALL.finditer(sql)]
    if len(found) != calls or _WINDOW.search(sql):  # one hides in a WHERE subquery, a join, a GROUP BY
        raise QueryError(
            f"fan-out aggregates combine count/sum/min/max/avg selected as columns; this statement also computes "
            f"{'a window function (OVER)' if _WINDOW.search(sql) else ', '.join(f + '()' for f in found)} elsewhere "
            f"(a subquery or expression), which would be computed per shard: run it on one database"
        )
    return names, shard_columns, specs, bytewise


def _bytewise_extreme(kind: str, arg: ColumnElement[Any], name: str, dialect: SqlDialect) -> ColumnElement[Any]:
    """``min``/``max`` of a string column in byte order on ``dialect``."""
    return cast(ColumnElement[Any], getattr(func, kind)(dialect.bytewise(arg)).label(name))


def _add(kind: str, acc: Any, value: Any) -> Any:
    if value is None:
        return acc
    if acc is None:
        return value
    if kind in ("count", "sum"):
        return acc + value
    if kind == "min":
        return value if value < acc else acc
    return value if value > acc else acc  # max


def _average(total: Any, count: int) -> Any:
    if not count or total is None:
        return None
    if isinstance(total, float):
        return total / count
    return Decimal(total) / Decimal(count)


def _aggregate_plan(
    statement: Select[Any], restricted: Select[Any],
) -> tuple[Callable[[SqlDialect], Select[Any]], Callable[[list[list[Row[Any]]]], list[Row[Any]]]]:
    """(per-dialect shard statement, combine) of an aggregate fan-out: per-shard partials, combined once."""
    names, shard_columns, specs, bytewise = _aggregate_columns(statement)
    orders = _orders(statement, statement.column_descriptions)
    limit, offset = _limits(statement)

    def build(dialect: SqlDialect) -> Select[Any]:
        columns = [c if (b := bytewise.get(i)) is None else b(dialect) for i, c in enumerate(shard_columns)]
        return restricted.with_only_columns(*columns, maintain_column_froms=True).order_by(None).limit(None).offset(None)

    def combine(per_shard: list[list[Row[Any]]]) -> list[Row[Any]]:
        return _combine(per_shard, names, specs, orders, offset, limit)

    return build, combine


def _combine(per_shard: list[list[Row[Any]]], names: list[str], specs: list[_AggSpec], orders: list[_Order],
             offset: int, limit: int | None) -> list[Row[Any]]:
    """Combine per-shard partial rows (grouped) into the answer, ordered and limited once."""
    group_positions = [s.positions[0] for s in specs if s.kind == "group"]
    combined: dict[tuple[Any, ...], list[Any]] = {}
    for row in chain.from_iterable(per_shard):
        key = tuple(row[p] for p in group_positions)
        acc = combined.get(key)
        if acc is None:
            acc = combined[key] = [None if s.kind != "avg" else [None, 0] for s in specs]
        for j, spec in enumerate(specs):
            if spec.kind == "group":
                acc[j] = row[spec.positions[0]]
            elif spec.kind == "avg":
                acc[j][0] = _add("sum", acc[j][0], row[spec.positions[0]])
                acc[j][1] += row[spec.positions[1]] or 0
            else:
                acc[j] = _add(spec.kind, acc[j], row[spec.positions[0]])
    tuples = []
    for acc in combined.values():
        tuples.append(tuple(
            _average(*value) if spec.kind == "avg" else (value or 0) if spec.kind == "count" else value
            for spec, value in zip(specs, acc)
        ))
    merged: IteratorResult[Any] = IteratorResult(SimpleResultMetaData(names), iter(tuples))  # rows of any shape
    rows = list(merged.all())
    if orders:
        rows.sort(key=_row_key(orders))
    return rows[offset: None if limit is None else offset + limit]
