"""Fault injection for cdcd (`make chaos`): real node and daemon processes under SIGKILL, SIGSTOP, full disks, clock
jumps, slow and failing consumers, each run checked against the WAL entry by entry.

``python -m tests.chaos.run [--short] [--only NAME] [--seed N]``; ``tests/test_chaos_short.py`` runs the short mode
under pytest. Scenario modules return a ``common.Result`` per scenario; ``run.py`` prints the table and writes
``var/chaos/latest.json``.
"""
