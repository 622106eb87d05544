"""Creating mdb's tables and the briefcase tables on every shard, and the first layout stamp.

``apply_schema`` is idempotent and does ``parallel`` shards at a time (a shard's work is mostly
waiting on its server; 1,000 shards one by one took minutes): a shard that is down is reported
and the others proceed. Reports come back in map order whatever order the shards finished in. It stamps a shard's layout only where the shard has none yet for an area;
changing an existing stamp is a map change and belongs to ``mdb map apply`` (edit safety).
Servers that no area uses yet are prepared for every area, so they can receive moves.

Every SQL server's database is checked against its identity in CENTRAL first
(:mod:`mdb.maps.identity`): a URL that reaches a database other than the one CENTRAL recorded
for the server name is refused for that server before anything is created or stamped there, so
a mistyped URL never makes an empty database take over a server's slot. A name CENTRAL never
recorded (a new server, a fleet from before identities) is adopted: its database gets an
identity and CENTRAL records it.

Creating only what is missing would let an existing table that no longer matches its model
pass as "ok", and the first write would fail instead. So every run, and ``check_schema``
without creating anything, compares each server's tables with the models
(:mod:`mdb.schema_diff`) and reports every difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sqlalchemy import Table
from sqlalchemy.exc import DBAPIError

from mdb.backends import ServerSchema, backend_of, servers_where
from mdb.backends.sql import create_tables, stamp_layout
from mdb.briefcase import registered_types
from mdb.dberrors import describe
from mdb.errors import MdbError
from mdb.maps.identity import Recorded, ensure_on, identity_problem, read_identity, record_identities, recorded_identities
from mdb.ownership import check_helpers_missing
from mdb.parallel import DEFAULT_PARALLEL, run_each
from mdb.router import Router, ShardLayout
from mdb.schema_diff import Difference, compare_tables
from mdb.store import Store
from mdb.system_tables import CHECK_VERSION_TABLE, load_system_tables, on_demand_metadata, version_table

__all__ = ["ShardReport", "apply_schema", "check_schema", "create_tables", "known_tables", "server_tables", "stamp_layout"]


@dataclass
class ShardReport:
    server: str
    url: str
    roles: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    stamped: list[str] = field(default_factory=list)
    """Areas whose layout stamp this run wrote."""
    kept: list[str] = field(default_factory=list)
    """Areas already stamped with the same layout (nothing written)."""
    problems: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    """How the server's tables differ from the models (after this run created what was missing)."""
    error: str | None = None
    identity: str | None = None
    """The identity of the database the server's URL reaches (SQL servers; after the run)."""
    notes: list[str] = field(default_factory=list)
    """What ``schema check`` found that is worth a line but is not drift (the report stays ok)."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems and not self.differences


def _tables_for(store: Store, areas: Iterable[str]) -> list[Table]:
    return [t for area in areas for btype in store.types_of(area) for t in btype.tables]


def server_tables(
    store: Store, router: Router, server: str, server_layouts: Iterable[ShardLayout]
) -> tuple[list[str], list[Table]]:
    """(roles, tables) of ``server`` under ``router``'s map; ``store`` supplies the briefcase types.

    Shared by ``apply_schema`` and ``mdb map apply`` (which prepares the servers a new map adds).
    """
    shard_md, central_md = load_system_tables()
    all_areas = router.area_names()
    is_central = server in router.central_servers()
    areas = [layout.area for layout in server_layouts if layout.area in all_areas]
    roles = (["central"] if is_central else []) + areas
    if not roles:
        roles.append("spare")
        areas = all_areas
    tables = list(shard_md.sorted_tables)
    if is_central:
        tables += list(central_md.sorted_tables)
    tables += _tables_for(store, areas)
    return roles, tables


def known_tables(store: Store) -> set[str]:
    """Every table mdb knows of: its own and every briefcase type's, in any area.

    A table on a server outside this set is reported as extra; a table of another area (a spare
    that became a user shard keeps the tables of every area) is not, nor one of a type this
    process declared but did not give the Store.
    """
    shard_md, central_md = load_system_tables()
    types = {*store.types, *registered_types(store.registry)}
    versions = {version_table(area) for area in store.map.areas}  # `mdb migrate`'s, one per area
    return {*shard_md.tables, *central_md.tables, *on_demand_metadata.tables, *versions, CHECK_VERSION_TABLE,
            *(t.name for btype in types for t in btype.tables)}


def _server_plan(store: Store) -> tuple[Router, dict[str, list[ShardLayout]]]:
    router = Router(store.map)  # layouts only: relocations do not matter here
    layouts: dict[str, list[ShardLayout]] = {}
    for server, layout in router.layouts():
        layouts.setdefault(server, []).append(layout)
    return router, layouts


def _shard_failed(server: str, report: ShardReport, exc: Exception) -> None:
    """Record a shard's failure on its report; the others proceed."""
    if isinstance(exc, MdbError):
        report.error = str(exc)
    elif isinstance(exc, DBAPIError):  # e.g. permission denied
        report.error = f"server {server!r}: {describe(exc)}"
    else:
        raise exc


def check_schema(
    store: Store, *, parallel: int = DEFAULT_PARALLEL, on_done: Callable[[ShardReport], None] | None = None
) -> list[ShardReport]:
    """Compare every SQL server's tables with the models, creating and writing nothing.

    MongoDB servers are left out (their collections have no columns to drift). ``parallel``
    servers at a time; ``on_done`` sees each report as it is finished (a progress bar).
    """
    router, layouts = _server_plan(store)
    known = known_tables(store)

    def one(server: str) -> ShardReport:
        report = ShardReport(server, store.engines.masked_url(server))
        report.roles, tables = server_tables(store, router, server, layouts.get(server, []))
        try:
            with store.transaction(server) as conn:
                report.differences = compare_tables(conn, tables, known=known)
                missing = check_helpers_missing(conn)
                backend = conn.dialect.name
            if missing:
                _helpers_missing(report, backend, store.engines.spec(server).pooler == "transaction", missing)
        except (MdbError, DBAPIError) as exc:
            _shard_failed(server, report, exc)
        return report

    servers = servers_where(store.map, lambda b: b.checks_drift)
    return run_each(servers, one, parallel=parallel, on_done=on_done, name="mdb-schema-check")


def _helpers_missing(report: ShardReport, backend: str, pooled: bool, missing: list[str]) -> None:
    """Report the ownership check's helpers a server lacks (:func:`mdb.ownership.check_helpers_missing`)
    by what their absence does: on SQLite sessions read the whole check every time (a note: safe,
    slower); on PostgreSQL only sessions through a transaction pooler call the check functions, and
    fail without them (a problem on a server the map puts behind one, a note on the others)."""
    what = f"the ownership check's helpers are missing or outdated ({', '.join(missing)})"
    if backend == "sqlite":
        report.notes.append(f"{what}: its sessions read the whole check every time (safe, slower); `mdb schema apply` installs them")
    elif pooled:
        report.problems.append(f"{what}: sessions through its transaction pooler call them and fail without them; "
                               "`mdb schema apply` installs them")
    else:
        report.notes.append(f"{what}: only sessions through a transaction pooler call them (the map puts this server "
                            "behind none); `mdb schema apply` installs them")


def _server_schema(
    store: Store, router: Router, server: str, layouts: list[ShardLayout], known: set[str]
) -> tuple[list[str], ServerSchema]:
    """(roles, what ``server`` must hold) under ``router``'s map, in the terms of the server's kind."""
    if backend_of(store.map, server).holds_documents:
        from mdb.mongo.schema import server_collections  # late: pymongo is an optional dependency

        roles, collections = server_collections(store.mongo, router, server, layouts)
        return roles, ServerSchema(layouts, store.map.version, collections=collections)
    roles, tables = server_tables(store, router, server, layouts)
    return roles, ServerSchema(layouts, store.map.version, tables=tables, known_tables=known)


def _identity_refusal(store: Store, server: str, recorded: Recorded | None) -> str | None:
    """Why ``server``'s URL reaches a database that is not the one CENTRAL recorded for it, or None."""
    if recorded is None:
        return None  # adopted after the run: nothing to compare with
    with store.transaction(server) as conn:
        live = read_identity(conn)
    return identity_problem(server, store.engines.masked_url(server), live, recorded)


def _apply_server(
    store: Store, router: Router, server: str, layouts: list[ShardLayout], known: set[str],
    records: dict[str, Recorded] | None,
) -> ShardReport:
    """One server's part of ``apply_schema``, done by its backend: its failure is recorded on its report.

    ``records``: CENTRAL's identity records (None: CENTRAL could not be read, so no SQL server is touched).
    """
    report = ShardReport(server, store.engines.masked_url(server))
    backend = backend_of(store.map, server)
    report.roles, schema = _server_schema(store, router, server, layouts, known)
    try:
        if backend.has_identity:
            if records is None:
                raise MdbError(f"server {server!r}: not applied: CENTRAL's record of server identities could not be read")
            refusal = _identity_refusal(store, server, records.get(server))
            if refusal is not None:
                report.error = refusal + "; nothing was created or stamped there"
                return report
        outcome = backend.apply_schema(store, server, schema)
        if backend.has_identity:
            report.identity = ensure_on(store, server)
    except Exception as exc:  # this shard's failure, the others proceed
        translated = backend.translate(store, server, exc)
        _shard_failed(server, report, exc if translated is None else translated)
        return report
    report.created, report.stamped, report.kept = outcome.created, outcome.stamped, outcome.kept
    report.problems, report.differences = outcome.problems, outcome.differences
    return report


def apply_schema(
    store: Store, *, parallel: int = DEFAULT_PARALLEL, on_done: Callable[[ShardReport], None] | None = None
) -> list[ShardReport]:
    """Create what is missing on every server, stamp new layouts, and report every drift.

    ``parallel`` servers at a time (1: one by one); ``on_done`` sees each report as it is
    finished, in the calling thread (a progress bar). Reports are in map order.
    """
    router, layouts = _server_plan(store)
    known = known_tables(store)
    records: dict[str, Recorded] | None
    try:
        records = recorded_identities(store)
    except (MdbError, DBAPIError):  # CENTRAL down: no SQL server is touched (each report says so)
        records = None
    # Two server names for one database are done one after the other: concurrent CREATE TABLEs
    # of the same table would make one of them fail.
    same_database: dict[str, list[str]] = {}
    for server, spec in store.map.servers.items():
        same_database.setdefault(spec.primary, []).append(server)

    def group(servers: list[str]) -> list[ShardReport]:
        return [_apply_server(store, router, s, layouts.get(s, []), known, records) for s in servers]

    def done(reports: list[ShardReport]) -> None:
        for report in reports:
            if on_done is not None:
                on_done(report)

    by_server = {
        r.server: r
        for reports in run_each(list(same_database.values()), group, parallel=parallel, on_done=done, name="mdb-schema-apply")
        for r in reports
    }
    reports = [by_server[s] for s in store.map.servers]
    if records is not None:  # adopt the names CENTRAL never recorded, now that their databases carry an identity
        record_identities(store, {
            r.server: (r.identity, store.map.servers[r.server].masked_primary)
            for r in reports if r.identity is not None and r.server not in records
        })
    return reports
