"""Cutovers before everything else on their own servers: the gates a reshard's workers share.

A batch's write pause is the time its one statement and commit take under the lock. Anything
else a worker makes the same servers do beside it stretches that pause: measured on two cores,
a 28 ms cutover took 40-60 ms beside another worker's pre-copy statement, its finalize or its
own cutover. Pausing a relay between blocks of rows is not enough, because the servers keep
working on a statement already sent: a source streams into the socket ahead of the relay, a
COPY FROM checks its rows when it ends, a sums query runs to its end.

So a worker's server work outside its cutover runs in steps (:meth:`CutoverGate.step`: the
precheck, the claim, one table's copy, the target's sums, the finalize), and cutovers take
turns (:meth:`CutoverGate.cutting`, entered before the locks are taken). A cutover waits for
its turn and until no step is in flight; while any cutover waits or holds its locks, no step
starts. A relay passes its turn between blocks of rows (:meth:`CutoverGate.wait`), so a
cutover waits at most one statement, one block or one other cutover, and that wait comes
before its locks: it is not write pause. With one worker, nothing ever waits.

**Per server, not for the fleet**: a copy between servers c and d has nothing to do
with a cutover between a and b. :meth:`CutoverGate.pair` gives a batch the gate of its two
servers: its cutover waits only for steps on a or b, and holds back only steps on a or b. All
pairs share one board (one condition), so a batch enters both servers at once and two batches
crossing the same servers cannot deadlock. ``CutoverGate()`` alone is one gate for everything
(a lone batch, or callers that do not say their servers). Across worker processes the gate
is not shared: the reshard's per-server limit (``--per-server``, :mod:`mdb.moves.jobs`) is
what keeps other processes off a cutover's servers.

**Stopping** (Ctrl-C or SIGTERM of the process, ``stopped`` given): a step or a cutover's turn
that begins once the process was told to stop raises
:class:`mdb.errors.WorkerStoppedError` instead, so a worker thread stops within one statement
or one relay (the batch rolls back, :mod:`mdb.moves.batch`), not after its whole
batch. A relay in progress ends with its table; a step after the commit point (``stoppable=False``: the
finalize) still runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mdb.errors import WorkerStoppedError

__all__ = ["CutoverGate"]


class _Board:
    """The counters of every server, under one condition."""

    def __init__(self, stopped: Callable[[], bool] | None = None) -> None:
        self.state = threading.Condition()
        self.stopped = stopped
        """The process was told to stop: waits end and new steps raise (see the module docstring)."""
        self.cutting: dict[str, int] = {}
        """Cutovers waiting for their turn or their locks, or holding them, per server."""
        self.holding: set[str] = set()
        """Servers where a cutover has its turn: one at a time, so two never share them."""
        self.steps: dict[str, int] = {}
        """Steps in flight, per server."""

    def no_cutting(self, keys: tuple[str, ...]) -> bool:
        return not any(self.cutting.get(k) for k in keys)

    def add(self, counter: dict[str, int], keys: tuple[str, ...], n: int) -> None:
        for k in keys:
            counter[k] = counter.get(k, 0) + n

    def check(self) -> None:
        if self.stopped is not None and self.stopped():
            raise WorkerStoppedError("this process was told to stop (Ctrl-C or SIGTERM): the batch stops before its next step")

    def wait_for(self, ready: Callable[[], bool], stoppable: bool = True) -> None:
        """Under ``state``: wait until ``ready()``; raise once the process is told to stop (looked at every 0.2 s)."""
        while True:
            if stoppable:
                self.check()
            if ready():
                return
            self.state.wait(0.2 if self.stopped is not None and stoppable else None)


class CutoverGate:
    """Shared by the batches a reshard's workers run at once in one process (see the module docstring)."""

    def __init__(self, _board: _Board | None = None, _keys: tuple[str, ...] = ("*",), *,
                 stopped: Callable[[], bool] | None = None) -> None:
        self._board = _board or _Board(stopped)
        self._keys = _keys

    def pair(self, source: str, target: str) -> CutoverGate:
        """The gate of a batch between ``source`` and ``target``: waits for, and holds back, those two servers only."""
        return CutoverGate(self._board, tuple(sorted({source, target})))

    @contextmanager
    def cutting(self) -> Iterator[None]:
        """A cutover, from before its locks are taken to its commit: starts in its turn, once no step is in flight."""
        b, keys = self._board, self._keys
        with b.state:
            b.add(b.cutting, keys, 1)
            try:
                b.wait_for(lambda: not any(b.steps.get(k) for k in keys) and not b.holding.intersection(keys))
            except BaseException:
                b.add(b.cutting, keys, -1)
                b.state.notify_all()
                raise
            b.holding.update(keys)
        try:
            yield
        finally:
            with b.state:
                b.holding.difference_update(keys)
                b.add(b.cutting, keys, -1)
                b.state.notify_all()

    @contextmanager
    def step(self, stoppable: bool = True) -> Iterator[None]:
        """Server work of a batch outside its cutover (a statement, a table's relay): starts while no cutover is on.

        ``stoppable=False``: work that must run even once the process is told to stop (past the commit point)."""
        b, keys = self._board, self._keys
        with b.state:
            b.wait_for(lambda: b.no_cutting(keys), stoppable)
            b.add(b.steps, keys, 1)
        try:
            yield
        finally:
            with b.state:
                b.add(b.steps, keys, -1)
                b.state.notify_all()

    def wait(self) -> None:
        """Inside a step, between two blocks of rows: let a waiting cutover go first, then go on."""
        b, keys = self._board, self._keys
        with b.state:
            if b.no_cutting(keys):
                return
            b.add(b.steps, keys, -1)
            b.state.notify_all()
            b.wait_for(lambda: b.no_cutting(keys), stoppable=False)  # mid-relay: the step ends with its statement
            b.add(b.steps, keys, 1)
