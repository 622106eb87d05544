"""Module attributes imported on first use (PEP 562), for the public namespaces ``mdb`` and ``mdb.ops``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(module: str, where: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``module``: a name of ``where`` (name -> defining module)
    is imported on first use and kept in ``module``'s globals, so the next lookup is a plain attribute."""

    def __getattr__(name: str) -> object:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module]), *where})

    return __getattr__, __dir__
