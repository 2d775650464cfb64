"""Keeping the lake in shape while it runs: compaction into ``state`` and the typed tables, small files
bounded, OPTIMIZE and VACUUM, and the scheduled maintainer that runs them."""
