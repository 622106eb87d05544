"""Shared by test_router and the suites beside it (moved out of test_router, which used to be imported by other test modules)."""

from __future__ import annotations



def ref_fnv1a_64(data: bytes) -> int:
    """Independent FNV-1a 64 (the spec's constants written out)."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) % 2**64
    return h
