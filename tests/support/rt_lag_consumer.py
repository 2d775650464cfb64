"""The consumer of the capture-lag benchmarks (``bench_realtime``): notes when each key reaches it.

The node's realtime worker builds it from ``realtime_consumer = {kind = "python", class =
"tests.support.rt_lag_consumer:LagConsumer", options = {channel = ..., source = "node"}}``; the
benchmark hands the daemon an instance of its own (``source = "daemon"``). Both write into the
in-process ``Recorder`` named by ``channel``, so one benchmark sees who delivered what, and when.
"""

from __future__ import annotations

import threading
import time

from cdcd.consumer import Consumer, EventBatch

__all__ = ["LagConsumer", "Recorder", "recorder"]


class Recorder:
    """Delivered batches: ``(perf_counter_ns when on_events was called, source, keys)``, in call order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: list[tuple[int, str, list[int]]] = []
        self.calls = 0

    def add(self, t_ns: int, source: str, keys: list[int]) -> None:
        with self._lock:
            self.batches.append((t_ns, source, keys))
            self.calls += 1

    def delivered(self) -> int:
        with self._lock:
            return sum(len(k) for _, _, k in self.batches)

    def snapshot(self) -> list[tuple[int, str, list[int]]]:
        with self._lock:
            return list(self.batches)


_RECORDERS: dict[str, Recorder] = {}
_RECORDERS_LOCK = threading.Lock()


def recorder(channel: str, *, fresh: bool = False) -> Recorder:
    """The recorder of ``channel`` (a new, empty one with ``fresh``)."""
    with _RECORDERS_LOCK:
        rec = _RECORDERS.get(channel)
        if rec is None or fresh:
            rec = _RECORDERS[channel] = Recorder()
        return rec


def drop(channel: str) -> None:
    with _RECORDERS_LOCK:
        _RECORDERS.pop(channel, None)


class LagConsumer(Consumer):
    """Records the arrival time of every key (ints, as the benchmark writes them); confirms at once."""

    def __init__(self, channel: str, source: str = "node", min_batch_interval_ms: int = 0) -> None:
        self.channel = channel
        self.source = source
        self.min_batch_interval_ms = min_batch_interval_ms  # the pacing the consumer asks of the realtime worker
        self._rec = recorder(channel)

    def on_events(self, batch: EventBatch) -> bool:
        t_ns = time.perf_counter_ns()  # "consumer called": before the (cheap) key decoding below
        self._rec.add(t_ns, self.source, [ev.key for ev in batch])
        return True
