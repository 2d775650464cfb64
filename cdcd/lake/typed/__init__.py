"""The typed tables ``<lake>/tables/<cache>``: type inference, declared types, widening, their layout
and their compaction."""
