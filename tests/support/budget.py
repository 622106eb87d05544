"""Shared by test_budget and the suites beside it (moved out of test_budget, which used to be imported by other test modules)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
import psycopg
import pytest
import yaml
from support.mapfiles import map_dict
from mdb.testing.postgres import PostgresServer
import threading
import time


@pytest.fixture
def small_server(pg_server_factory: Any) -> Iterator[Callable[[int], PostgresServer]]:
    """Factory: a server of the test's own with ``max_connections=n`` and no reserved slots.

    Asks for ``pg_server_factory`` so the test is marked postgres and skipped (failed in CI)
    the same way when PostgreSQL cannot start.
    """
    made: list[PostgresServer] = []

    def make(n: int) -> PostgresServer:
        server = PostgresServer({"max_connections": str(n), "superuser_reserved_connections": "0"}, name="budget")
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.close()


def write_budget_map(path: Path, servers: dict[str, str], shards: list[str], engine: dict[str, Any]) -> Path:
    data = map_dict(servers, central=["c"], partitions=[("0:0:0", shards)])
    data["engine_defaults"] = engine
    path.write_text(yaml.safe_dump(data))
    return path


def connections_to(server: PostgresServer, admin: psycopg.Connection[Any]) -> int:
    """Client connections the server holds, other than ``admin`` itself."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def settled_connections_to(
    server: PostgresServer, admin: psycopg.Connection[Any], at_most: int, timeout: float = 10.0
) -> int:
    """The server's client connections once they are at most ``at_most``, or the last count after ``timeout``.

    A backend leaves ``pg_stat_activity`` a moment after its client closed the socket (it exits on
    its own), so a count taken right after a close can still see it; a connection that was really
    left open stays counted and fails the caller's assertion.
    """
    deadline = time.monotonic() + timeout
    count = connections_to(server, admin)
    while count > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
        count = connections_to(server, admin)
    return count


def fill(server: PostgresServer) -> list[psycopg.Connection[Any]]:
    """Open connections until the server refuses one for capacity; the open ones."""
    held: list[psycopg.Connection[Any]] = []
    url = server.url().replace("postgresql+psycopg://", "postgresql://", 1)
    while True:
        try:
            held.append(psycopg.connect(url, autocommit=True))
        except psycopg.OperationalError as exc:
            assert "too many clients" in str(exc)
            return held


@pytest.fixture
def refusals() -> Iterator[_Refusals]:
    handler = _Refusals()
    logger = logging.getLogger("mdb.budget")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


class _Refusals(logging.Handler):
    """Sets ``seen`` when mdb.budget logs that a capacity refusal will be retried."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "refused a connection for capacity" in record.getMessage():
            self.seen.set()
