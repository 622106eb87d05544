"""The demo domain's repositories and its CENTRAL email index: the worked example of the docs.

    store = Store.from_yaml("mdb-demo/map.yaml")
    users = UserRepository(store)
    alice = users.register("Alice@Example.org", "Alice")        # GDID, email index, atomic
    users.add_address(alice, "1 Main St", "Springfield", "US")
    orders = OrderRepository(store)
    orders.place_order(alice, [LineItem("sku-1", 2, 499)])
    ledger = LedgerRepository(store)
    ledger.record_transaction(alice, 1500, "top-up")
    ledger.read_balance(alice)                                    # 1500
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from mdb.central.indexes import CentralIndex, strip_casefold
from mdb.demo.models import LEDGER, Address, Order, OrderLineItem, Transaction, User, UserBriefcase
from mdb.gdid import GDID
from mdb.repository import Repository
from mdb.hot import run_snapshots

LEDGER_STREAM = "ledger"

__all__ = [
    "EmailIndex",
    "LedgerRepository",
    "LineItem",
    "OrderRepository",
    "OrderView",
    "UserRepository",
    "UserView",
]


class EmailIndex(CentralIndex):
    """email -> user GDID; emails compare after strip + casefold; the User row carries it."""

    name = "user_email"
    area = "user"
    unique = True
    normalize = strip_casefold
    briefcase = UserBriefcase
    root_column = "email"


@dataclass(frozen=True)
class UserView:
    user_id: GDID
    email: str
    name: str
    created_at: datetime


@dataclass(frozen=True)
class LineItem:
    sku: str
    quantity: int
    price_cents: int


@dataclass(frozen=True)
class OrderView:
    order_id: GDID
    status: str
    total_cents: int
    placed_at: datetime
    items: tuple[LineItem, ...]


class UserRepository(Repository):
    scope = "user"

    def register(self, email: str, name: str) -> GDID:
        """Create the user briefcase and its email key atomically; DuplicateKeyError if taken."""
        return self.central.create(UserBriefcase, lambda gdid: User(user_id=gdid, email=email, name=name), [EmailIndex])

    def find_by_email(self, email: str) -> GDID | None:
        return self.central.lookup(EmailIndex, email)

    def get(self, user_id: GDID) -> UserView | None:
        with self.briefcase(UserBriefcase, user_id, readonly=True) as s:
            user = s.get(User, user_id)
            return None if user is None else UserView(user.user_id, user.email, user.name, user.created_at)

    def change_email(self, old_email: str, new_email: str) -> GDID:
        """Move the key and the User row's email together (ordered, crash-safe)."""
        return self.central.rename(EmailIndex, old_email, new_email)

    def add_address(self, user_id: GDID, line1: str, city: str, country: str) -> GDID:
        address_id = self.new_id("address")
        with self.briefcase(UserBriefcase, user_id) as s:
            s.add(Address(address_id=address_id, line1=line1, city=city, country=country))
        return address_id


class OrderRepository(Repository):
    scope = "user"

    def place_order(self, user_id: GDID, items: list[LineItem]) -> GDID:
        """One order with its line items, in one transaction of the user's briefcase."""
        if not items:
            raise ValueError("an order needs at least one line item")
        order_id = self.new_id("order")
        line_ids = self.new_ids("order_line", len(items))
        total = sum(i.quantity * i.price_cents for i in items)
        with self.briefcase(UserBriefcase, user_id) as s:
            s.add(Order(order_id=order_id, status="placed", total_cents=total))
            s.flush()  # the parent row first: line items reference it
            s.add_all(
                OrderLineItem(line_id=lid, order_id=order_id, sku=i.sku, quantity=i.quantity, price_cents=i.price_cents)
                for lid, i in zip(line_ids, items)
            )
        return order_id

    def list_orders(self, user_id: GDID) -> list[OrderView]:
        """The user's orders, newest first, with their line items."""
        with self.briefcase(UserBriefcase, user_id, readonly=True) as s:
            orders = s.scalars(select(Order).order_by(Order.placed_at.desc(), Order.order_id.desc())).all()
            lines = s.scalars(select(OrderLineItem).order_by(OrderLineItem.line_id)).all()
            by_order: dict[GDID, list[LineItem]] = {}
            for line in lines:
                by_order.setdefault(line.order_id, []).append(LineItem(line.sku, line.quantity, line.price_cents))
            return [
                OrderView(o.order_id, o.status, o.total_cents, o.placed_at, tuple(by_order.get(o.order_id, ())))
                for o in orders
            ]


class LedgerRepository(Repository):
    scope = "user"

    def record_transaction(self, user_id: GDID, amount_cents: int, memo: str = "") -> GDID:
        """The Transaction row and its ledger event, in one transaction (the event id is the row's id)."""
        transaction_id = self.new_id("transaction")
        with self.briefcase(UserBriefcase, user_id) as s:
            s.add(Transaction(transaction_id=transaction_id, amount_cents=amount_cents, memo=memo))
            LEDGER.append(s, LEDGER_STREAM, transaction_id, "transaction", {"amount_cents": amount_cents})
        return transaction_id

    def read_balance(self, user_id: GDID) -> int:
        """The balance in cents: the ledger's latest snapshot + the events after it."""
        with self.briefcase(UserBriefcase, user_id, readonly=True) as s:
            return int(LEDGER.read(s, LEDGER_STREAM).state["amount_cents"])

    def snapshot_balances(self) -> int:
        """One snapshot pass over every user's ledger (what `mdb snapshot MAP user` runs); events folded."""
        return sum(r.folded for r in run_snapshots(self.store, LEDGER, UserBriefcase.area, stream=LEDGER_STREAM))
