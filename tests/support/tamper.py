"""Wrong copies made on purpose: one line item of a briefcase dropped, altered or added.

Verification tests (of a single move and of a batch) run a real copy and then change what it
wrote, in the same target transaction, so that only the checksums can tell. The keys are the
ones :func:`support.moves.create_user` gives.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection

from mdb.demo.models import OrderLineItem
from mdb.gdid import GDID

__all__ = ["BUCKET", "EXTRA_LINE", "LINES", "TAMPER", "line_key"]

LINES = OrderLineItem.__table__
EXTRA_LINE = GDID(0, 3, 99)
"""The key of the row ``extra`` adds (the source does not have it)."""


def line_key(gdid: GDID, order: int, item: int) -> GDID:
    """The key create_user gives line ``item`` of order ``order`` of user ``gdid``."""
    return GDID(0, 3, gdid.counter * 100000 + order * 100 + item)


def _drop(conn: Connection, gdid: GDID) -> GDID:
    key = line_key(gdid, 0, 1)
    conn.execute(delete(LINES).where(LINES.c.user_id == gdid, LINES.c.line_id == key))
    return key


def _alter(conn: Connection, gdid: GDID) -> GDID:
    key = line_key(gdid, 1, 0)
    conn.execute(update(LINES).where(LINES.c.user_id == gdid, LINES.c.line_id == key).values(quantity=999))
    return key


def _extra(conn: Connection, gdid: GDID) -> GDID:
    """A second copy of a row under a key the source does not have (the PK forbids a plain twin)."""
    row = conn.execute(select(LINES).where(LINES.c.user_id == gdid, LINES.c.line_id == line_key(gdid, 0, 0))).mappings().one()
    conn.execute(insert(LINES).values({**row, "line_id": EXTRA_LINE}))
    return EXTRA_LINE


TAMPER: dict[str, Callable[[Connection, GDID], GDID]] = {"dropped": _drop, "altered": _alter, "extra": _extra}
"""kind -> tamper(conn, user): changes one line item of ``user`` there and returns its key."""
BUCKET = {"dropped": "missing on target", "altered": "different", "extra": "extra on target"}
"""kind -> where a verification report lists the tampered key."""
