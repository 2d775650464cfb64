"""Rigs the tests, chaos scenarios and benchmarks share (test and bench modules import only these).

``procs``: the ``cdcd()`` runner, daemon processes and their state, log lines, waits.
``writer``: the deterministic node writer (in-process and as a child process).
``config``: daemon TOML configs.  ``wal``: the WAL reference readers and CDC-dir listings.
``realtime``: the node-process rig of the hand-over tests.  ``replication``: raw endpoint exchange.
``lake``: lake consumer configs and the change-log checks.  ``chaos``: the chaos suite's rig and accounting.
``bench``: timing, repetition, child stop/kill helpers.  ``pg_cluster``, ``pg_arrivals``,
``rt_lag_consumer``: benchmark pieces.  ``wal_fuzz``: the WAL reader's fuzz targets.
"""
