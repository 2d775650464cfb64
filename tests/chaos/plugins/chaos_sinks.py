"""Consumers for the chaos suite (``kind = "python"``); this directory is on the children's PYTHONPATH."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from cdcd.consumer import EventBatch
from cdcd.sinks.jsonl import JsonlConsumer


def _pos(p: Any) -> list[int]:
    return [p.segment, p.offset, p.entry_index]


class SlowJsonl(JsonlConsumer):
    """JSON lines, sleeping ``delay_ms`` before each batch (a slow sink: the daemon must apply back-pressure).
    With ``busy_flag``, that file exists exactly while ``on_events`` runs (so a test knows where a kill landed)."""

    def __init__(self, path: str, delay_ms: float, fsync: bool = True, busy_flag: str | None = None) -> None:
        super().__init__(path, fsync)
        self.delay_s = delay_ms / 1000
        self.busy = Path(busy_flag) if busy_flag else None

    def on_events(self, batch: EventBatch) -> bool:
        if self.busy is not None:
            self.busy.touch()
        try:
            time.sleep(self.delay_s)
            return super().on_events(batch)
        finally:
            if self.busy is not None:
                self.busy.unlink(missing_ok=True)


class FailOnTrigger(JsonlConsumer):
    """JSON lines that raise while ``trigger`` exists: before writing the batch (``when = "before"``) or after writing
    and fsyncing it (``"after"``: the batch is on disk but never confirmed). Every call is noted in ``calls``."""

    def __init__(self, path: str, trigger: str, calls: str, when: str = "before") -> None:
        super().__init__(path)
        self.trigger = Path(trigger)
        self.calls = Path(calls)
        self.when = when

    def _note(self, batch: EventBatch, ok: bool) -> None:
        line = {"first": _pos(batch.first), "last": _pos(batch.last), "events": len(batch), "ok": ok}
        with self.calls.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_events(self, batch: EventBatch) -> bool:
        if len(batch) and self.trigger.exists():
            if self.when == "after":
                super().on_events(batch)
            self._note(batch, False)
            raise RuntimeError("injected consumer failure")
        ok = super().on_events(batch)
        if len(batch):
            self._note(batch, ok)
        return ok
