"""Retrying a failing call until a deadline: the one retry loop every sink uses.

A call is tried; an error of one of the ``retriable`` types is waited out with a ``Backoff`` delay and
the call tried again, until ``within_s`` seconds have passed since the first failure began the
count (then ``RetriesExhausted``) or ``stop`` is set (then ``RetryInterrupted``). Every other error
passes through at once, untouched: the caller says which errors retrying can fix, the rest (a refused
token, a bad setting) fail the first time. Only ``Exception`` subclasses are ever retried, so
``asyncio.CancelledError``, ``KeyboardInterrupt`` and ``SystemExit`` are never swallowed. Debezium's
``RetryingCallable`` with a ``DelayStrategy`` is the model.

Waiting for a condition is the other loop, ``poll_until``: ask until an answer comes or the time is up, and
let the caller say what running out of time means (a held lock, a node that never answered).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "Retry", "RetriesExhausted", "RetryInterrupted", "poll_until", "retry_until"]

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential delays between attempts: ``initial_ms``, then times ``multiplier`` each time, capped at
    ``max_ms``; with ``jitter`` (0..1) each delay is drawn uniformly from ``[delay * (1 - jitter), delay]``
    so that many clients failing together do not retry in step."""

    initial_ms: int = 100
    max_ms: int = 5000
    multiplier: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_ms <= self.max_ms and self.multiplier >= 1.0 and 0.0 <= self.jitter <= 1.0):
            raise ValueError(f"bad backoff {self}: needs 0 < initial_ms <= max_ms, multiplier >= 1, 0 <= jitter <= 1")

    def delays_s(self, rng: random.Random | None = None) -> Iterator[float]:
        """The delays before the 2nd, 3rd, ... attempt, in seconds (endless)."""
        pick = rng or random.Random()
        delay_ms = float(self.initial_ms)
        while True:
            low = delay_ms * (1.0 - self.jitter)
            yield (pick.uniform(low, delay_ms) if self.jitter else delay_ms) / 1000
            delay_ms = min(delay_ms * self.multiplier, float(self.max_ms))


@dataclass(frozen=True)
class Retry:
    """One failed attempt that will be retried, for the caller's log line and metrics."""

    error: Exception
    attempt: int
    """1 for the first attempt."""
    failing_for_s: float
    retry_in_s: float


class RetriesExhausted(Exception):
    """Still failing ``within_s`` after the first failure; ``last`` is the last attempt's error (also the
    ``__cause__``)."""

    def __init__(self, last: Exception, attempts: int, failing_for_s: float, within_s: float) -> None:
        super().__init__(
            f"failing for {failing_for_s:.1f} s over {attempts} attempt(s) (retried for at most {within_s:g} s): "
            f"{type(last).__name__}: {last}"
        )
        self.last = last
        self.attempts = attempts
        self.failing_for_s = failing_for_s


class RetryInterrupted(Exception):
    """``stop`` was set while a retriable error was being waited out; ``last`` is that error."""

    def __init__(self, last: Exception, failing_for_s: float) -> None:
        super().__init__(f"stopped while retrying (failing for {failing_for_s:.1f} s): {type(last).__name__}: {last}")
        self.last = last
        self.failing_for_s = failing_for_s


def retry_until(
    call: Callable[[], T],
    within_s: float,
    backoff: Backoff,
    *,
    retriable: tuple[type[Exception], ...],
    stop: threading.Event | None = None,
    wait: Callable[[float], bool] | None = None,
    on_retry: Callable[[Retry], None] | None = None,
    rng: random.Random | None = None,
) -> T:
    """``call()``'s result, retrying errors of the ``retriable`` types for at most ``within_s`` seconds
    from the first attempt; a wait never runs past that deadline, so the last attempt is made at it.
    ``wait(delay_s)`` (instead of ``stop``) waits between attempts and returns True when the caller
    is stopping."""
    if wait is None:
        wait = stop.wait if stop is not None else _sleep
    started = time.monotonic()
    delays = backoff.delays_s(rng)
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except retriable as exc:
            failing_for_s = time.monotonic() - started
            if failing_for_s >= within_s:
                raise RetriesExhausted(exc, attempt, failing_for_s, within_s) from exc
            if stop is not None and stop.is_set():
                raise RetryInterrupted(exc, failing_for_s) from exc
            delay_s = min(next(delays), within_s - failing_for_s)
            if on_retry is not None:
                on_retry(Retry(exc, attempt, failing_for_s, delay_s))
            if wait(delay_s):
                raise RetryInterrupted(exc, time.monotonic() - started) from exc


def _sleep(delay_s: float) -> bool:
    time.sleep(delay_s)
    return False


def poll_until(
    probe: Callable[[], T | None],
    within_s: float,
    interval_s: float,
    *,
    alive: Callable[[], bool] | None = None,
    wait: Callable[[float], bool] | None = None,
) -> T | None:
    """``probe()``'s first answer that is not None, asked at once and then every ``interval_s`` for at most
    ``within_s`` seconds (a wait never runs past the deadline, so the last ask is made at it); None when the time
    ran out, when ``alive()`` (asked before each probe) says there is no point waiting any more, or when
    ``wait(delay_s)`` returns True (the caller is stopping). Errors of ``probe`` pass through."""
    wait = wait or _sleep
    started = time.monotonic()
    while True:
        if alive is not None and not alive():
            return None
        answer = probe()
        if answer is not None:
            return answer
        remaining_s = within_s - (time.monotonic() - started)
        if remaining_s <= 0 or wait(min(interval_s, remaining_s)):
            return None
