"""The Parquet data lake: exactly-once change log, compaction, verification (DESIGN §7)."""
