"""Typed, versioned views of a job's journal ``params`` (the reshard's, a rebalance's or a drain's).

A job's row is written by one mdb and may be resumed by another (a worker on a newer host, a
resume after an upgrade). Each kind reads its row through one model: a row without a version is
read with the defaults its keys had when versions began, a row from a newer mdb is refused in
one line naming what to do, and a malformed one says which key is wrong. Keys that other parts
own (the throttle's settings, the progress's rate window) pass through untouched.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from mdb.errors import MdbError

__all__ = ["JobParams"]


class JobParams(BaseModel):
    """The base of each job kind's params model: ``KIND`` names it in errors, ``VERSION`` is the newest it reads."""

    model_config = ConfigDict(extra="ignore")

    KIND: ClassVar[str]
    VERSION: ClassVar[int]

    params_version: int = 1

    @classmethod
    def of(cls, move_id: str, params: dict[str, Any]) -> Self:
        """Parse a journal row's params; one clear error for a row this mdb cannot drive."""
        version = params.get("params_version", 1)
        if isinstance(version, int) and version > cls.VERSION:
            raise MdbError(f"{cls.KIND} {move_id} was journaled by a newer mdb (params version {version}, this one knows up to "
                           f"{cls.VERSION}): resume it with that version")
        try:
            return cls.model_validate(params)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}" for e in exc.errors())
            raise MdbError(f"{cls.KIND} {move_id}: its journal row's params are not a {cls.KIND}'s ({problems})") from None

    def to_params(self) -> dict[str, Any]:
        """The keys to write back into the row's params (merged over the keys other parts own)."""
        return self.model_dump(mode="json", exclude_none=True)
