"""BudgetPool.reuse: an idle connection is handed to the engine's hook before it is checked out
again, and one the hook refuses is replaced by a fresh connection, not handed out."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import pytest

from mdb.budget import BudgetPool


def _pool() -> tuple[BudgetPool, list[sqlite3.Connection]]:
    made: list[sqlite3.Connection] = []

    def creator() -> sqlite3.Connection:
        made.append(sqlite3.connect(":memory:", check_same_thread=False))
        return made[-1]

    return BudgetPool(creator, pool_size=1, max_overflow=0), made


def test_an_idle_connection_passes_the_hook_before_it_is_reused() -> None:
    pool, made = _pool()
    seen: list[Any] = []
    pool.reuse = lambda record: seen.append(record.dbapi_connection)
    first = pool.connect()
    assert seen == []  # a new connection has nothing in flight
    first.close()
    second = pool.connect()
    assert seen == made == [second.dbapi_connection]
    second.close()


def test_a_connection_the_hook_refuses_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    pool, made = _pool()

    def refuse(record: Any) -> None:
        raise RuntimeError("the answer of its last COMMIT was an error")

    pool.connect().close()
    pool.reuse = refuse
    with caplog.at_level(logging.WARNING, logger="mdb.budget"):
        fairy = pool.connect()
    try:
        assert len(made) == 2 and fairy.dbapi_connection is made[1]
        assert fairy.dbapi_connection.execute("SELECT 1").fetchone() == (1,)
        with pytest.raises(sqlite3.ProgrammingError):  # the refused one was closed, not left open
            made[0].execute("SELECT 1")
        assert "the answer of its last COMMIT was an error" in caplog.text
    finally:
        fairy.close()
