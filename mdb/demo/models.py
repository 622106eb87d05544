"""The user briefcase of the design, as SQLAlchemy 2.x typed models.

User -> PayAccount -> AccountAuthorizationHistory; User -> Address; User -> Order ->
OrderLineItem; User -> Transaction; User -> Balance. Every table carries ``user_id`` (the
briefcase key) and has GDID primary keys; children reference their parent with composite
foreign keys that include the briefcase key, so a row can never point into another briefcase.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import DateTime, ForeignKeyConstraint, Index, Integer, Numeric, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from mdb.briefcase import BriefcaseType
from mdb.gdid import GDID
from mdb.sqltypes import GDIDType
from mdb.hot import EventLog, SumFold, event_log_models

__all__ = [
    "AccountAuthorizationHistory",
    "Address",
    "Balance",
    "DemoBase",
    "LEDGER",
    "LEDGER_TABLES",
    "Order",
    "OrderLineItem",
    "PayAccount",
    "Transaction",
    "User",
    "UserBriefcase",
]


def _now() -> datetime:
    return datetime.now(timezone.utc)


class DemoBase(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class User(DemoBase):
    __tablename__ = "users"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(320))
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)

    pay_accounts: Mapped[list[PayAccount]] = relationship(back_populates="user")
    addresses: Mapped[list[Address]] = relationship()
    orders: Mapped[list[Order]] = relationship(back_populates="user")
    transactions: Mapped[list[Transaction]] = relationship()
    balances: Mapped[list[Balance]] = relationship()


class PayAccount(DemoBase):
    __tablename__ = "pay_accounts"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    account_id: Mapped[GDID] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    masked_number: Mapped[str] = mapped_column(String(32))
    __table_args__ = (ForeignKeyConstraint(["user_id"], ["users.user_id"]),)

    user: Mapped[User] = relationship(back_populates="pay_accounts")
    authorizations: Mapped[list[AccountAuthorizationHistory]] = relationship()


class AccountAuthorizationHistory(DemoBase):
    __tablename__ = "account_authorization_history"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    authorization_id: Mapped[GDID] = mapped_column(primary_key=True)
    account_id: Mapped[GDID]
    amount: Mapped[int] = mapped_column(Integer)
    approved: Mapped[bool]
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    __table_args__ = (
        ForeignKeyConstraint(["user_id", "account_id"], ["pay_accounts.user_id", "pay_accounts.account_id"]),
    )


class Address(DemoBase):
    __tablename__ = "addresses"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    address_id: Mapped[GDID] = mapped_column(primary_key=True)
    line1: Mapped[str] = mapped_column(String(200))
    city: Mapped[str] = mapped_column(String(100))
    country: Mapped[str] = mapped_column(String(2))
    __table_args__ = (ForeignKeyConstraint(["user_id"], ["users.user_id"]),)


class Order(DemoBase):
    __tablename__ = "orders"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    order_id: Mapped[GDID] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="placed")
    total_cents: Mapped[int] = mapped_column(Integer, default=0)
    placed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    __table_args__ = (
        ForeignKeyConstraint(["user_id"], ["users.user_id"]),
        Index("ix_orders_placed_at", "placed_at"),
    )

    user: Mapped[User] = relationship(back_populates="orders")
    line_items: Mapped[list[OrderLineItem]] = relationship()


class OrderLineItem(DemoBase):
    __tablename__ = "order_line_items"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    line_id: Mapped[GDID] = mapped_column(primary_key=True)
    order_id: Mapped[GDID]
    sku: Mapped[str] = mapped_column(String(64))
    quantity: Mapped[int] = mapped_column(Integer)
    price_cents: Mapped[int] = mapped_column(Integer)
    __table_args__ = (ForeignKeyConstraint(["user_id", "order_id"], ["orders.user_id", "orders.order_id"]),)


class Transaction(DemoBase):
    __tablename__ = "transactions"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    transaction_id: Mapped[GDID] = mapped_column(primary_key=True)
    amount_cents: Mapped[int] = mapped_column(Integer)
    memo: Mapped[str] = mapped_column(String(200), default="")
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    __table_args__ = (ForeignKeyConstraint(["user_id"], ["users.user_id"]),)


class Balance(DemoBase):
    __tablename__ = "balances"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    balance_id: Mapped[GDID] = mapped_column(primary_key=True)
    currency: Mapped[str] = mapped_column(String(3))
    amount_cents: Mapped[int] = mapped_column(Numeric(20, 0))
    __table_args__ = (ForeignKeyConstraint(["user_id"], ["users.user_id"]),)


# The user's ledger as an event log (mdb.hot): money movements are appended, never updated;
# balances are read as the latest snapshot + the events after it (docs/hot-data.md).
LEDGER_TABLES, LEDGER_MODELS = event_log_models(DemoBase, "ledger_events", key_column="user_id")


class UserBriefcase(BriefcaseType):
    area = "user"
    key = "user_id"
    root = User
    children = (PayAccount, AccountAuthorizationHistory, Address, Order, OrderLineItem, Transaction, Balance, *LEDGER_MODELS)


LEDGER = EventLog(LEDGER_TABLES, SumFold(("amount_cents",)))
"""Stream ``ledger`` of each user: events ``transaction`` with payload {"amount_cents": n}."""
