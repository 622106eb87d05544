"""Routing: ``Router.locate`` and ``Router.locate_central`` next to a plain dict lookup.

The router is pure (no I/O) and bisects precomputed start lists, so a GDID should route in
O(log partitions). This section checks that claim from 1 to 10,000 partitions: per size, the
rate of ``locate("user", gdid)`` over 1,000 GDIDs spread over every partition, next to
a dict lookup of the same GDIDs (the floor of any routing table); and the rate of
``locate_central(key)`` over 1,000 e-mail keys next to ``dict[key]``: repeated keys (the
router remembers the placement of a str/bytes key) and keys it has not seen (FNV-1a-64 plus a
modulo, every call; and ``locate_central_many`` hashing the batch at once). The hash itself is
timed on its own next to its pure-Python reference (``mdb.fnv.py_fnv1a_64``, what a process
without the C module runs). Maps are built through ``parse_map`` from YAML text, as a process
loads them.
"""

from __future__ import annotations

import random

from benchmarks import BenchContext, Result, compare
from mdb import fnv
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap, parse_map
from mdb.router import Router

SECTION = "route"
SIZES = (1, 10, 100, 1000, 10_000)
BATCH = 1000
SPACING = 1_000_000  # counter values between partition starts


def _map(partitions: int) -> PartitionMap:
    """``partitions`` partitions of one shard each (a server serves an area at most once)."""
    servers = "".join(f'  s{i}: {{primary: "sqlite:///s{i}.db"}}\n' for i in range(max(partitions, 4)))
    parts = "".join(f'      - {{start: "0:0:{p * SPACING}", shards: [s{p}]}}\n' for p in range(partitions))
    return parse_map(
        f"version: 1\nservers:\n{servers}areas:\n  central: {{kind: central, shards: [s0, s1, s2, s3]}}\n"
        f"  user:\n    partitions:\n{parts}",
        f"<route bench, {partitions} partitions>",
    )


def run(ctx: BenchContext) -> list[Result]:
    rng = random.Random(11)
    rounds = ctx.iterations(5, 2)
    calls = ctx.iterations(200, 10)
    results: list[Result] = []
    keys = [f"user{rng.randrange(10**9)}@example.com" for _ in range(BATCH)]
    for n in SIZES:
        router = Router(_map(n))
        gdids = [GDID(0, rng.randrange(16), rng.randrange(1, n * SPACING)) for _ in range(BATCH)]
        table = {g: router.locate("user", g) for g in gdids}
        locate = router.locate

        def routed() -> None:
            for g in gdids:
                locate("user", g)

        def looked_up() -> None:
            for g in gdids:
                table[g]  # noqa: B018  (the lookup is the work)

        s, b = compare(routed, looked_up, iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
        results.append(Result(SECTION, f"locate, {n} partition{'s' if n != 1 else ''}", BATCH / s, "routes/s",
                              "dict lookup by GDID", BATCH / b, "bisect over partition starts"))
        if n == SIZES[0]:
            central = {k: router.locate_central(k) for k in keys}
            locate_central = router.locate_central

            def hashed() -> None:
                for k in keys:
                    locate_central(k)

            def key_looked_up() -> None:
                for k in keys:
                    central[k]  # noqa: B018

            s, b = compare(hashed, key_looked_up, iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
            results.append(Result(SECTION, "locate_central, 4 CENTRAL shards", BATCH / s, "routes/s",
                                  "dict lookup by key", BATCH / b, "repeated keys: the router's key cache"))
            pmap = router.map

            def hashed_fresh() -> None:
                cold = Router(pmap).locate_central  # a new router has seen no key (its build: ~1% of this)
                for k in keys:
                    cold(k)

            s, b = compare(hashed_fresh, key_looked_up, iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
            results.append(Result(SECTION, "locate_central, new keys", BATCH / s, "routes/s",
                                  "dict lookup by key", BATCH / b, f"FNV-1a-64 of ~25 UTF-8 bytes, {_impl()}"))

            def batched_fresh() -> None:
                Router(pmap).locate_central_many(keys)

            s, b = compare(batched_fresh, key_looked_up, iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
            results.append(Result(SECTION, "locate_central_many, new keys", BATCH / s, "routes/s",
                                  "dict lookup by key", BATCH / b, "FNV-1a-64 of 1,000 keys at once (fnv1a_64_many)"))
            datas = [k.encode("utf-8") for k in keys]
            hash_native, hash_python = fnv.fnv1a_64, fnv.py_fnv1a_64

            def hashed_native() -> None:
                for d in datas:
                    hash_native(d)

            def hashed_python() -> None:
                for d in datas:
                    hash_python(d)

            s, b = compare(hashed_native, hashed_python, iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
            results.append(Result(SECTION, "fnv1a_64 of an e-mail key", BATCH / s, "hashes/s",
                                  "the Python reference py_fnv1a_64", BATCH / b, _impl()))
    return results


def _impl() -> str:
    return "C (mdb._fnv)" if fnv.NATIVE else "Python: mdb._fnv not built"
