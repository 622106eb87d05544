"""Helpers and fixtures shared by the test groups (tests/unit, postgres, faults, cli); never tests."""
