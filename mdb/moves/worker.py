"""``mdb worker MAP``: a process that works on every job in CENTRAL until it is stopped.

Jobs are reshards, rebalances, drains and a cancel's move-back (a reshard at step ``cancel``).
Each round it first adopts any job whose driver is gone (its lease free: a dead pid on this
host, a stale beat from another) and drives that job's phases itself, as ``mdb moves resume``
would (an interrupted cancel is finished: the operator asked for it); otherwise it claims the next work item of any running job (:mod:`mdb.moves.jobs`) and
moves it. Stopping (SIGTERM, Ctrl-C) sets a flag: the batch in hand stops before its next
step (rolled back, never left half-cut; finalized past its commit point) and its item is
given back, a job being driven stops between two steps with its lease released, and the next
worker picks both up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError

from mdb.cluster import Cluster
from mdb.errors import MdbError, MoveLeaseHeldError, ReshardStoppedError
from mdb.moves import jobs
from mdb.moves.journal import JOB_KINDS, RUNNING, Journal
from mdb.moves.lease import fenced_servers, hold, lease_owner_id, liveness
from mdb.moves.move import resolve_move
from mdb.moves.movejob import drive
from mdb.moves.reshard import Workers, work_item

__all__ = ["IDLE_POLL", "adopt_jobs", "run_worker"]

log = logging.getLogger("mdb.moves.worker")

IDLE_POLL = 0.5
"""Seconds between two looks for work while there is none."""


def adopt_jobs(store: Cluster, stopping: threading.Event, on_event: Callable[[str], None] | None = None) -> int:
    """Drive every running job whose driver is gone, one after the other; how many were driven."""
    journal = Journal(store)
    driven = 0
    for entry in journal.entries(unfinished=True):
        if stopping.is_set():
            break
        if entry.kind not in JOB_KINDS or liveness(journal, entry)[0] != "interrupted":
            continue
        try:
            with hold(journal, entry.move_id) as lease:
                fenced = lease.fenced(store, fenced_servers(store, journal, entry))
                fj = Journal(fenced)
                current = fj.get(entry.move_id)  # read again: no earlier driver can write now
                if current is None or current.status != RUNNING:
                    continue
                if on_event is not None:
                    on_event(f"driving {current.kind} {entry.move_id} from step {current.step!r}")
                # Moves journaled under the job's own lease (an older mdb, a document area) are resolved first.
                for move in fj.moves_of(entry.move_id):
                    if move.status == RUNNING and lease_owner_id(move) == entry.move_id:
                        resolve_move(fenced, fj, move)
                store.refresh()
                said = drive(fenced, fj, current, stopping=stopping)
                driven += 1
                if on_event is not None:
                    on_event(f"{current.kind} {entry.move_id}: {said}")
        except MoveLeaseHeldError:
            continue  # another worker took it first
    return driven


def run_worker(store: Cluster, stopping: threading.Event, *, on_event: Callable[[str], None] | None = None,
               errors: list[BaseException] | None = None) -> None:
    """Work until ``stopping`` is set (see the module docstring).

    An error in one item or job is logged (and kept in ``errors``) and the worker goes on: the
    item's lease is released with it, so it is claimed again (by this or another worker) once
    the server is back; an error that repeats is what ``mdb moves status`` and the logs show.
    """
    workers = Workers(store, stopping)
    try:
        _loop(store, stopping, workers, on_event, errors)
    finally:
        workers.let_go()


def _loop(store: Cluster, stopping: threading.Event, workers: Workers, on_event: Callable[[str], None] | None,
          errors: list[BaseException] | None) -> None:
    while not stopping.is_set():
        try:
            if adopt_jobs(store, stopping, on_event):
                continue
            item = jobs.claim(workers.journal)
            if item is None:
                workers.let_go()  # idle: no schema held (a migration may run)
                stopping.wait(IDLE_POLL)
                continue
            if on_event is not None:
                on_event(f"{item.item_id} of job {item.job_id}: {len(item.gdids)} briefcase(s) {item.source} -> {item.target}")
            work_item(workers, item)
        except (MdbError, DBAPIError, OSError) as exc:
            if isinstance(exc, ReshardStoppedError) and stopping.is_set():
                break  # told to stop: its batch rolled back, its item given back
            log.error("worker: %s", exc)
            if errors is not None:
                errors.append(exc)
            if on_event is not None:
                on_event(f"error: {exc}")
            workers.let_go()
            stopping.wait(IDLE_POLL)
