"""Landing a batch in ``<lake>/changes``, exactly once: the row builders (C and Python), the Parquet
files, the Delta commit, both writers."""
