"""Side-by-side benchmark: flask-firm-channel against firm-channel 1.0.0, Redis pub/sub, raw
PostgreSQL LISTEN/NOTIFY and the raw-driver INSERT + COMMIT floor.

Run it from the repository root with ``python -m bench`` (``--help`` for options). It writes
``docs/benchmarks.md`` and ``docs/latency.png`` and prints the same tables.

Kept light on purpose: every measurement spawns fresh worker processes that import this package.
"""
