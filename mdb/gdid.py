"""GDID: the global distributed id that keys every briefcase.

A GDID is ``era`` (u32), ``authority`` (0..15) and ``counter`` (0..2^60-1). The authority and
counter pack into one 64-bit *raw id* (``authority << 60 | counter``); the 12-byte form is the
big-endian era followed by the big-endian raw id, so byte order equals GDID order and a
database index on the bytes sorts like the ids. The formats are fixed by docs/design.md because
tests outside the project check them.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any, ClassVar, Final

from mdb.errors import GDIDError

__all__ = ["GDID", "GDIDError", "check_sequence_name", "sequence_key"]

MAX_ERA: Final = 2**32 - 1
MAX_AUTHORITY: Final = 15
MAX_COUNTER: Final = 2**60 - 1
COUNTER_BITS: Final = 60
_HEX_LEN: Final = 24
_BYTES_LEN: Final = 12


def _decimal(part: str, name: str, limit: int, source: str) -> int:
    text = part.strip()
    # isdigit() alone would accept non-ASCII digits such as '²'; only ASCII decimals are valid.
    if not text or not (text.isascii() and text.isdigit()):
        raise GDIDError(f"invalid GDID {source!r}: {name} must be a decimal number, got {part!r}")
    # int() refuses strings over 4300 digits with a plain ValueError; no valid part is that long.
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(limit)):
        raise GDIDError(f"invalid GDID {source!r}: {name} has {len(digits)} digits, above its maximum {limit}")
    value = int(digits)
    if value > limit:
        raise GDIDError(f"invalid GDID {source!r}: {name} {value} is above its maximum {limit}")
    return value


class GDID:
    """Immutable, hashable, totally ordered GDID value.

    Ordering is by (era, raw id), which is the order of the 12-byte form.
    """

    __slots__ = ("_era", "_raw")

    _era: int
    _raw: int
    ZERO: ClassVar[GDID]

    def __init__(self, era: int, authority: int, counter: int) -> None:
        for name, value, limit in (
            ("era", era, MAX_ERA),
            ("authority", authority, MAX_AUTHORITY),
            ("counter", counter, MAX_COUNTER),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise GDIDError(f"invalid GDID: {name} must be an int, got {value!r}")
            if not 0 <= value <= limit:
                raise GDIDError(f"invalid GDID: {name} {value} is outside 0..{limit}")
        object.__setattr__(self, "_era", era)
        object.__setattr__(self, "_raw", authority << COUNTER_BITS | counter)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("GDID is immutable")

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_raw(cls, era: int, raw_id: int) -> GDID:
        if not isinstance(raw_id, int) or not 0 <= raw_id < 2**64:
            raise GDIDError(f"invalid GDID: raw id {raw_id!r} is not an unsigned 64-bit integer")
        return cls(era, raw_id >> COUNTER_BITS, raw_id & MAX_COUNTER)

    @classmethod
    def parse(cls, value: str) -> GDID:
        """Parse the text form ``era:authority:counter`` or the 24-digit hex form."""
        if not isinstance(value, str):
            raise GDIDError(f"invalid GDID {value!r}: expected text, got {type(value).__name__}")
        if ":" in value:
            return cls.parse_text(value)
        return cls.parse_hex(value)

    @classmethod
    def parse_text(cls, value: str) -> GDID:
        parts = value.split(":")
        if len(parts) != 3:
            raise GDIDError(f"invalid GDID {value!r}: expected era:authority:counter")
        era = _decimal(parts[0], "era", MAX_ERA, value)
        authority = _decimal(parts[1], "authority", MAX_AUTHORITY, value)
        counter = _decimal(parts[2], "counter", MAX_COUNTER, value)
        return cls(era, authority, counter)

    @classmethod
    def parse_hex(cls, value: str) -> GDID:
        text = value.strip()
        if text[:2] in ("0x", "0X"):
            text = text[2:]
        if len(text) != _HEX_LEN:
            raise GDIDError(
                f"invalid GDID {value!r}: hex form must have {_HEX_LEN} hex digits, got {len(text)}"
            )
        try:
            data = bytes.fromhex(text)
        except ValueError:
            raise GDIDError(f"invalid GDID {value!r}: not hexadecimal") from None
        if len(data) != _BYTES_LEN:  # fromhex skips inner whitespace; the length check catches it
            raise GDIDError(f"invalid GDID {value!r}: not hexadecimal")
        return cls.from_bytes(data)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> GDID:
        """The 12-byte form (4 era bytes, 8 raw-id bytes, big-endian): every key a plan or a
        session reads passes here, and any 12 bytes are a valid GDID, so nothing is checked but
        the length (:func:`_trusted`)."""
        raw = data if data.__class__ is bytes else memoryview(data).tobytes()  # an int is a TypeError, not zeros
        if len(raw) != _BYTES_LEN:
            raise GDIDError(f"invalid GDID bytes {raw!r}: expected {_BYTES_LEN} bytes, got {len(raw)}")
        if cls is not GDID:
            return cls.from_raw(int.from_bytes(raw[:4], "big"), int.from_bytes(raw[4:], "big"))
        return _trusted(int.from_bytes(raw[:4], "big"), int.from_bytes(raw[4:], "big"))

    @classmethod
    def from_sharding_value(cls, value: int, authority: int = 0) -> GDID:
        """Inverse of :attr:`sharding_value` (authority is not part of it, so it is given)."""
        if not 0 <= value <= MAX_ERA * 2**COUNTER_BITS + MAX_COUNTER:
            raise GDIDError(f"invalid GDID: sharding value {value} is out of range")
        era, counter = divmod(value, 2**COUNTER_BITS)
        return cls(era, authority, counter)

    # -- views -------------------------------------------------------------------------------

    @property
    def era(self) -> int:
        return self._era

    @property
    def authority(self) -> int:
        return self._raw >> COUNTER_BITS

    @property
    def counter(self) -> int:
        return self._raw & MAX_COUNTER

    @property
    def raw_id(self) -> int:
        return self._raw

    @property
    def hex(self) -> str:
        return f"{self._era:08x}{self._raw:016x}"

    @property
    def sharding_value(self) -> int:
        """``era * 2^60 + counter``: the value routing uses; authority never influences placement."""
        return self._era << COUNTER_BITS | (self._raw & MAX_COUNTER)

    @property
    def is_zero(self) -> bool:
        return self._era == 0 and self._raw == 0

    def __bytes__(self) -> bytes:
        return self._era.to_bytes(4, "big") + self._raw.to_bytes(8, "big")

    def __str__(self) -> str:
        return f"{self._era}:{self.authority}:{self.counter}"

    def __repr__(self) -> str:
        return f"GDID('{self}')"

    # -- comparison --------------------------------------------------------------------------

    def _key(self) -> tuple[int, int]:
        return (self._era, self._raw)

    def __eq__(self, other: object) -> bool:
        # (self._key() == other._key(), without the two calls: dict keys of routing caches compare GDIDs per session)
        if not isinstance(other, GDID):
            return NotImplemented
        return self._raw == other._raw and self._era == other._era

    def __lt__(self, other: GDID) -> bool:
        if not isinstance(other, GDID):
            return NotImplemented
        return self._key() < other._key()

    def __le__(self, other: GDID) -> bool:
        if not isinstance(other, GDID):
            return NotImplemented
        return self._key() <= other._key()

    def __gt__(self, other: GDID) -> bool:
        if not isinstance(other, GDID):
            return NotImplemented
        return self._key() > other._key()

    def __ge__(self, other: GDID) -> bool:
        if not isinstance(other, GDID):
            return NotImplemented
        return self._key() >= other._key()

    def __hash__(self) -> int:
        return hash((self._era, self._raw))  # hash(self._key()), one call fewer

    def __bool__(self) -> bool:
        return not self.is_zero

    def __reduce__(self) -> tuple[Any, ...]:
        return (GDID, (self.era, self.authority, self.counter))

    # -- pydantic ----------------------------------------------------------------------------

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """Accept a GDID, its text or hex form; serialize to the text form (docs/design.md)."""
        from pydantic_core import core_schema

        def coerce(value: Any) -> GDID:
            if isinstance(value, GDID):
                return value
            if isinstance(value, str):
                return cls.parse(value)
            raise GDIDError(f"invalid GDID {value!r}: expected text like '0:0:1' or 24 hex digits")

        return core_schema.no_info_plain_validator_function(
            coerce,
            serialization=core_schema.plain_serializer_function_ser_schema(str),
            json_schema_input_schema=core_schema.str_schema(),
        )


GDID.ZERO = GDID(0, 0, 0)


# -- trusted construction (for the generator's hot path) ---------------------------------------
# GDID.__init__ validates every part, which costs more than the rest of handing out an id. The
# generator builds ids from counters it reserved itself (always in range), so it may skip that.
# Writing the slots through their descriptors bypasses the immutability guard in __setattr__,
# and map() over C callables builds a whole run without a Python-level loop.

# The slot descriptors are read from the class __dict__: mypy sees ``GDID._era`` as the
# instance attribute (an int), not the member descriptor that Python puts there for a slot.
_new_object = object.__new__
_set_era: Callable[[GDID, int], None] = vars(GDID)["_era"].__set__
_set_raw: Callable[[GDID, int], None] = vars(GDID)["_raw"].__set__


def _trusted(era: int, raw_id: int) -> GDID:
    """A GDID from parts known valid (no checks): era 0..2^32-1, raw id 0..2^64-1."""
    g = _new_object(GDID)
    _set_era(g, era)
    _set_raw(g, raw_id)
    return g


def _trusted_run(era: int, raw_start: int, count: int) -> list[GDID]:
    """``count`` GDIDs of one era with consecutive raw ids from ``raw_start`` (no checks)."""
    ids: list[GDID] = list(map(_new_object, repeat(GDID, count)))
    deque(map(_set_era, ids, repeat(era, count)), maxlen=0)
    deque(map(_set_raw, ids, range(raw_start, raw_start + count)), maxlen=0)
    return ids


_SEQUENCE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,63}$")


def check_sequence_name(kind: str, value: str) -> None:
    """Refuse a GDID sequence's scope or name that could not be a CENTRAL key part (``kind`` names which)."""
    if not isinstance(value, str) or not _SEQUENCE_NAME.match(value):
        raise GDIDError(
            f"invalid GDID {kind} {value!r}: use 1-63 characters from letters, digits and _ . : -"
        )


def sequence_key(scope: str, sequence: str) -> str:
    """The CENTRAL key of a GDID sequence row: ``"{scope}/{sequence}"`` (names cannot hold '/')."""
    check_sequence_name("scope", scope)
    check_sequence_name("sequence", sequence)
    return f"{scope}/{sequence}"
