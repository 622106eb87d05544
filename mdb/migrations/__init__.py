"""Schema migrations on every shard, with Alembic as the engine (docs/migrations.md).

An area's briefcase tables change over time; Alembic already knows how to write, review and
apply such changes to one database. This package applies one Alembic history per area to
every SQL server that holds the area's tables (its shards, the spare servers, relocation
targets), a few servers at a time, canary first, and keeps the truth where Alembic keeps it:
the version table on each server (``alembic_version_<area>``).

Modules (import them directly; this package file imports nothing, so that the low-level
:mod:`mdb.migrations.revisions`, which moves and ``schema apply`` may call, does not pull the
Store in with it):

* :mod:`mdb.migrations.revisions` -- the version table of an area on one connection, and the
  guard a move calls before copying (same revision on both sides);
* :mod:`mdb.migrations.scripts` -- where an area's history lives, and ``revision``;
* :mod:`mdb.migrations.ledger` -- the fleet ledger in CENTRAL (``mdb_migration_runs``);
* :mod:`mdb.migrations.fleet` -- ``status``, ``up`` and ``down`` over the fleet, and the rollout
  loop (canary, parallel, stop on failure, ledger) every kind of area shares;
* :mod:`mdb.migrations.documents` -- document areas (MongoDB): their declared indexes, created
  and dropped on every server by the same loop.
* :mod:`mdb.migrations.rollout` -- one ``migrate up|down`` over every area: each way of
  migrating (histories, declared indexes) chosen by the capabilities of the areas' servers.
"""
