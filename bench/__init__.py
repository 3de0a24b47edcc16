"""Benchmark harness: tokend against the bare layers it stands on, in the same run.

Run ``python -m bench --help``. Every scenario starts its own servers on loopback,
measures for a bounded time, stops everything and reports one or more table rows
with a ratio to its baseline. Not part of the unit tests (one smoke test runs it).
"""
