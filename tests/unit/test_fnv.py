"""FNV-1a-64 decides where CENTRAL keys live: the C function (mdb/_fnv.c) and the Python
reference (mdb/fnv.py) must agree on every input, and a process without the C module must
route exactly like one with it."""

from __future__ import annotations

import array
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fnv import ref_fnv1a_64 as spec_fnv1a_64  # the spec written out, independent of both implementations

from mdb import fnv

SPEC_VECTORS = [  # docs/design.md: offset basis 14695981039346656037, prime 1099511628211
    (b"", 0xCBF29CE484222325),
    (b"a", 0xAF63DC4C8601EC8C),
    (b"foobar", 0x85944171F73967E8),
]


def test_the_c_module_is_built_in_ci() -> None:
    """A silent fallback would make routing of new CENTRAL keys 2-5x slower with nothing red:
    CI installs with a compiler, so there the C module must be the one in use."""
    if os.environ.get("CI") != "true" and not fnv.NATIVE:
        pytest.skip("mdb._fnv was not built here (no compiler at install time); CI requires it")
    assert fnv.NATIVE
    assert fnv.fnv1a_64 is not fnv.py_fnv1a_64


@pytest.mark.parametrize("data, expected", SPEC_VECTORS)
def test_spec_vectors(data: bytes, expected: int) -> None:
    assert fnv.fnv1a_64(data) == fnv.py_fnv1a_64(data) == spec_fnv1a_64(data) == expected
    assert fnv.fnv1a_64_many([data]) == fnv.py_fnv1a_64_many([data]) == [expected]


@given(st.binary(max_size=300))
def test_native_and_python_agree_on_any_bytes(data: bytes) -> None:
    h = fnv.fnv1a_64(data)
    assert h == fnv.py_fnv1a_64(data) == spec_fnv1a_64(data)
    assert 0 <= h < 2**64


@given(st.binary(max_size=64))
def test_every_bytes_like_form_hashes_the_same(data: bytes) -> None:
    expected = spec_fnv1a_64(data)
    for form in (data, bytearray(data), memoryview(data)):
        assert fnv.fnv1a_64(form) == fnv.py_fnv1a_64(form) == expected
    assert fnv.fnv1a_64_many([bytearray(data), memoryview(data)]) == [expected, expected]


@given(st.binary(max_size=64), st.integers(min_value=2, max_value=5))
def test_strided_and_wide_buffers_hash_their_raw_bytes_in_both(data: bytes, step: int) -> None:
    """What ``memoryview(x).tobytes()`` gives, whatever the buffer's shape or item size."""
    strided = memoryview(data)[::step]
    wide = array.array("I", data[: len(data) // 4 * 4])
    for form in (strided, wide, memoryview(wide)):
        expected = spec_fnv1a_64(memoryview(form).tobytes())
        assert fnv.fnv1a_64(form) == fnv.py_fnv1a_64(form) == expected
        assert fnv.fnv1a_64_many([form]) == fnv.py_fnv1a_64_many([form]) == [expected]


@given(st.lists(st.binary(max_size=40), max_size=50))
def test_many_is_one_by_one_in_both_implementations(datas: list[bytes]) -> None:
    expected = [spec_fnv1a_64(d) for d in datas]
    assert fnv.fnv1a_64_many(datas) == fnv.py_fnv1a_64_many(datas) == expected
    assert fnv.fnv1a_64_many(tuple(datas)) == expected


@pytest.mark.parametrize("impl", [fnv.fnv1a_64, fnv.py_fnv1a_64], ids=["fnv1a_64", "py_fnv1a_64"])
def test_a_str_is_refused_not_hashed_by_some_encoding(impl: object) -> None:
    with pytest.raises(TypeError):
        impl("user@example.com")  # type: ignore[operator]


@pytest.mark.parametrize("impl", [fnv.fnv1a_64_many, fnv.py_fnv1a_64_many], ids=["native", "python"])
def test_many_refuses_a_non_bytes_item(impl: object) -> None:
    with pytest.raises(TypeError):
        impl([b"ok", 17])  # type: ignore[operator]


def test_a_process_without_the_c_module_routes_the_same() -> None:
    """The fallback is a real code path (an install without a compiler): run it in a process
    where ``mdb._fnv`` cannot be imported and compare its placements with this process's."""
    keys = [f"user{i}@example.com" for i in range(200)] + ["", "é", "\u4e2d\u6587@example.com"]
    script = (
        "import sys, json\n"
        "sys.modules['mdb._fnv'] = None  # import of it raises ImportError\n"
        "from mdb import fnv\n"
        "from mdb.router import Router\n"
        "from mdb.partition_map import parse_map\n"
        "assert not fnv.NATIVE\n"
        "r = Router(parse_map(sys.stdin.read(), 'map'))\n"
        f"keys = {keys!r}\n"
        "one = [[p.hash, p.server] for p in map(r.locate_central, keys)]\n"
        "many = [[p.hash, p.server] for p in Router(r.map).locate_central_many(keys)]\n"
        "print(json.dumps([one, many]))\n"
    )
    text = (
        "version: 1\nservers:\n"
        + "".join(f'  c{i}: {{primary: "sqlite:///c{i}.db"}}\n' for i in range(5))
        + "areas:\n  directory: {kind: central, shards: [c3, c1, c4, c0, c2]}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    from mdb.partition_map import parse_map
    from mdb.router import Router

    router = Router(parse_map(text, "map"))
    here = [[p.hash, p.server] for p in map(router.locate_central, keys)]
    one, many = json.loads(done.stdout)
    assert one == many == here
