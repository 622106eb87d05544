"""FNV-1a-64, the CENTRAL sharding hash fixed by docs/design.md: native when built, Python otherwise.

The hash decides on which CENTRAL shard a key lives, so every process must compute the same
value whichever implementation it runs. ``mdb._fnv`` (mdb/_fnv.c) is built by ``pip install``
where a C compiler is present and hashes a key in ~40 ns; without it the pure-Python functions
below (~2 us for a 25-byte key) are used, with the same results (tests/unit/test_fnv.py checks the
two against each other and the spec's vectors). ``NATIVE`` says which one this process runs;
``tools/bench.py route`` reports it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["NATIVE", "fnv1a_64", "fnv1a_64_many", "py_fnv1a_64", "py_fnv1a_64_many"]

FNV_OFFSET_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK64 = 2**64 - 1


def py_fnv1a_64(data: bytes | bytearray | memoryview) -> int:
    """FNV-1a, 64-bit, in Python: the reference and the fallback of the C function.

    Hashes the raw bytes of any bytes-like object in C order (``memoryview(data).tobytes()``);
    a ``str`` or an ``int`` is a TypeError, as in C.
    """
    h = FNV_OFFSET_BASIS
    for byte in data if data.__class__ is bytes else memoryview(data).tobytes():
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


def py_fnv1a_64_many(datas: Sequence[bytes | bytearray | memoryview]) -> list[int]:
    """``[py_fnv1a_64(d) for d in datas]``, several times faster for hundreds of keys in Python.

    FNV-1a is sequential over a key's bytes but independent between keys, so the keys of one
    length are hashed together: each key's state is a 64-bit lane in a 128-bit slot of one
    big Python int, and each byte position is one XOR, one multiply and one mask of that int
    (C loops over all keys at once). A lane times the 41-bit prime stays below 2^105, so it
    never carries into the next slot.
    """
    keys = [memoryview(d).tobytes() for d in datas]  # a str or an int is a TypeError, as in C
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, data in enumerate(keys):
        by_length.setdefault(len(data), []).append(i)
    for length, indexes in by_length.items():
        count = len(indexes)
        h = int.from_bytes(_LANE_BASIS * count, "little")
        mask = int.from_bytes(_LANE_MASK * count, "little")
        joined = b"".join([keys[i] for i in indexes])
        column = bytearray(16 * count)
        for position in range(length):
            column[0::16] = joined[position::length]
            h = ((h ^ int.from_bytes(column, "little")) * FNV_PRIME) & mask
        for i, (value,) in zip(indexes, struct.iter_unpack("<Q8x", h.to_bytes(16 * count, "little"))):
            out[i] = value
    return out


_LANE_BASIS = FNV_OFFSET_BASIS.to_bytes(8, "little") + bytes(8)
_LANE_MASK = b"\xff" * 8 + bytes(8)

try:
    from mdb._fnv import fnv1a_64, fnv1a_64_many
except ImportError:  # not built (no compiler at install time): the same hashes, ~60x slower
    NATIVE = False
    fnv1a_64 = py_fnv1a_64
    fnv1a_64_many = py_fnv1a_64_many
else:
    NATIVE = True
