"""The statements of a batched cutover: each a single round trip on PostgreSQL.

A batch's write pause is the time between taking its briefcases' locks on the source and the
commit of its fences; every round trip and every pass over the rows in that window is pause
for every one of its briefcases. So the source's side of the commit point is one statement
(:func:`fence_and_delete`): it writes the fences, deletes the rows and returns the checksums
*of the rows it deleted*, read once. Those sums are compared with the target's, which the
pre-copy computed by a query of its own after its COPY (:func:`claim_and_copy`), before the
lock: the target's copy is behind ``incoming`` rows then, so nothing changes it.

The comparison happens before the source commits, behind a savepoint: a briefcase written
between the pre-copy and the lock has other sums, the statement is rolled back to the
savepoint (fences and deletes undone, the locks kept) and only those briefcases are copied
again (:mod:`mdb.moves.batch`). The sums being of the deleted rows, the commit point deletes
exactly the verified rows by construction.

SQLite, and a PostgreSQL source whose target is SQLite (checksums in Python), run the same
steps as several statements (no data-modifying CTE there; no SQL digest on the other side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql
from sqlalchemy import union
from sqlalchemy import select
from sqlalchemy.engine import Connection

from mdb.errors import BatchAbortedError
from mdb.gdid import GDID
from mdb.moves import verify
from mdb.moves.copy import AreaTable, copy_batch, delete_batch, delete_keys, is_postgres, select_keys, update_keys
from mdb.moves.gate import CutoverGate
from mdb.moves.sql_steps import bound_statements, set_states, states, time_left_ms
from mdb.system_tables import STATE_GONE, STATE_INCOMING

__all__ = [
    "RESYNC_BLOCK", "Blocks", "Sums", "SourceCut", "apply_diffs", "claim_and_copy", "fence_and_delete", "resync", "resync_blocks",
    "settle", "target_holdings", "undo",
]

Sums = dict[tuple[str, GDID], verify.TableSum]
"""(table, briefcase) -> (rows, checksum); a briefcase without rows in a table has no entry."""

SAVEPOINT = "mdb_cutover"


@dataclass
class SourceCut:
    """What the source's side of a commit point found: the sums of the rows it deleted, and the
    briefcases it refused because the source records them as moving or gone (nothing is deleted then)."""

    sums: Sums
    blocked: dict[GDID, str]


def settle(conn: Connection, deadline: float | None) -> None:
    """PostgreSQL: this transaction's settings for a batch's statements, in one round trip.

    The statement bound (``statement_timeout`` set to the time left before ``deadline``, a
    ``time.monotonic()``; :func:`mdb.moves.sql_steps.bound_statements` says why), index scans
    only (every statement selects a few briefcases by key, and a target shard filled by the
    reshard itself has no statistics yet, where the planner would scan whole tables), and the
    output settings the text checksums need (:data:`mdb.moves.verify.PG_OUTPUT_SETTINGS`).
    """
    if not is_postgres(conn):
        return
    settings = f"SET LOCAL enable_seqscan = off; {verify.PG_OUTPUT_SETTINGS}"
    if deadline is None:
        conn.exec_driver_sql(settings)
    else:
        bound_statements(conn, deadline, also=settings)


def target_holdings(conn: Connection, area: str, tables: Sequence[AreaTable], gdids: Sequence[GDID]) -> tuple[dict[GDID, dict[str, Any]], set[GDID]]:
    """The state rows of ``gdids`` here, and those of them with at least one row here in any table.

    PostgreSQL: two statements in one pipeline, the keys sent once each as an array.
    """
    if not is_postgres(conn):
        wanted = list(gdids)
        query = union(*(select(at.table.c[at.key].label("k")).where(at.table.c[at.key].in_(wanted)) for at in tables))
        return states(conn, area, gdids), {g for (g,) in conn.execute(query)}
    keys = _keys(gdids)
    held = sql.SQL(" UNION ").join(
        sql.SQL("SELECT {key} FROM {table} WHERE {key} = ANY(%(keys)b)").format(key=sql.Identifier(at.key), table=sql.Identifier(at.name))
        for at in tables
    )
    raw: Any = conn.connection.driver_connection
    with raw.pipeline():
        raw.execute("SELECT set_config('enable_seqscan', 'off', true)", prepare=False)  # see settle()
        state_rows = raw.execute(
            "SELECT gdid, state, peer, move_id FROM mdb_briefcase_state WHERE area = %(area)s AND gdid = ANY(%(keys)b)",
            {"area": area, "keys": keys}, prepare=False,
        )
        with_rows = raw.execute(held, {"keys": keys}, prepare=False)
    found = {GDID.from_bytes(bytes(g)): {"state": state, "peer": peer, "move_id": move_id} for g, state, peer, move_id in state_rows.fetchall()}
    return found, {GDID.from_bytes(bytes(g)) for (g,) in with_rows.fetchall()}


def _keys(gdids: Sequence[GDID]) -> list[bytes]:
    """The batch's keys as one parameter, always sent binary (``%(keys)b``): psycopg's text form
    of a ``bytea[]`` escapes every byte: measured 0.37 against 0.17 ms a statement at 80 keys, and one is under the lock."""
    return [bytes(g) for g in gdids]


def _claim(conn: Connection, area: str, gdids: Sequence[GDID], source: str, move_id: str) -> list[GDID]:
    """Write the ``incoming`` rows of ``gdids`` where their state is absent or an old fence; the briefcases refused.

    Conditional, so two movers racing into one target cannot both claim a briefcase: the
    second waits on the first's row lock and then finds it ``incoming``.
    """
    if not is_postgres(conn):
        taken = {g for g, s in states(conn, area, gdids).items() if s["state"] != STATE_GONE}
        set_states(conn, area, [g for g in gdids if g not in taken], STATE_INCOMING, source, move_id)
        return sorted(taken)
    raw: Any = conn.connection.driver_connection
    with raw.cursor() as cur:
        cur.execute(
            "INSERT INTO mdb_briefcase_state (area, gdid, state, peer, move_id, changed_at) "
            "SELECT %(area)s, k, %(incoming)s, %(peer)s, %(move_id)s, current_timestamp FROM unnest(%(keys)b) AS k "
            "ON CONFLICT (area, gdid) DO UPDATE SET state = excluded.state, peer = excluded.peer, "
            "move_id = excluded.move_id, changed_at = excluded.changed_at WHERE mdb_briefcase_state.state = %(gone)s "
            "RETURNING gdid",
            {"area": area, "keys": _keys(gdids), "incoming": STATE_INCOMING, "gone": STATE_GONE, "peer": source, "move_id": move_id},
            prepare=False,
        )
        claimed = {bytes(k) for (k,) in cur.fetchall()}
    return sorted(g for g in gdids if bytes(g) not in claimed)


def claim_and_copy(src: Connection, dst: Connection, area: str, tables: Sequence[AreaTable], gdids: Sequence[GDID],
                   source: str, move_id: str, hashed: frozenset[str], gate: CutoverGate,
                   on_table: Callable[[str, int], None] | None = None) -> tuple[list[GDID], Sums, Blocks]:
    """The pre-copy, in the caller's transactions: ``incoming`` rows, one COPY per table, then the
    target's sums by a query of their own. Returns (briefcases refused, sums, blocks); refused: nothing copied.

    Each statement is a step of ``gate``: none starts while another worker's cutover is on.
    ``blocks``: the target's sums of key ranges of every table of a briefcase larger than
    :data:`RESYNC_BLOCK` rows (SQL method), what a re-sync under the lock compares first
    (:func:`resync`); taken here, outside the lock (nothing changes a copy behind ``incoming`` rows).
    """
    with gate.step():
        refused = _claim(dst, area, gdids, source, move_id)
    if refused:
        return refused, {}, {}
    copy_batch(src, dst, tables, gdids, gate, on_table)
    method = verify.method_for(src, dst)
    with gate.step():
        settle(dst, None)
        sums = verify.batch_sums(dst, tables, gdids, method, pinned=True, hashed=hashed)
    if method != "sql":
        return [], sums, {}
    blocks: Blocks = {}
    for (name, g), s in sums.items():
        if s.rows > RESYNC_BLOCK:
            with gate.step():
                parts = resync_blocks(src, [next(at for at in tables if at.name == name)], g, {name: s.rows}, hashed)
                blocks[(name, g)] = (parts, verify.part_sums(dst, parts, g))
    return [], sums, blocks


def fence_and_delete(src: Connection, area: str, tables: Sequence[AreaTable], gdids: Sequence[GDID], target: str,
                     move_id: str, method: verify.Method, deadline: float, hashed: frozenset[str]) -> SourceCut:
    """The source's side of the commit point, in its locked transaction, after a savepoint.

    Fences (``gone`` to ``target``) and deletes every row of ``gdids``, returning the deleted
    rows' sums and the briefcases the source records as moving or gone. The caller compares
    and then commits, or rolls back to the savepoint (:func:`undo`).
    Between PostgreSQL servers (``method`` "sql"): the settings, the savepoint and one statement,
    sent in one pipeline. Otherwise (a SQLite side: checksums in Python, which no SQL digest on
    the source can match) several statements: the sums read before the delete, under the lock.
    """
    if not is_postgres(src) or method != "sql":
        settle(src, deadline)
        src.exec_driver_sql(f"SAVEPOINT {SAVEPOINT}")
        blocked = {g: s["state"] for g, s in states(src, area, gdids).items() if s["state"] in (STATE_GONE, STATE_INCOMING)}
        sums = verify.batch_sums(src, tables, gdids, method)
        set_states(src, area, gdids, STATE_GONE, target, move_id)
        deleted = delete_batch(src, tables, gdids)
        verified: dict[str, int] = {}
        for (name, _), s in sums.items():
            verified[name] = verified.get(name, 0) + s.rows
        wrong = [f"{name}: {n} deleted, {verified.get(name, 0)} verified" for name, n in deleted.items() if n != verified.get(name, 0)]
        if wrong:  # the caller's transaction, fences and deletes with it, is rolled back with the lock
            raise BatchAbortedError(f"the commit point would delete rows that were not verified ({'; '.join(wrong)})", None)
        return SourceCut(sums, blocked)
    common = {
        "area": sql.Placeholder("area"), "keys": sql.SQL("%(keys)b"), "gone": sql.Placeholder("gone"),
        "incoming": sql.Placeholder("incoming"), "peer": sql.Placeholder("peer"), "move_id": sql.Placeholder("move_id"),
    }
    ctes = [
        sql.SQL("blocked AS (SELECT gdid, state FROM mdb_briefcase_state WHERE area = {area} AND gdid = ANY({keys}) "
                "AND state IN ({gone}, {incoming}))").format(**common),
        sql.SQL("fenced AS (INSERT INTO mdb_briefcase_state (area, gdid, state, peer, move_id, changed_at) "
                "SELECT {area}, k, {gone}, {peer}, {move_id}, current_timestamp FROM unnest({keys}) AS k "
                "ON CONFLICT (area, gdid) DO UPDATE SET state = excluded.state, peer = excluded.peer, "
                "move_id = excluded.move_id, changed_at = excluded.changed_at RETURNING 1)").format(**common),
    ]
    sums_of: list[sql.Composable] = []
    for i, at in enumerate(tables):
        cte, key = sql.Identifier(f"d{i}"), sql.Identifier(at.key)
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in at.columns)
        ctes.append(sql.SQL("{name} AS (DELETE FROM {table} WHERE {key} = ANY({keys}) RETURNING {cols})").format(
            name=cte, table=sql.Identifier(at.name), key=key, keys=common["keys"], cols=cols))
        sums_of.append(sql.SQL("SELECT {i}, {key}, count(*), {digest} FROM {name} GROUP BY {key}").format(
            i=sql.Literal(i), key=key, digest=sql.SQL(verify.sql_digest(at, at.name in hashed)), name=cte))
    sums_of.append(sql.SQL("SELECT -1, gdid, 0, state::text FROM blocked"))
    query = sql.SQL("WITH {ctes} {selects}").format(ctes=sql.SQL(", ").join(ctes), selects=sql.SQL(" UNION ALL ").join(sums_of))
    params = {"area": area, "keys": _keys(gdids), "gone": STATE_GONE, "incoming": STATE_INCOMING, "peer": target, "move_id": move_id}
    raw: Any = src.connection.driver_connection
    with raw.pipeline():
        raw.execute(f"SELECT set_config('statement_timeout', '{time_left_ms(deadline)}', true), set_config('enable_seqscan', 'off', true), "
                    f"{verify.PG_OUTPUT_CONFIG}", prepare=False)
        raw.execute(f"SAVEPOINT {SAVEPOINT}", prepare=False)
        cur = raw.execute(query, params, prepare=False)
    rows = cur.fetchall()
    out = SourceCut({}, {})
    for i, key, count, digest in rows:
        g = GDID.from_bytes(bytes(key))
        if i < 0:
            out.blocked[g] = str(digest)
        else:
            out.sums[(tables[i].name, g)] = verify.TableSum(int(count), str(digest))
    return out


RESYNC_BLOCK = 20_000
"""A re-sync compares key ranges of about this many rows (at most 64 per table) before rows.

Smaller ranges narrow down where rows changed but cost more: each range is an index scan and
an aggregate of its own (measured: 5,000-row ranges make summing 200k rows 1.7x slower).
"""

Blocks = dict[tuple[str, GDID], tuple[list[verify.Part], list[verify.TableSum]]]
"""(table, briefcase) -> its key ranges and the target's sums of them right after the pre-copy."""

Diff = tuple[AreaTable, list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]
"""(table, primary keys only on the source, only on the target, on both with other values)."""


def resync_blocks(src: Connection, tables: Sequence[AreaTable], gdid: GDID, rows: dict[str, int],
                  hashed: frozenset[str] = frozenset()) -> list[verify.Part]:
    """Key ranges of about RESYNC_BLOCK rows (at most 64 per table) for a re-sync, bounds read on ``src``;
    ``hashed``: the tables both servers sum by row hash (:func:`mdb.moves.verify.hashable_tables`)."""
    parts: list[verify.Part] = []
    for at in tables:
        block = max(RESYNC_BLOCK, -(-rows.get(at.name, 0) // 64))
        parts += verify.plan_parts(src, [at], gdid, rows, block=block, hashed=hashed)
    return parts


def _table_diff(src: Connection, dst: Connection, at: AreaTable, gdid: GDID, method: verify.Method,
                blocks: tuple[list[verify.Part], list[verify.TableSum]] | None) -> Diff:
    """The keys of ``at`` that differ for ``gdid``: by row digests, of the key ranges whose sums differ
    when the pre-copy summed ranges (the work then follows what changed, not the briefcase's size)."""
    only_src: list[tuple[Any, ...]] = []
    only_dst: list[tuple[Any, ...]] = []
    different: list[tuple[Any, ...]] = []
    if blocks is None:
        ranges: list[verify.Part | None] = [None]
    else:
        parts, target_sums = blocks
        ranges = [part for part, mine, theirs in zip(parts, verify.part_sums(src, parts, gdid), target_sums, strict=True) if mine != theirs]
    for part in ranges:
        a, b, c = verify.differing_keys(verify.row_digests(src, at, gdid, method, part), verify.row_digests(dst, at, gdid, method, part))
        only_src += a
        only_dst += b
        different += c
    return at, only_src, only_dst, different


def apply_diffs(src: Connection, dst: Connection, gdid: GDID, diffs: list[Diff]) -> int:
    """Make the target's rows of ``gdid`` those of the source, key by key; ``diffs`` parents first.

    Rows only on the target are deleted children first, then rows only on the source copied
    parents first, and rows on both overwritten in place (a parent deleted and inserted again
    would break its children's foreign keys). Returns the rows redone.
    """
    for at, _, only_dst, _ in reversed(diffs):
        delete_keys(dst, at, gdid, only_dst)
    for at, only_src, _, different in diffs:
        select_keys(src, dst, at, gdid, only_src)
        update_keys(src, dst, at, gdid, different)
    return sum(len(a) + len(b) + len(c) for _, a, b, c in diffs)


def resync(src: Connection, dst: Connection, tables: Sequence[AreaTable], changed: Sequence[GDID], source_sums: Sums,
           target_sums: Sums, method: verify.Method, blocks: Blocks) -> int:
    """Bring the target's copies of ``changed`` up to date with the locked source, row by row; the rows redone.

    Only the tables whose sums differ are compared, by row digests read on each side (key
    ranges first where the pre-copy summed them, :func:`claim_and_copy`), and only the rows
    that differ are deleted and copied again: the work under the lock follows what changed
    since the pre-copy, not the briefcases' size. Whatever this missed, the verification after
    it (the target summed again, the source's statement run again) catches.
    """
    redone = 0
    for g in changed:
        diffs = [_table_diff(src, dst, at, g, method, blocks.get((at.name, g)))
                 for at in tables if source_sums.get((at.name, g)) != target_sums.get((at.name, g))]
        redone += apply_diffs(src, dst, g, diffs)
    return redone


def undo(src: Connection) -> None:
    """Roll the source back to before :func:`fence_and_delete` (fences and deletes undone, the locks kept)."""
    src.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
