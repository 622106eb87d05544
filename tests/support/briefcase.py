"""Shared by test_briefcase_pg and the suites beside it (moved out of test_briefcase_pg, which used to be imported by other test modules)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
import pytest
from support.mapfiles import write_map
from mdb.demo.models import (
    UserBriefcase,
)
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.demo.models import User

SERVERS = ["central", "u1", "u2", "u3", "u4", "u5"]
PARTITIONS = [("0:0:0", ["u1", "u2"]), ("0:0:1000", ["u3", "u4", "u5"])]
_counter = iter(range(10**6, 2 * 10**6))


def make_store(tmp_path: Path, urls: list[str], **kwargs: Any) -> Store:
    path = write_map(tmp_path, dict(zip(SERVERS, urls)), central=["central"], partitions=PARTITIONS)
    store = Store.from_yaml(path, types=[UserBriefcase], **kwargs)
    reports = apply_schema(store)
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return store


@pytest.fixture
def pg_store(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Store]:
    # Two databases on each of three servers: six map servers over three PostgreSQL servers.
    first, second = pg_databases(3), pg_databases(3)
    with make_store(tmp_path, [first[0], first[1], first[2], second[0], second[1], second[2]]) as store:
        yield store


@pytest.fixture
def sqlite_store(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Store]:
    with make_store(tmp_path, tmp_sqlite_urls(len(SERVERS))) as store:
        yield store


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue("pg_store" if request.param == "postgresql" else "sqlite_store")  # type: ignore[no-any-return]


def child_id() -> GDID:
    """Ids for child rows; authority 1 keeps them apart from the briefcase ids used below."""
    return GDID(0, 1, next(_counter))


class RoundTripCounter:
    """A TCP proxy in front of a PostgreSQL server that counts ReadyForQuery messages.

    Without pipelining, every client/server exchange ends with exactly one ReadyForQuery ('Z')
    from the server: a simple query (one or many statements in one string) gets one, an
    extended-protocol Parse/Bind/Execute/Sync gets one. The client cannot send its next query
    before that message arrives, so the number of 'Z' messages is the number of network round
    trips. The proxy parses the server's message framing (type byte + 4-byte length), which
    is why the client connects with sslmode=disable (an SSL stream could not be parsed).
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.ready_for_query = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        buffer = bytearray()
        try:
            while data := src.recv(65536):
                if from_server:  # count before forwarding: once the client has the 'Z', it is counted
                    buffer += data
                    while len(buffer) >= 5:
                        length = int.from_bytes(buffer[1:5], "big")
                        if len(buffer) < 1 + length:
                            break
                        if buffer[0] == ord("Z"):
                            with self._lock:
                                self.ready_for_query += 1
                        del buffer[: 1 + length]
                dst.sendall(data)
        except OSError:
            pass  # the other side closed: the pump's job is over
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the other pump

    def close(self) -> None:
        self._listener.close()


def _proxied(url: str, port: int) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.set(host="127.0.0.1", port=port).update_query_dict({"sslmode": "disable", "gssencmode": "disable"}).render_as_string(hide_password=False)


def eight_exclusive_writers_lose_nothing(store: Store) -> None:
    """``user.n = user.n + 1`` in the ORM, 8 threads x 15: every increment must land.

    A plain write session takes the briefcase lock SHARED, so under READ COMMITTED two writers
    read the same value and one increment is lost (an independent harness saw 18 torn counters).
    An exclusive session takes it EXCLUSIVE in BEGIN's round trip: the next writer's reads run
    after the previous one committed. On SQLite BEGIN IMMEDIATE already serializes writers.
    """
    import threading

    from mdb.demo.models import Balance

    me, balance_id = GDID(0, 0, 21), GDID(0, 1, 21)
    with store.briefcase(UserBriefcase, me) as session:
        session.add(User(user_id=me, email="counter@example.com", name="counter"))
        session.add(Balance(balance_id=balance_id, currency="EUR", amount_cents=0))
    threads, per_thread, errors = 8, 15, []
    start = threading.Barrier(threads)

    def writer() -> None:
        try:
            start.wait()
            for _ in range(per_thread):
                with store.briefcase(UserBriefcase, me, exclusive=True) as session:
                    row = session.get(Balance, (me, balance_id))
                    assert row is not None
                    row.amount_cents = row.amount_cents + 1
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    workers = [threading.Thread(target=writer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    with store.briefcase(UserBriefcase, me, readonly=True) as session:
        assert session.get(Balance, (me, balance_id)).amount_cents == threads * per_thread  # type: ignore[union-attr]
