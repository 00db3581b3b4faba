"""Side-by-side benchmark: flask-firm-channel against firm-channel 1.0.0, Redis pub/sub, raw
PostgreSQL LISTEN/NOTIFY and the raw-driver INSERT + COMMIT floor.

Run it from the repository root with ``python -m bench`` (``--help`` for options). It writes
``docs/benchmarks.md`` and ``docs/latency.png`` and prints the same tables.

``runner`` (the command and the interleaved rounds) → ``measure`` (one function per scenario)
→ ``worker`` (one contender in one process) → ``contenders`` (set-up and the adapters);
``metrics``, ``report``, ``plot`` and ``machine`` turn the raw rounds into the published page.

``python -m bench.fleet``: K listening processes on one database (``fleet`` → ``fleet_measure``
→ the same ``worker``; ``proccpu`` reads process and server CPU from ``/proc``; ``fleet_report``).
Kept light on purpose: worker processes import this package.
"""
