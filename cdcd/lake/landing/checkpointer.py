"""Checkpoints of ``changes`` written in a thread of their own, off the writer's commit path.

delta-rs writes a checkpoint inside the commit that reaches ``delta.checkpointInterval`` (a post-commit hook):
that one commit then takes as long as writing every live file's ``add`` and every tombstone's ``remove`` (tens
of thousands at live commit rates, most of a second on a busy machine), and the batch it lands, and every batch
queued behind it, wait. The realtime worker commits a dozen times a second against a lag goal of a few hundred
milliseconds, so every hundredth batch would miss it. The lake sink commits ``changes`` without that hook and
tells a ``Checkpointer`` each version it made; once ``interval`` versions have passed since the last checkpoint,
the checkpointer's thread brings its own ``DeltaTable`` up to date and writes one there, while the writer goes
on. A checkpoint changes no data: one that fails is logged (``lake_checkpoint_failed``) and tried again at the
next due version; killed while writing it, the process leaves the log as it was (``_last_checkpoint`` moves
last), at worst with a checkpoint file readers never name.
"""

from __future__ import annotations

import threading

import structlog
from deltalake import DeltaTable

from cdcd import failpoints, metrics
from cdcd.lake.deltalog import last_checkpoint
from cdcd.lake.storage import LakeDir, open_delta
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")

WRITING = "lake.checkpoint.writing"
"""Fail point: the checkpointer's thread about to write a checkpoint (the writer's commits go on meanwhile)."""

DEFAULT_INTERVAL = 100
"""delta-rs's ``delta.checkpointInterval`` when a table does not set it."""


def checkpoint_interval(configuration: dict[str, str]) -> int:
    text = configuration.get("delta.checkpointInterval")
    return int(text) if text and text.isdigit() and int(text) > 0 else DEFAULT_INTERVAL


class Checkpointer:
    """``committed(version)`` after each commit this process made to ``table``; ``close()`` at the end."""

    def __init__(self, table: LakeDir, interval: int) -> None:
        self.table = table
        self.interval = interval
        found = last_checkpoint(table)
        self.last = -1 if found is None else found[0]
        """The version of the newest checkpoint known (this thread's, or the table's when it started)."""
        self.written = 0
        self.failures = 0
        self._due = threading.Event()
        self._closing = False
        self._dt: DeltaTable | None = None
        self._thread = threading.Thread(target=self._run, name="cdcd-lake-checkpoint", daemon=True)
        self._thread.start()

    def committed(self, version: int) -> None:
        """``version`` of ``table`` exists: a checkpoint is due once ``interval`` versions passed the last."""
        if version - self.last >= self.interval:
            self._due.set()

    def close(self) -> None:
        """End the thread after the checkpoint it may be writing."""
        self._closing = True
        self._due.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closing:
                return
            try:
                if self._dt is None:
                    self._dt = open_delta(self.table)
                else:
                    self._dt.update_incremental()
                version = self._dt.version()
                found = last_checkpoint(self.table)
                if found is not None and found[0] > self.last:
                    self.last = found[0]
                if version - self.last < self.interval:
                    continue  # another writer's checkpoint, read with the log, is recent enough
                failpoints.hit(WRITING)
                self._dt.create_checkpoint()
                self.last = version
                self.written += 1
            except Exception as exc:  # no data changes: the log is whole without it, the next due one retries
                self._dt = None
                self.failures += 1
                metrics.LAKE_MAINTENANCE_FAILURES.labels("checkpoint").inc()
                log.warning("lake_checkpoint_failed", table=str(self.table), error=describe(exc))
