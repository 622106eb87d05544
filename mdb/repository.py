"""Base class for application repositories: the one place domain code meets the Store.

A repository method is a unit of work on one briefcase (open a session, read or write, commit)
or a CENTRAL operation (look a key up, create an entity with its keys). Keeping those in
repositories keeps routing, GDID generation and key handling out of the rest of the
application; see ``mdb.demo.repositories`` for the worked example.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mdb.briefcase import BriefcaseType
from mdb.central.service import Central
from mdb.gdid import GDID
from mdb.session import BriefcaseSession
from mdb.store import Store

__all__ = ["Repository"]


class Repository:
    """Holds the Store; subclasses add domain methods built on the helpers below."""

    scope: str = "app"
    """Scope of the child-row id sequences of :meth:`new_id`: ``{scope}:rows/{sequence}``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r})"

    @property
    def central(self) -> Central:
        return self.store.central

    @contextmanager
    def briefcase(
        self, btype: type[BriefcaseType], gdid: GDID | str, *, readonly: bool = False, exclusive: bool = False
    ) -> Iterator[BriefcaseSession]:
        """A session on one briefcase in one transaction (commit on success, rollback on error)."""
        with self.store.briefcase(btype, gdid, readonly=readonly, exclusive=exclusive) as session:
            yield session

    def new_root_id(self, btype: type[BriefcaseType]) -> GDID:
        """A fresh briefcase key of ``btype``: its root sequence ``{area}/{id_sequence}`` (``store.new_gdid``)."""
        return self.store.new_gdid(btype)

    def new_id(self, sequence: str) -> GDID:
        """A fresh id for a child row: CENTRAL sequence ``{scope}:rows/{sequence}`` (``store.row_ids``).

        Not for briefcase keys: those come from :meth:`new_root_id`. Child ids live outside the
        area's scope so they do not raise its high-water mark.
        """
        return self.store.row_ids(self.scope, sequence).next()

    def new_ids(self, sequence: str, n: int) -> list[GDID]:
        """``n`` child-row ids in increasing order, from the same sequence as :meth:`new_id`."""
        return self.store.row_ids(self.scope, sequence).take(n)
