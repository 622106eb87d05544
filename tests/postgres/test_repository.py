"""The demo repositories end to end: registration, addresses, orders, transactions, balances (SQLite + PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mdb import Store
from mdb.demo.models import Address, UserBriefcase
from mdb.demo.repositories import EmailIndex, LedgerRepository, LineItem, OrderRepository, UserRepository
from mdb.errors import DuplicateKeyError
from mdb.repository import Repository
from support.central import make_map, open_store


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        urls = request.getfixturevalue("tmp_sqlite_urls")(4)
    else:
        urls = request.getfixturevalue("pg_databases")(2) + request.getfixturevalue("pg_databases")(2)
    with open_store(make_map(tmp_path, urls)) as s:
        yield s


def test_user_lifecycle(store: Store) -> None:
    users, orders, ledger = UserRepository(store), OrderRepository(store), LedgerRepository(store)
    alice = users.register("Alice@Example.org", "Alice")
    bob = users.register("bob@example.org", "Bob")  # a neighbour: nothing of his may leak into alice's reads
    assert users.find_by_email(" alice@EXAMPLE.org") == alice
    with pytest.raises(DuplicateKeyError):
        users.register("alice@example.org", "Impostor")
    view = users.get(alice)
    assert view is not None and (view.email, view.name) == ("Alice@Example.org", "Alice")

    address = users.add_address(alice, "1 Main St", "Springfield", "US")
    with store.briefcase(UserBriefcase, alice, readonly=True) as s:
        assert [a.address_id for a in s.query(Address).all()] == [address]

    first = orders.place_order(alice, [LineItem("book", 2, 1250), LineItem("pen", 1, 199)])
    second = orders.place_order(alice, [LineItem("lamp", 1, 3999)])
    orders.place_order(bob, [LineItem("mug", 4, 500)])
    listed = orders.list_orders(alice)
    assert {o.order_id for o in listed} == {first, second}
    by_id = {o.order_id: o for o in listed}
    assert by_id[first].total_cents == 2 * 1250 + 199
    assert sorted(by_id[first].items, key=lambda i: i.sku) == [LineItem("book", 2, 1250), LineItem("pen", 1, 199)]
    with pytest.raises(ValueError, match="at least one line item"):
        orders.place_order(alice, [])

    assert ledger.read_balance(alice) == 0
    ledger.record_transaction(alice, 5000, "top-up")
    ledger.record_transaction(alice, -1234, "coffee")
    ledger.record_transaction(bob, 777)
    assert ledger.read_balance(alice) == 5000 - 1234
    assert ledger.read_balance(bob) == 777


def test_change_email_moves_key_and_root_together(store: Store) -> None:
    users = UserRepository(store)
    carol = users.register("carol@example.org", "Carol")
    assert users.change_email("CAROL@example.org", "caz@example.org") == carol
    assert users.find_by_email("carol@example.org") is None
    assert users.find_by_email("caz@example.org") == carol
    assert users.get(carol).email == "caz@example.org"  # type: ignore[union-attr]
    assert store.central.keys_of(EmailIndex, carol) == ["caz@example.org"]


def test_repository_base_helpers(store: Store) -> None:
    class Things(Repository):
        scope = "things"

    repo = Things(store)
    a, b = repo.new_id("thing"), repo.new_id("thing")
    assert a < b and not a.is_zero
    assert len(set(repo.new_ids("thing", 5)) | {a, b}) == 7
    assert repo.central is store.central
    assert "Things(Store(" in repr(repo)
    # The documented sequences (docs/repositories.md): child ids from things:rows/thing, keys from user/ids.
    from mdb.idgen import read_sequence
    from mdb.router import Router

    def position(scope: str, sequence: str) -> int | None:
        server = Router(store.map).locate_central(f"{scope}/{sequence}").server
        with store.transaction(server) as conn:
            state = read_sequence(conn, scope, sequence)
        return None if state is None else state.next_counter

    assert position("things:rows", "thing") is not None and position("things", "thing") is None
    key = repo.new_root_id(UserBriefcase)
    assert key.counter < position("user", "ids")  # type: ignore[operator]
