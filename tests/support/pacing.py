"""The benchmarks' paced writer: transactions on a fixed schedule, so a rate is offered, not hoped for."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator


class Pacer:
    """Iterating yields the first key of each transaction of ``tx_size`` keys, ``rate`` keys a second, for
    ``seconds`` or until ``stop()`` says so. The schedule is absolute (``started + n * interval``): a late
    transaction is not followed by a pause that hides it, and ``behind_max_s`` tells how far the writer fell
    behind its schedule (a benchmark whose writer could not keep the rate reports it)."""

    def __init__(self, rate: float, tx_size: int, seconds: float, stop: Callable[[], bool] = lambda: False) -> None:
        self.interval_s = tx_size / rate
        self.tx_size = tx_size
        self.seconds = seconds
        self.stop = stop
        self.written = 0
        self.elapsed_s = 0.0
        self.behind_max_s = 0.0

    def __iter__(self) -> Iterator[int]:
        started = time.monotonic()
        end = started + self.seconds
        next_at = started
        try:
            while not self.stop():
                now = time.monotonic()
                if now >= end:
                    break
                delay = next_at - now
                if delay > 0:
                    time.sleep(delay)
                else:
                    self.behind_max_s = max(self.behind_max_s, -delay)
                yield self.written
                self.written += self.tx_size
                next_at += self.interval_s
        finally:
            self.elapsed_s = time.monotonic() - started
