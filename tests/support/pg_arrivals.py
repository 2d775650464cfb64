"""The consumer of ``bench_pg``'s live benchmark: notes when each key reaches it.

A module of its own (not in ``bench_pg``) so that the node's realtime worker, which imports it by
name, and the benchmark running as ``python -m tests.bench.bench_pg`` (``__main__``) share one
``ARRIVALS`` registry, and so that a ``cdcd run`` subprocess imports nothing of the benchmark.
"""

from __future__ import annotations

import array
import os
import time
from pathlib import Path

from cdcd.consumer import Consumer, EventBatch

__all__ = ["ARRIVALS", "ArrivalConsumer", "read_arrivals"]

CLASS = "tests.support.pg_arrivals:ArrivalConsumer"

ARRIVALS: dict[str, ArrivalConsumer] = {}
"""In-process consumers by ``path``: the realtime benchmark polls ``count`` here."""


class ArrivalConsumer(Consumer):
    """Notes ``time.time_ns()`` when each key reaches it; ``stop()`` writes (key, ns) int64 pairs to ``path``.

    Used as the node's realtime consumer (in process) and as ``cdcd run``'s python consumer (another
    process: the file is the only channel).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples = array.array("q")
        ARRIVALS[path] = self

    @property
    def count(self) -> int:
        return len(self.samples) // 2

    def on_events(self, batch: EventBatch) -> bool:
        now = time.time_ns()  # "delivered": when the consumer is handed the batch, before key decoding
        append = self.samples.append
        for event in batch:
            append(event.key)
            append(now)
        return True

    def stop(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            self.samples.tofile(f)
        os.replace(tmp, self.path)


def read_arrivals(path: Path, rows_per_tx: int) -> dict[int, int]:
    """Transaction number (key // rows_per_tx; negative keys are probes, skipped) -> arrival ns of its last row."""
    raw = array.array("q")
    raw.frombytes(path.read_bytes())
    out: dict[int, int] = {}
    for key, t in zip(raw[0::2], raw[1::2], strict=True):
        if key < 0:
            continue
        g = key // rows_per_tx
        if t > out.get(g, 0):
            out[g] = t
    return out
