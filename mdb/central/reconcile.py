"""``mdb central check`` / ``repair``: find and fix index entries and briefcases out of step.

The check reads every entry of the given indexes from every CENTRAL shard and every root row of
their briefcase types from every shard of their areas (one query per server each), then
compares, with the same rule readers use: an entry is valid when its briefcase exists and the
root column, normalized, equals the key. Problems:

- ``dangling``: the entry's briefcase does not exist (a creation that crashed after reserving);
- ``stale``: the briefcase exists but its root carries another key (a crashed rename, or an
  application that changed the column without :meth:`Central.rename`);
- ``unfinished``: a pending entry the root confirms (a creation that crashed after writing);
- ``missing``: a root carries a key that no entry maps to its GDID;
- ``conflict``: two briefcases' roots carry one unique key; repair cannot choose, it reports.
- ``unreachable``: the entry's briefcase is on a shard that did not answer, or that answered
  with the wrong identity (its URL reaches a database other than the one CENTRAL recorded for
  it, :mod:`mdb.maps.identity`). Its briefcase is not known to be missing, only out of sight,
  so repair never deletes such an entry; it reports it until the shard is back.

An entry is only ``dangling`` when the shard the router places its briefcase on was read and
is the database CENTRAL knows under that name.

Pending entries younger than the grace period and not confirmed are creations in flight: listed
as ``in_progress``, not counted as problems. Repair: unfinished -> live, dangling and stale ->
deleted, missing -> inserted live. Run it while no moves are in progress (the root scan reads
shards directly and skips rows the router places elsewhere).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import DBAPIError

from mdb.briefcase import BriefcaseType
from mdb.central.indexes import STATE_LIVE, STATE_PENDING, CentralIndex, IndexRow, central_index
from mdb.central.service import Central
from mdb.errors import DuplicateRowError, MdbError
from mdb.gdid import GDID
from mdb.maps.identity import Recorded, identity_problem, read_identity, recorded_identities
from mdb.parallel import DEFAULT_PARALLEL, run_each

__all__ = ["CheckReport", "Problem", "check", "repair"]

PROBLEM_KINDS = ("dangling", "stale", "unfinished", "missing", "conflict", "unreachable")


@dataclass(frozen=True)
class Problem:
    kind: str
    index: str
    key: str
    gdid: GDID
    state: str | None
    detail: str

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gdid"] = str(self.gdid)
        return out


@dataclass
class CheckReport:
    indexes: list[str]
    entries: int = 0
    briefcases: int = 0
    problems: list[Problem] = field(default_factory=list)
    in_progress: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        c = Counter(p.kind for p in self.problems)
        return {kind: c.get(kind, 0) for kind in PROBLEM_KINDS}

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "indexes": self.indexes,
            "entries": self.entries,
            "briefcases": self.briefcases,
            "counts": self.counts(),
            "in_progress": len(self.in_progress),
            "problems": [p.as_json() for p in self.problems],
        }


@dataclass
class RepairReport:
    before: CheckReport
    fixed: Counter[str] = field(default_factory=Counter)
    unresolved: list[Problem] = field(default_factory=list)
    after: CheckReport | None = None


def _entries(central: Central, names: list[str], parallel: int) -> list[IndexRow]:
    c = central_index.c
    stmt = select(c.index_name, c.key, c.slot, c.gdid, c.state, c.created_at).where(c.index_name.in_(names))

    def read(server: str) -> list[IndexRow]:
        with central.cluster.transaction(server) as conn:
            return [IndexRow(*r) for r in conn.execute(stmt)]

    per_server = run_each(list(central.cluster.router.central_servers()), read, parallel=parallel, name="mdb-central-check")
    return [row for rows in per_server for row in rows]


def _roots(
    central: Central, btype: type[BriefcaseType], columns: list[str], parallel: int,
    records: dict[str, Recorded], unread: dict[str, str],
) -> dict[GDID, dict[str, Any]]:
    """Every root row of ``btype`` where the router places it: gdid -> {column: value}.

    ``parallel`` shards are read at a time: each read is mostly waiting on its server. A shard
    that does not answer, or whose URL reaches a database other than the one CENTRAL recorded
    for it, is not read: it goes into ``unread`` (server -> why), and its briefcases are unknown.
    """
    router = central.cluster.router
    table = btype.tables[0]
    key = table.c[btype.key]
    servers = list(dict.fromkeys([
        *router.area_servers(btype.area),
        *(s for area, s in sorted(router.relocation_reach) if area == btype.area),
    ]))
    stmt = select(key, *(table.c[name] for name in columns))

    def read(server: str) -> tuple[str, dict[GDID, dict[str, Any]] | str]:
        found: dict[GDID, dict[str, Any]] = {}
        try:
            with central.cluster.transaction(server, readonly=False) as conn:
                problem = identity_problem(server, central.cluster.engines.masked_url(server), read_identity(conn),
                                           records.get(server))
                if problem is not None:
                    return server, problem
                for row in conn.execute(stmt):
                    gdid = row[0]
                    if router.locate(btype.area, gdid).server == server:
                        found[gdid] = dict(zip(columns, row[1:]))
        except (MdbError, DBAPIError) as exc:  # reported per entry as "unreachable", never taken for "dangling"
            return server, f"server {server!r} did not answer: {exc}"
        return server, found

    out: dict[GDID, dict[str, Any]] = {}
    for server, result in run_each(servers, read, parallel=parallel, name="mdb-central-check"):
        if isinstance(result, str):
            unread[server] = result
        else:
            out.update(result)  # a GDID is kept only from the one server the router places it on
    return out


def _normalized(index: type[CentralIndex], value: Any) -> str | None:
    if value is None:
        return None
    try:
        return index.key_of(value)
    except ValueError:
        return None


def check(
    central: Central, indexes: Iterable[type[CentralIndex]], *, grace: float | None = None, parallel: int = DEFAULT_PARALLEL
) -> CheckReport:
    """Every problem of ``indexes``' entries, reading ``parallel`` servers at a time."""
    grace = central.grace if grace is None else grace
    idx_list = sorted({central.index(i) for i in indexes}, key=lambda i: i.name)
    report = CheckReport([i.name for i in idx_list])
    if not idx_list:
        return report
    by_name = {i.name: i for i in idx_list}
    entries = _entries(central, list(by_name), parallel)
    report.entries = len(entries)
    roots_by_type: dict[type[BriefcaseType], dict[GDID, dict[str, Any]]] = {}
    records = recorded_identities(central.cluster)
    unread: dict[str, str] = {}
    for idx in idx_list:
        btype = central.briefcase_type(idx)
        if btype not in roots_by_type:
            columns = sorted({i.root_column for i in idx_list if i.root_column and central.briefcase_type(i) is btype})
            roots_by_type[btype] = _roots(central, btype, columns, parallel, records, unread)
    report.briefcases = sum(len(r) for r in roots_by_type.values())
    now = time.time()
    valid: dict[tuple[str, str], set[GDID]] = {}
    indexed: set[tuple[str, str, GDID]] = set()
    for row in entries:
        idx = by_name[row.index_name]
        root = roots_by_type[central.briefcase_type(idx)].get(row.gdid)
        carried_raw: Any = None  # the root column's value, read once for the check and the report
        if root is None:
            ok = False
        elif idx.root_column is None:
            ok = True
        else:
            carried_raw = root[idx.root_column]
            ok = _normalized(idx, carried_raw) == row.key
        indexed.add((row.index_name, row.key, row.gdid))
        if ok:
            valid.setdefault((row.index_name, row.key), set()).add(row.gdid)
            if row.state == STATE_PENDING:
                report.problems.append(Problem("unfinished", row.index_name, row.key, row.gdid, row.state,
                                               "pending entry whose briefcase exists: finish it"))
            continue
        shard = central.cluster.router.locate(idx.area, row.gdid).server if root is None else None
        if shard is not None and shard in unread:
            kind, detail = "unreachable", f"its shard was not read, so the briefcase is not known to be missing: {unread[shard]}"
        elif root is None:
            kind, detail = "dangling", "the briefcase does not exist"
        else:
            kind, detail = "stale", f"the briefcase root carries {idx.root_column}={carried_raw!r}"
        problem = Problem(kind, row.index_name, row.key, row.gdid, row.state, detail)
        if row.state == STATE_PENDING and now - row.created_at <= grace:
            report.in_progress.append(problem)
        else:
            report.problems.append(problem)
    for idx in idx_list:
        if idx.root_column is None:
            continue
        for gdid, root in roots_by_type[central.briefcase_type(idx)].items():
            nkey = _normalized(idx, root[idx.root_column])
            if nkey is None or (idx.name, nkey, gdid) in indexed:
                continue
            holders = valid.get((idx.name, nkey), set()) - {gdid}
            if idx.unique and holders:
                report.problems.append(Problem("conflict", idx.name, nkey, gdid, None,
                                               f"the key is held by {', '.join(map(str, sorted(holders)))}"))
            else:
                report.problems.append(Problem("missing", idx.name, nkey, gdid, None,
                                               f"the root carries {idx.root_column}={root[idx.root_column]!r}"))
    return report


def repair(central: Central, indexes: Iterable[type[CentralIndex]], *, grace: float | None = None) -> RepairReport:
    """Fix every problem :func:`check` finds except conflicts; then check again."""
    idx_list = list(indexes)
    before = check(central, idx_list, grace=grace)
    result = RepairReport(before)
    # Deletions first, so a key freed from a dangling or stale entry can be re-added below.
    order = {"dangling": 0, "stale": 0, "unfinished": 1, "missing": 2, "conflict": 3, "unreachable": 3}
    rows = {(r.index_name, r.key, r.gdid): r for r in _entries(central, before.indexes, DEFAULT_PARALLEL)}
    for problem in sorted(before.problems, key=lambda p: order[p.kind]):
        row = rows.get((problem.index, problem.key, problem.gdid))
        if problem.kind in ("dangling", "stale") and row is not None:
            central.delete_entry(row)
        elif problem.kind == "unfinished" and row is not None:
            central.set_state(row, STATE_LIVE)
            central.cache.invalidate((row.index_name, row.key))
        elif problem.kind == "missing":
            idx = central.index(problem.index)
            try:
                with central.cluster.transaction(central.server_of(problem.key)) as conn:
                    conn.execute(insert(central_index).values(
                        index_name=idx.name, key=problem.key, slot=idx.slot(problem.gdid), gdid=problem.gdid,
                        state=STATE_LIVE, created_at=time.time(),
                    ))
            except DuplicateRowError:
                result.unresolved.append(problem)
                continue
            central.cache.invalidate((idx.name, problem.key))
        else:
            result.unresolved.append(problem)
            continue
        result.fixed[problem.kind] += 1
    result.after = check(central, idx_list, grace=grace)
    return result
