"""Reading and checking the lake: ``lake sql`` and its readers, ``lake check``, ``lake verify``, the
printed reports."""
