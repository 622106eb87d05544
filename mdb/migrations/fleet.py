"""``status``, ``up`` and ``down`` of the areas' migration histories over every SQL server of a map.

Which servers: every SQL server that holds an area's tables, that is the area's shards, the
spare servers (in no area: ``schema apply`` gives them every area's tables so they can receive
moves) and the servers briefcases of the area were relocated to. A server is migrated once per
area, in its own transaction (PostgreSQL DDL is transactional: a server is at the old revision
or the new one, never half-way), with ``SET LOCAL lock_timeout`` so that an ALTER TABLE that
must wait behind a long transaction gives up instead of queueing every write behind it.

Order: the canary first, alone; if it fails nothing else starts. Then the rest, ``parallel`` at
a time; the first failure stops new starts, the ones running finish, and every server gets an
outcome (``done``, ``already`` at the target, ``failed`` with the reason, ``not started``).

Crash safety needs no bookkeeping of its own: each server's version table is the truth, read
again by every run, so a rerun after SIGKILL migrates exactly the servers not yet at the
target. The ledger in CENTRAL (:mod:`mdb.migrations.ledger`) records runs for people.

Threads: Alembic revision files call ``alembic.op``, a module-level proxy that Alembic points at
one migration at a time. Several servers migrating at once in threads would share it, so this
module points it, once, at a dispatcher that finds the current thread's migration.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RangeNotAncestorError, RevisionError
from alembic.util.exc import CommandError
from sqlalchemy.exc import DBAPIError

from mdb.backends import Backend, backend_of
from mdb.cluster import Cluster
from mdb.dberrors import describe
from mdb.dialects import sql_dialect
from mdb.errors import MdbError, MigrationError
from mdb.faults import fault_point, register
from mdb.migrations import ledger
from mdb.migrations.revisions import current_revision, lock_out_moves, version_table
from mdb.migrations.scripts import area_dir, area_tables, one_head, open_history
from mdb.parallel import DEFAULT_PARALLEL, run_each
from mdb.schema_diff import Difference, compare_tables

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "MigrationRun",
    "ServerResult",
    "ServerStatus",
    "Target",
    "fleet_status",
    "migrate",
    "roll_out",
    "targets",
    "work_targets",
]

FAULT_POINTS = register("migrate.after_server")
"""Crash points of a fleet migration (:mod:`mdb.faults`): after a server reached its target, before the next."""

DEFAULT_LOCK_TIMEOUT: Final = 5.0
"""Seconds a migration statement may wait for a lock before the server's migration fails."""

DONE, ALREADY, FAILED, NOT_STARTED, PLANNED = "done", "already", "failed", "not started", "planned"


@dataclass(frozen=True)
class Target:
    """One area's tables on one server, and why the server has them."""

    area: str
    server: str
    roles: tuple[str, ...]


def _spares(cluster: Cluster) -> list[str]:
    router = cluster.router
    used = set(router.central_servers())
    for area in router.area_names():
        used.update(router.area_servers(area))
    return [s for s in cluster.map.servers if s not in used]


def targets(
    cluster: Cluster, areas: list[str] | None = None, capable: Callable[[Backend], bool] = lambda b: b.follows_histories
) -> list[Target]:
    """Every (area, server of ``kind``) holding the area's tables (collections): shards, spares, relocation targets; map order."""
    router = cluster.router
    spares = _spares(cluster)
    out: list[Target] = []
    for area in areas if areas is not None else router.area_names():
        roles: dict[str, list[str]] = {}

        def add(server: str, role: str) -> None:
            if role not in roles.setdefault(server, []):
                roles[server].append(role)

        for server in router.area_servers(area):
            add(server, "shard")
        for server in spares:
            add(server, "spare")
        for moved_area, server in sorted(router.relocation_reach):
            if moved_area == area:
                add(server, "relocation target")
        out += [Target(area, s, tuple(r)) for s, r in roles.items() if capable(backend_of(cluster.map, s))]
    return out


def work_targets(cluster: Cluster, root: Path, areas: list[str] | None = None) -> list[Target]:
    """The targets ``fleet_status`` and ``migrate`` work on: those of ``areas`` (default: every area with a history)."""
    return targets(cluster, list(_histories(cluster, root, areas)))


def _histories(cluster: Cluster, root: Path, areas: list[str] | None) -> dict[str, ScriptDirectory]:
    """The script directory of every area asked for (or every area that has one)."""
    names = areas if areas is not None else cluster.router.area_names()
    unknown = [a for a in names if a not in cluster.router.area_names()]
    if unknown:
        raise MigrationError(f"unknown area(s) {', '.join(unknown)} (the map has {', '.join(cluster.router.area_names())})")
    if areas is not None:
        return {a: open_history(root, a) for a in names}
    return {a: open_history(root, a) for a in names if (area_dir(root, a) / "versions").is_dir()}


def _pending(script: ScriptDirectory, area: str, current: str | None, upper: str | None) -> list[str]:
    """Revisions from ``current`` (exclusive) up to ``upper``, oldest first."""
    if upper is None or current == upper:
        return []
    try:
        revisions = list(script.iterate_revisions(upper, current or "base"))
    except (CommandError, RevisionError) as exc:
        raise MigrationError(f"area {area!r}: cannot go from revision {current or 'base'} to {upper} with the history at {script.dir}: {exc}") from exc
    return [r.revision for r in reversed(revisions) if r.revision != current]


def _beyond(script: ScriptDirectory, area: str, lower: str | None, upper: str | None) -> bool:
    """True when ``lower`` is a descendant of ``upper`` (strictly): the server is past the target."""
    if lower == upper or lower is None:
        return False
    try:
        return bool(list(script.iterate_revisions(lower, upper or "base")))
    except RangeNotAncestorError:  # the answer "no": lower is not above upper
        return False


def _failure(server: str, exc: Exception) -> str:
    if isinstance(exc, DBAPIError):
        return f"server {server!r}: {describe(exc)}"
    if isinstance(exc, RevisionError):  # the server is at a revision this history does not have
        return f"server {server!r}: {exc}"
    return str(exc)


# -- status ------------------------------------------------------------------------------------


@dataclass
class ServerStatus:
    area: str
    server: str
    roles: tuple[str, ...]
    current: str | None = None
    head: str | None = None
    pending: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    drift_checked: bool = False
    """True when the tables were compared with the models (the server is at head: the models are the head)."""
    error: str | None = None
    replica: bool = False
    """The server's read-only replica (read, never migrated: it replays what its primary ran)."""
    read: bool = False
    """True once ``current`` was read off the server (``current`` None is then base, not unknown)."""

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.pending:
            return "behind"
        if self.differences:
            return "drift"
        return "at head"

    @property
    def ok(self) -> bool:
        return self.state == "at head"


@dataclass
class FleetStatus:
    heads: dict[str, str | None]
    servers: list[ServerStatus]
    last_run: list[ledger.LedgerRow]

    @property
    def mixed(self) -> bool:
        """True when the servers of one area are at different revisions (a rollout under way or stopped)."""
        by_area: dict[str, set[str | None]] = {}
        for s in self.servers:
            if s.error is None:
                by_area.setdefault(s.area, set()).add(s.current)
        return any(len(revisions) > 1 for revisions in by_area.values())


def _central_sql(cluster: Cluster) -> str | None:
    """The CENTRAL server that keeps the ledger, or None when CENTRAL keeps no records (MongoDB: no ledger then)."""
    central = cluster.router.central_servers()
    return central[0] if central and backend_of(cluster.map, central[0]).keeps_records else None


def fleet_status(
    cluster: Cluster, root: Path, *, areas: list[str] | None = None, parallel: int = DEFAULT_PARALLEL,
    on_done: Callable[[ServerStatus], None] | None = None,
) -> FleetStatus:
    """Every target's revision, its pending revisions and, at head, its drift from the models.

    A server with a replica is listed twice, the second time read on the replica (``replica``):
    a replica that lags shows the revision it has replayed so far.

    A fleet at mixed revisions is a state, not an error; a server that cannot be read is
    reported with the reason and the others are still read.
    """
    histories = _histories(cluster, root, areas)
    heads = {area: one_head(script, area) for area, script in histories.items()}
    tables = {area: area_tables(cluster, area) for area in histories}

    def one(item: tuple[Target, bool]) -> ServerStatus:
        target, replica = item
        status = ServerStatus(target.area, target.server, target.roles, head=heads[target.area], replica=replica)
        try:
            with cluster.transaction(target.server, readonly=replica) as conn:
                status.current = current_revision(conn, target.area)
                status.read = True
                status.pending = _pending(histories[target.area], target.area, status.current, status.head)
                if status.current == status.head:
                    status.differences = compare_tables(conn, tables[target.area])
                    status.drift_checked = True
        except (MdbError, DBAPIError) as exc:
            status.error = _failure(target.server, exc)
        return status

    items = [(t, replica) for t in targets(cluster, list(histories))
             for replica in (False, True) if not replica or cluster.engines.has_replica(t.server)]
    servers = run_each(items, one, parallel=parallel, on_done=on_done, name="mdb-migrate-status")
    central = _central_sql(cluster)
    last: list[ledger.LedgerRow] = []
    if central is not None:
        with cluster.transaction(central) as conn:
            last = ledger.last_run(conn)
    return FleetStatus(heads, servers, last)


# -- up and down -------------------------------------------------------------------------------


class _ThreadOperations:
    """``alembic.op`` for the migration running in the calling thread (see the module docstring)."""

    local = threading.local()

    def __getattr__(self, name: str) -> Any:
        operations = getattr(self.local, "operations", None)
        if operations is None:
            raise RuntimeError(f"alembic.op.{name} called outside a migration run by mdb.migrations")
        return getattr(operations, name)


_DISPATCH = _ThreadOperations()
_install_lock = threading.Lock()


def _install_dispatch() -> None:
    """Point ``alembic.op`` at :data:`_DISPATCH` (again: ``Operations.context`` elsewhere resets it)."""
    with _install_lock:
        _, modules = Operations._setups[Operations]
        for globals_, _ in modules:
            globals_["_proxy"] = _DISPATCH


@contextmanager
def _operations(context: MigrationContext) -> Iterator[None]:
    _DISPATCH.local.operations = Operations(context)
    try:
        yield
    finally:
        _DISPATCH.local.operations = None


@dataclass
class ServerResult:
    area: str
    server: str
    roles: tuple[str, ...]
    target: str | None
    before: str | None = None
    after: str | None = None
    outcome: str = NOT_STARTED
    steps: list[str] = field(default_factory=list)
    """The revisions run (or, in a dry run, to run), in order."""
    detail: str | None = None
    seconds: float = 0.0
    before_read: bool = False
    """True once ``before`` was read off the server (``before`` None is then base, not unknown)."""

    @property
    def ok(self) -> bool:
        return self.outcome in (DONE, ALREADY, PLANNED)

    @property
    def after_known(self) -> bool:
        """True when ``after`` is the server's revision: it ran, or was already there, or (a dry run) stays."""
        return self.ok


@dataclass
class MigrationRun:
    run_id: str
    direction: str
    targets: dict[str, str | None]
    """Area -> the revision it is taken to (None: base, every revision undone)."""
    results: list[ServerResult]
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[ServerResult]:
        return [r for r in self.results if r.outcome == FAILED]


def _resolve(script: ScriptDirectory, area: str, wanted: str | None, direction: str) -> str | None:
    """The revision id ``wanted`` names (head when None going up; "base" is None)."""
    if wanted is None:
        if direction == "down":
            raise MigrationError("mdb migrate down needs --to REV (or --to base)")
        return one_head(script, area)
    if wanted == "base":
        return None
    try:
        revision = script.get_revision(wanted)
    except CommandError as exc:
        raise MigrationError(f"area {area!r}: {exc}") from exc
    if revision is None:
        return None
    return revision.revision


def _lock_timeout_ms(seconds: float) -> int:
    if seconds <= 0:
        raise MigrationError(f"lock timeout must be positive, got {seconds:g}s")
    return int(seconds * 1000)


def _migrate_one(
    cluster: Cluster, script: ScriptDirectory, target: Target, destination: str | None, direction: str,
    lock_timeout: float, dry_run: bool,
) -> ServerResult:
    """Take one area on one server to ``destination`` in one transaction; the failure is in the result."""
    result = ServerResult(target.area, target.server, target.roles, destination)
    started = time.monotonic()
    try:
        with cluster.transaction(target.server) as conn:
            sql_dialect(conn).lock_timeout(conn, _lock_timeout_ms(lock_timeout))  # never queue behind a long transaction
            lock_out_moves(conn, target.server)
            result.before = current_revision(conn, target.area)
            result.before_read = True
            lower, upper = (result.before, destination) if direction == "up" else (destination, result.before)
            if _beyond(script, target.area, lower, upper):  # e.g. `up --to a1` on a server at b2: left alone
                result.outcome, result.after = ALREADY, result.before
                result.detail = f"at {result.before or 'base'}, already past {destination or 'base'} going {direction}"
                return result
            result.steps = _pending(script, target.area, lower, upper)
            if direction == "down":
                result.steps.reverse()
            if not result.steps:
                result.outcome, result.after = ALREADY, result.before
                return result
            if dry_run:
                result.outcome, result.after = PLANNED, result.before
                return result

            def steps(revision: Any, _context: MigrationContext) -> Any:
                if direction == "up":
                    return script._upgrade_revs(destination or "base", revision)
                return script._downgrade_revs(destination or "base", revision)

            context = MigrationContext.configure(conn, opts={
                "version_table": version_table(target.area), "script": script, "fn": steps, "transactional_ddl": True,
            })
            with _operations(context):
                try:
                    context.run_migrations()
                except DBAPIError as exc:  # the revision's SQL failed here: name that, not a schema-apply hint
                    raise MigrationError(
                        f"server {target.server!r}: the revision's SQL failed: {describe(exc)} "
                        "(fix the revision; this server's transaction rolled back)"
                    ) from exc
                except (MdbError, CommandError):
                    raise
                except Exception as exc:  # the revision file's own code failed (it is application code): this server failed
                    raise MigrationError(f"server {target.server!r}: the revision raised {type(exc).__name__}: {exc}") from exc
            result.after = current_revision(conn, target.area)
        result.outcome = DONE
        fault_point("migrate.after_server")
    except (MdbError, DBAPIError, CommandError, RevisionError) as exc:
        result.outcome, result.detail = FAILED, _failure(target.server, exc)
    finally:
        result.seconds = time.monotonic() - started
    return result


def migrate(
    cluster: Cluster,
    root: Path,
    *,
    direction: str = "up",
    to: str | None = None,
    areas: list[str] | None = None,
    servers: list[str] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    canary: str | None = None,
    dry_run: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    on_done: Callable[[ServerResult], None] | None = None,
) -> MigrationRun:
    """Take every target of ``areas`` (default: every area with a history) up or down to ``to``.

    ``to`` defaults to head going up; going down it is required (a revision, or ``base``), and
    with several areas it must name a revision of each, so give ``areas`` then. The canary (a
    server name) runs first and alone. ``servers`` limits the run to those servers (a move
    bringing its target to the source's revision). Returns every target's outcome in map order.
    """
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    histories = _histories(cluster, root, areas)
    if to not in (None, "head", "heads", "base") and len(histories) > 1:
        raise MigrationError(f"--to {to} names one area's revision: say which area (--area; the map has {', '.join(histories)})")
    destinations = {area: _resolve(script, area, to, direction) for area, script in histories.items()}
    _lock_timeout_ms(lock_timeout)  # a bad value fails before any server is touched
    work = targets(cluster, list(histories))
    if servers is not None:
        unknown = sorted(set(servers) - {t.server for t in work})
        if unknown:
            raise MigrationError(f"server(s) {', '.join(unknown)} hold no tables of the areas being migrated")
        work = [t for t in work if t.server in servers]
    run = MigrationRun(uuid.uuid4().hex, direction, destinations, [], dry_run)
    _install_dispatch()

    def one(target: Target) -> ServerResult:
        return _migrate_one(cluster, histories[target.area], target, destinations[target.area], direction, lock_timeout, dry_run)

    roll_out(cluster, run, work, one, parallel=parallel, canary=canary, on_done=on_done)
    return run


def roll_out(
    cluster: Cluster,
    run: MigrationRun,
    work: list[Target],
    one: Callable[[Target], ServerResult],
    *,
    parallel: int = DEFAULT_PARALLEL,
    canary: str | None = None,
    on_done: Callable[[ServerResult], None] | None = None,
) -> None:
    """The fleet loop of every kind of migration: ``one`` on each target, canary first, stop on failure.

    The canary's targets run first and alone; if one fails nothing else starts. Then the rest,
    ``parallel`` at a time; the first failure stops new starts, the running ones finish, and
    every target gets an outcome (``not started`` for the ones never begun). ``one`` reports a
    server's failure in its result (outcome ``failed``); what it raises is a bug or an
    interrupt. Unless ``run`` is a dry run, the ledger in CENTRAL gets one ``pending`` row per
    target before the first starts (target: ``run.targets[area]``) and each row's outcome as it
    ends. Fills ``run.results`` in the order of ``work``.
    """
    if canary is not None and canary not in {t.server for t in work}:
        raise MigrationError(f"canary {canary!r} is not a server of any area being migrated")
    central = None if run.dry_run else _central_sql(cluster)
    if central is not None:
        with cluster.transaction(central) as conn:
            ledger.start(conn, run.run_id, run.direction, [(t.area, t.server, run.targets[t.area]) for t in work])
    stop = threading.Event()

    def guarded(target: Target) -> ServerResult:
        if stop.is_set():
            return ServerResult(target.area, target.server, target.roles, run.targets[target.area],
                                detail="not started: an earlier server failed")
        result = one(target)
        if result.outcome == FAILED:
            stop.set()
        return result

    def done(result: ServerResult) -> None:
        try:
            if central is not None:
                with cluster.transaction(central) as conn:
                    ledger.finish(conn, run.run_id, result.area, result.server, result.outcome, result.before, result.detail)
            if on_done is not None:
                on_done(result)
        except BaseException:
            stop.set()  # the pool still drains what it was given: start none of it (CENTRAL down, Ctrl-C)
            raise

    first = [t for t in work if t.server == canary]
    rest = [t for t in work if t.server != canary]
    by_key: dict[tuple[str, str], ServerResult] = {}
    for result in run_each(first, guarded, parallel=1, on_done=done, name="mdb-migrate-canary"):
        by_key[(result.area, result.server)] = result
    for result in run_each(rest, guarded, parallel=parallel, on_done=done, name="mdb-migrate"):
        by_key[(result.area, result.server)] = result
    run.results = [by_key[(t.area, t.server)] for t in work]

