"""Fuzzing of the WAL reader: targets in ``wal_fuzz``, the command-line runner in ``run`` (``make fuzz``)."""
