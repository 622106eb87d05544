"""The root of the test tree: loads the shared fixtures (tests/support/plugin.py) for every group.

Layout (docs/testing.md): tests/unit (no server), tests/postgres (real PostgreSQL, PgBouncer),
tests/faults (processes killed or paused at fault points), tests/cli (the operator CLI). Helpers
shared between test modules live in tests/support (``pythonpath = ["tests"]`` in pyproject.toml);
a test module never imports another test module.
"""

pytest_plugins = ["pytester", "support.plugin", "support.cputime"]  # pytester: tests/postgres/test_harness.py runs the plugin in a nested session
