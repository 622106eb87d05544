"""Safe partition map edits (docs/design.md invariant 4), one module per job.

- :mod:`mdb.maps.diff`: the pure diff of two map versions under given high-water marks (core).
- :mod:`mdb.maps.text`: secret-safe map text, and the one place a map file is written (core).
- :mod:`mdb.maps.history`: the applied maps recorded in CENTRAL (``mdb_maps``), through a
  :class:`mdb.cluster.Cluster`; the Store reads it on refresh, so it sits below the Store.
- :mod:`mdb.maps.high_water`: the live high-water marks, through a Cluster.
- :mod:`mdb.maps.apply`: stamping a new map onto the shards with lock and undo (a tool, above
  the Store).

This package imports none of them here: the Store imports :mod:`mdb.maps.history`, and
importing the tool-level :mod:`mdb.maps.apply` from here would put the Store under itself.
"""
