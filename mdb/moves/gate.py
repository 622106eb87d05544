"""Cutovers before everything else: the gate a reshard's parallel workers share.

A batch's write pause is the time its one statement and commit take under the lock. Anything
else a worker makes the servers do beside it on the same cores stretches that pause: measured
on two cores, a 28 ms cutover took 40-60 ms beside another worker's pre-copy statement, its
finalize or its own cutover. Pausing a relay between blocks of rows is not enough, because the
servers keep working on a statement already sent: a source streams into the socket ahead of
the relay, a COPY FROM checks its rows when it ends, a sums query runs to its end.

So a worker's server work outside its cutover runs in steps (:meth:`CutoverGate.step`: the
precheck, the claim, one table's copy, the target's sums, the finalize), and cutovers take
turns (:meth:`CutoverGate.cutting`, entered before the locks are taken). A cutover waits for
its turn and until no step is in flight; while any cutover waits or holds its locks, no step
starts. A relay passes its turn between blocks of rows (:meth:`CutoverGate.wait`), so a
cutover waits at most one statement, one block or one other cutover, and that wait comes
before its locks: it is not write pause. The steps of all workers still overlap each other
and the mover's own work. With one worker, nothing ever waits. A cutover waiting for sessions
to let go of its briefcases' locks (at most ``lock_wait``) holds the others back meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CutoverGate"]


class CutoverGate:
    """Shared by the batches a reshard pass runs at once (see the module docstring)."""

    def __init__(self) -> None:
        self._state = threading.Condition()
        self._cutting = 0
        """Cutovers waiting for their turn or their locks, or holding them."""
        self._holding = False
        """A cutover has its turn: one at a time, so two never share the cores either."""
        self._steps = 0
        """Steps in flight on the servers."""

    @contextmanager
    def cutting(self) -> Iterator[None]:
        """A cutover, from before its locks are taken to its commit: starts in its turn, once no step is in flight."""
        with self._state:
            self._cutting += 1
            self._state.wait_for(lambda: not self._steps and not self._holding)
            self._holding = True
        try:
            yield
        finally:
            with self._state:
                self._holding = False
                self._cutting -= 1
                self._state.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Server work of a batch outside its cutover (a statement, a table's relay): starts while no cutover is on."""
        with self._state:
            self._state.wait_for(lambda: not self._cutting)
            self._steps += 1
        try:
            yield
        finally:
            with self._state:
                self._steps -= 1
                self._state.notify_all()

    def wait(self) -> None:
        """Inside a step, between two blocks of rows: let a waiting cutover go first, then go on."""
        with self._state:
            if not self._cutting:
                return
            self._steps -= 1
            self._state.notify_all()
            self._state.wait_for(lambda: not self._cutting)
            self._steps += 1
