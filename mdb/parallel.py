"""Bounded parallelism for fleet operations: the same work on every server, a few at a time.

A schema apply or a check waits on the network and the server for most of each shard's
55-100 ms, so doing shards one after the other made 1,000 shards take minutes.
Threads suffice: the waiting releases the GIL. The bound keeps a run from opening a connection
to every server at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

__all__ = ["DEFAULT_PARALLEL", "MAX_PARALLEL", "run_each"]

DEFAULT_PARALLEL = 8
MAX_PARALLEL = 64

T = TypeVar("T")
R = TypeVar("R")


def run_each(
    items: Sequence[T],
    work: Callable[[T], R],
    *,
    parallel: int = DEFAULT_PARALLEL,
    on_done: Callable[[R], None] | None = None,
    name: str = "mdb-fleet",
) -> list[R]:
    """``[work(item) for item in items]`` with at most ``parallel`` running at once, in item order.

    ``on_done`` is called (in the calling thread) as each result arrives, e.g. to advance a
    progress bar. ``work`` reports a per-item failure in its result; an exception it raises is
    a bug or an interrupt, and is raised here once the pool has drained.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    if parallel == 1 or len(items) <= 1:
        results = []
        for item in items:
            results.append(work(item))
            if on_done is not None:
                on_done(results[-1])
        return results
    with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix=name) as pool:
        futures = {pool.submit(work, item): i for i, item in enumerate(items)}
        done: dict[int, R] = {}
        for future in as_completed(futures):
            result = future.result()
            done[futures[future]] = result
            if on_done is not None:
                on_done(result)
    return [done[i] for i in range(len(items))]
