"""``mdb migrate up|down`` over every area, whatever its servers are: one seam per way of migrating.

An area is migrated the way its servers' backend says (:class:`mdb.backends.Backend`
capabilities): SQL servers follow the area's Alembic history (:mod:`mdb.migrations.fleet`),
document servers are taken to the indexes their types declare (:mod:`mdb.migrations.documents`).
Each way is one :class:`AreaMigrations`; :func:`migrate_areas` runs them in :data:`MIGRATIONS`
order as one rollout (a failed server of one stops the next from starting), so the CLI prints
results and never orchestrates kinds itself. A new way of migrating is one more class here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from mdb.backends import Backend, backend_of
from mdb.cluster import Cluster
from mdb.errors import MigrationError
from mdb.migrations.documents import document_areas, document_targets, migrate_documents
from mdb.migrations.fleet import MigrationRun, ServerResult, Target, migrate, work_targets

__all__ = ["AreaMigrations", "DeclaredIndexes", "MIGRATIONS", "Request", "Rollout", "ScriptedHistories", "migrate_areas", "split_areas"]

OnDone = Callable[[ServerResult], None]
Progress = Callable[[str, int], AbstractContextManager[OnDone]]
"""Opens a progress display for (title, number of servers); yields the per-server callback."""


@dataclass(frozen=True)
class Request:
    """One ``migrate up|down`` as asked: None means every area (server) of that way."""

    root: Path
    direction: str
    to: str | None
    areas: list[str] | None
    servers: list[str] | None
    parallel: int
    dry_run: bool
    lock_timeout: float


class AreaMigrations(ABC):
    """How the areas whose servers share one capability are migrated."""

    name: ClassVar[str]
    """How a run of this way is reported (``histories``, ``documents``)."""

    @abstractmethod
    def serves(self, backend: Backend) -> bool:
        """Whether servers of ``backend`` are migrated this way."""

    @abstractmethod
    def owns(self, cluster: Cluster) -> set[str]:
        """The areas of ``cluster`` migrated this way."""

    @abstractmethod
    def title(self, direction: str) -> str:
        """The progress title of a run."""

    @abstractmethod
    def plan(self, cluster: Cluster, ask: Request) -> list[Target]:
        """The targets ``ask`` reaches (empty: nothing of this way to do); refuses what this way cannot do."""

    @abstractmethod
    def run(self, cluster: Cluster, ask: Request, canary: str | None, on_done: OnDone) -> MigrationRun:
        """Migrate the targets of ``ask``, ``canary`` first."""


class ScriptedHistories(AreaMigrations):
    """Areas on servers that follow an Alembic history: up and down, to any revision."""

    name = "histories"

    def serves(self, backend: Backend) -> bool:
        return backend.follows_histories

    def owns(self, cluster: Cluster) -> set[str]:
        documents = set(document_areas(cluster))
        return {a for a in cluster.router.area_names() if a not in documents}

    def title(self, direction: str) -> str:
        return f"migrate {direction}"

    def plan(self, cluster: Cluster, ask: Request) -> list[Target]:
        if ask.servers == []:
            return []
        return [t for t in work_targets(cluster, ask.root, ask.areas) if ask.servers is None or t.server in ask.servers]

    def run(self, cluster: Cluster, ask: Request, canary: str | None, on_done: OnDone) -> MigrationRun:
        return migrate(cluster, ask.root, direction=ask.direction, to=ask.to, areas=ask.areas, servers=ask.servers,
                       parallel=ask.parallel, canary=canary, dry_run=ask.dry_run, lock_timeout=ask.lock_timeout, on_done=on_done)


class DeclaredIndexes(AreaMigrations):
    """Areas whose servers have no history: ``up`` (without ``--to``) creates and drops the declared indexes."""

    name = "documents"

    def serves(self, backend: Backend) -> bool:
        return backend.declares_indexes

    def owns(self, cluster: Cluster) -> set[str]:
        return set(document_areas(cluster))

    def title(self, direction: str) -> str:
        return "migrate up (document indexes)"

    def plan(self, cluster: Cluster, ask: Request) -> list[Target]:
        if ask.areas and (ask.direction == "down" or ask.to is not None):
            raise MigrationError(f"document area(s) {', '.join(ask.areas)} have no revisions: `mdb migrate up` without --to "
                                 "takes them to the indexes their types declare (there is no down)")
        if ask.direction == "down" or ask.to is not None or ask.areas == [] or ask.servers == []:
            return []
        return [t for t in document_targets(cluster, ask.areas) if ask.servers is None or t.server in ask.servers]

    def run(self, cluster: Cluster, ask: Request, canary: str | None, on_done: OnDone) -> MigrationRun:
        return migrate_documents(cluster, areas=ask.areas, servers=ask.servers, parallel=ask.parallel, canary=canary,
                                 dry_run=ask.dry_run, on_done=on_done)


MIGRATIONS: tuple[AreaMigrations, ...] = (ScriptedHistories(), DeclaredIndexes())
"""Every way of migrating, in rollout order; the first also takes servers the map does not name
(it reports them) and runs, empty, when there is nothing at all to do."""


def split_areas(cluster: Cluster, areas: list[str] | None) -> dict[str, list[str] | None]:
    """``--area`` per way of migrating (None: every area of that way)."""
    if areas is None:
        return {m.name: None for m in MIGRATIONS}
    owned = {m.name: m.owns(cluster) for m in MIGRATIONS[1:]}
    out: dict[str, list[str] | None] = {m.name: [a for a in areas if a in owned[m.name]] for m in MIGRATIONS[1:]}
    taken = {a for chosen in out.values() for a in chosen or ()}
    out[MIGRATIONS[0].name] = [a for a in areas if a not in taken]
    return out


def _split_servers(cluster: Cluster, servers: list[str] | None) -> dict[str, list[str] | None]:
    """``--server`` per way of migrating, by each server's backend (None: every server)."""
    if servers is None:
        return {m.name: None for m in MIGRATIONS}
    out: dict[str, list[str] | None] = {}
    for m in MIGRATIONS[1:]:
        out[m.name] = [s for s in servers if s in cluster.map.servers and m.serves(backend_of(cluster.map, s))]
    taken = {s for chosen in out.values() for s in chosen or ()}
    out[MIGRATIONS[0].name] = [s for s in servers if s not in taken]
    return out


@dataclass
class Rollout:
    """The runs of one ``migrate up|down``, by way of migrating, in rollout order."""

    runs: dict[str, MigrationRun] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs.values())


def _no_progress(title: str, total: int) -> AbstractContextManager[OnDone]:
    return nullcontext(lambda result: None)


def migrate_areas(
    cluster: Cluster, ask: Request, *, canary: str | None = None, progress: Progress = _no_progress
) -> Rollout:
    """Run every way of migrating that ``ask`` reaches, in :data:`MIGRATIONS` order, as one rollout.

    A way starts only when every run before it succeeded (a failed server stops the rollout).
    The canary runs first in the way whose targets hold it; naming a server no way reaches is
    refused before any server is touched (the first way reports it when it is alone).
    """
    areas, servers = split_areas(cluster, ask.areas), _split_servers(cluster, ask.servers)
    asks = {m.name: Request(ask.root, ask.direction, ask.to, areas[m.name], servers[m.name], ask.parallel, ask.dry_run,
                            ask.lock_timeout) for m in MIGRATIONS}
    first, *others = MIGRATIONS
    work = {m.name: m.plan(cluster, asks[m.name]) for m in (*others, first)}
    others_work = any(work[m.name] for m in others)
    reached = {t.server for targets in work.values() for t in targets}
    if canary is not None and others_work and canary not in reached:
        raise MigrationError(f"canary {canary!r} is not a server of any area being migrated")
    rollout = Rollout()
    for m in MIGRATIONS:
        if m is first:
            go = bool(work[m.name]) or not others_work  # an empty run, too, when there is nothing at all
        else:
            go = bool(work[m.name]) and rollout.ok
        if not go:
            continue
        mine = canary if canary in {t.server for t in work[m.name]} or (m is first and not others_work) else None
        with progress(m.title(ask.direction), len(work[m.name])) as on_done:
            rollout.runs[m.name] = m.run(cluster, asks[m.name], mine, on_done)
    return rollout
