"""Fuzzing of the WAL reader: targets in ``tests.support.wal_fuzz``, the command-line runner in ``run``
(``make fuzz``)."""
