"""Helpers for mdb's own tests and benchmarks (not used by the router at run time).

Kept out of ``mdb/__init__`` so that importing mdb never needs the ``test`` extra.
"""
