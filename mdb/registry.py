"""The declarations one application hands its Store: a registry, as SQLAlchemy's ``registry()``.

Briefcase types, document types, CENTRAL indexes and event logs join the registry they are
declared against (``class Users(BriefcaseType, registry=reg)``, ``EventLog(..., registry=reg)``),
or :data:`default_registry` when none is named, which is what an application with one model
package wants. A Store reads only the registry it is given, so two applications, or two tests,
in one process never see each other's declarations: nothing is filled into module globals.

Each declaring module defines its own :class:`Kind` (a typed key), so this module, at the bottom
of the layering, knows nothing of what it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from mdb.errors import SchemaError

__all__ = ["Kind", "Registry", "default_registry"]

T = TypeVar("T")


class Kind(Generic[T]):
    """A typed key of a registry: what one declaring module stores under it (``label`` names it in errors)."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return f"Kind({self.label!r})"


class Registry:
    """Named declarations by kind, in declaration order."""

    def __init__(self) -> None:
        self._entries: dict[Kind[Any], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, kind: Kind[T], name: str, item: T, *, clash: Callable[[T, T], str | None] | None = None) -> None:
        """Declare ``item`` as ``name``. ``clash(old, new)`` says why a different item already
        declared under that name may not be replaced (None: the newer one replaces it, as a
        module imported again declares its classes again)."""
        with self._lock:
            entries = self._entries.setdefault(kind, {})
            old = entries.get(name)
            if old is not None and old is not item and clash is not None:
                reason = clash(old, item)
                if reason is not None:
                    raise SchemaError(reason)
            entries[name] = item

    def remove(self, kind: Kind[T], name: str) -> None:
        """Forget a declaration (a test that declares a type for itself and cleans up)."""
        with self._lock:
            self._entries.get(kind, {}).pop(name, None)

    def items(self, kind: Kind[T]) -> list[T]:
        """Every declaration of ``kind``, in declaration order."""
        with self._lock:
            return list(self._entries.get(kind, {}).values())

    def get(self, kind: Kind[T], name: str) -> T | None:
        with self._lock:
            item: T | None = self._entries.get(kind, {}).get(name)
            return item

    def names(self, kind: Kind[T]) -> list[str]:
        with self._lock:
            return list(self._entries.get(kind, {}))


default_registry = Registry()
"""Where declarations go when they name no registry; the Store's default too."""
