"""A consumer that holds the GIL while it delivers, as a sink busy in Python does (Kafka's producer serialising,
the lake building rows): ``class = "tests.support.gil_hog:GilHog"``.

It holds the GIL ``hold_us_per_event`` microseconds per event of each batch, in calls of at most ``piece_us``
that keep it (a sleep through ``ctypes.PyDLL``, not a spin): between two calls another thread that asked for the
GIL gets it. How long the other consumers of its daemon wait depends on the batches it takes and on its pieces,
not on how busy the machine's cores are. Its target is down (``RetriableError``) while the file ``down`` exists;
it writes every event it takes to ``path`` as the jsonl consumer does."""

from __future__ import annotations

import ctypes
import os

from cdcd.consumer import EventBatch, RetriableError
from cdcd.sinks.jsonl import JsonlConsumer

_HOLDING = ctypes.PyDLL(None)
"""The process's own symbols (libc's among them), called with the GIL held."""


def hold_gil(us: int, piece_us: int) -> None:
    while us > 0:
        step = min(us, piece_us)
        _HOLDING.usleep(ctypes.c_uint(step))
        us -= step


class GilHog(JsonlConsumer):
    def __init__(self, path: str, hold_us_per_event: int, piece_us: int = 1000, down: str = "") -> None:
        super().__init__(path, fsync=False)
        self.hold_us_per_event = hold_us_per_event
        self.piece_us = min(piece_us, 999_999)  # usleep's bound (POSIX)
        self.down = down

    def on_events(self, batch: EventBatch) -> bool:
        if self.down and os.path.exists(self.down):
            raise RetriableError("target down")
        hold_gil(len(batch) * self.hold_us_per_event, self.piece_us)
        return super().on_events(batch)
