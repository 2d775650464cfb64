"""``cdcd.retry.retry_until``, the one retry loop of the sinks (and ``poll_until``, the one wait for a
condition): what is retried and what passes through,
the deadline, the stop event, and the backoff's delays. Real time with delays of a few milliseconds; every
assertion is on counts and order, none on how long something took beyond the deadline's lower bound."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import pytest

from cdcd.retry import Backoff, RetriesExhausted, Retry, RetryInterrupted, poll_until, retry_until

TINY = Backoff(initial_ms=1, max_ms=2)


def failing(
    times: int, error: Callable[[], BaseException], result: str = "done"
) -> tuple[Callable[[], str], list[int]]:
    """A call that raises ``error()`` its first ``times`` calls, then returns ``result``."""
    calls: list[int] = []

    def call() -> str:
        calls.append(len(calls) + 1)
        if len(calls) <= times:
            raise error()
        return result

    return call, calls


def test_retriable_errors_are_retried_until_the_call_succeeds() -> None:
    call, calls = failing(3, lambda: ConnectionResetError("reset"))
    seen: list[Retry] = []
    assert retry_until(call, 60, TINY, retriable=(OSError,), on_retry=seen.append) == "done"
    assert calls == [1, 2, 3, 4]
    assert [r.attempt for r in seen] == [1, 2, 3]
    assert all(isinstance(r.error, ConnectionResetError) and 0 < r.retry_in_s <= 0.002 for r in seen)


def test_an_error_not_named_retriable_passes_through_the_first_time_untouched() -> None:
    error = PermissionError("token refused")
    call, calls = failing(5, lambda: error)
    with pytest.raises(PermissionError) as caught:
        retry_until(call, 60, TINY, retriable=(ConnectionError,))
    assert caught.value is error
    assert calls == [1]


@pytest.mark.parametrize("error", [asyncio.CancelledError, KeyboardInterrupt, SystemExit])
def test_cancellation_and_exits_are_never_swallowed(error: type[BaseException]) -> None:
    """Only Exception subclasses can be retriable: CancelledError (a BaseException) always propagates."""
    call, calls = failing(5, error)
    with pytest.raises(error):
        retry_until(call, 60, TINY, retriable=(Exception,))
    assert calls == [1]


def test_still_failing_at_the_deadline_raises_with_the_last_error() -> None:
    call, calls = failing(10**9, lambda: TimeoutError(f"attempt {len(calls)}"))
    with pytest.raises(RetriesExhausted) as caught:
        retry_until(call, 0.05, TINY, retriable=(OSError,))
    exc = caught.value
    assert exc.attempts == len(calls) >= 2
    assert exc.failing_for_s >= 0.05
    assert isinstance(exc.last, TimeoutError) and str(exc.last) == f"attempt {len(calls)}"
    assert exc.__cause__ is exc.last
    assert str(exc).startswith(f"failing for {exc.failing_for_s:.1f} s over {exc.attempts} attempt(s)")


def test_zero_seconds_means_one_attempt() -> None:
    call, calls = failing(1, lambda: OSError("down"))
    with pytest.raises(RetriesExhausted):
        retry_until(call, 0, TINY, retriable=(OSError,))
    assert calls == [1]


def test_a_wait_never_runs_past_the_deadline() -> None:
    """With a backoff far longer than the deadline, the one wait is cut to what is left of it."""
    call, calls = failing(10**9, lambda: OSError("down"))
    seen: list[Retry] = []
    with pytest.raises(RetriesExhausted):
        retry_until(call, 0.05, Backoff(initial_ms=60_000, max_ms=60_000), retriable=(OSError,), on_retry=seen.append)
    assert calls == [1, 2], "one wait, cut to the deadline, then the last attempt at it"
    assert len(seen) == 1 and seen[0].retry_in_s <= 0.05


def test_stop_set_during_a_wait_interrupts_it() -> None:
    """A stop event set by another thread ends the wait (a 60 s backoff) with RetryInterrupted."""
    stop = threading.Event()
    call, calls = failing(10**9, lambda: OSError("down"))
    with pytest.raises(RetryInterrupted) as caught:
        retry_until(
            call,
            3600,
            Backoff(initial_ms=60_000, max_ms=60_000),
            retriable=(OSError,),
            stop=stop,
            on_retry=lambda _retry: stop.set(),
        )
    assert calls == [1]
    assert isinstance(caught.value.last, OSError) and caught.value.__cause__ is caught.value.last


def test_stop_already_set_gives_up_after_the_failed_attempt_without_waiting() -> None:
    stop = threading.Event()
    stop.set()
    call, calls = failing(10**9, lambda: OSError("down"))
    seen: list[Retry] = []
    with pytest.raises(RetryInterrupted):
        retry_until(call, 3600, TINY, retriable=(OSError,), stop=stop, on_retry=seen.append)
    assert calls == [1] and seen == []
    assert retry_until(lambda: 7, 3600, TINY, retriable=(OSError,), stop=stop) == 7, "a success needs no wait"


def test_delays_grow_exponentially_up_to_the_cap() -> None:
    delays = Backoff(initial_ms=100, max_ms=1000, multiplier=2).delays_s()
    assert [next(delays) for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_jittered_delays_stay_within_their_band() -> None:
    backoff = Backoff(initial_ms=100, max_ms=800, multiplier=2, jitter=0.5)
    delays = backoff.delays_s(random.Random(5))
    plain = Backoff(initial_ms=100, max_ms=800, multiplier=2).delays_s()
    got = [(next(delays), next(plain)) for _ in range(200)]
    assert all(full / 2 <= d <= full for d, full in got)
    assert len({d for d, _ in got[-100:]}) > 50, "jitter spreads the capped delays"


@pytest.mark.parametrize(
    "kw", [{"initial_ms": 0}, {"initial_ms": 10, "max_ms": 5}, {"multiplier": 0.5}, {"jitter": 1.5}]
)
def test_a_bad_backoff_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="bad backoff"):
        Backoff(**kw)  # type: ignore[arg-type]


# --- poll_until -------------------------------------------------------------------------------------------
def test_poll_until_returns_the_first_answer_and_asks_no_more() -> None:
    answers = iter([None, None, "up", "never asked"])
    asked: list[float] = []
    waits: list[float] = []

    def probe() -> str | None:
        asked.append(time.monotonic())
        return next(answers)

    def wait(delay_s: float) -> bool:
        waits.append(delay_s)
        return False

    assert poll_until(probe, 60.0, 0.5, wait=wait) == "up"
    assert len(asked) == 3 and waits == [0.5, 0.5]


def test_poll_until_gives_up_at_the_deadline_with_a_last_ask_at_it() -> None:
    asked: list[float] = []
    started = time.monotonic()
    assert poll_until(lambda: asked.append(time.monotonic()), 0.3, 0.2) is None
    assert time.monotonic() - started >= 0.3
    # at once, after 0.2 s, then at the deadline; a busy machine may sleep past the deadline in the first wait, and
    # then that ask is the last one: either way the last ask is not made before the deadline
    assert len(asked) in (2, 3) and asked[-1] - started >= 0.3


def test_poll_until_stops_when_there_is_no_point_waiting() -> None:
    alive = iter([True, True, False])
    asked: list[int] = []
    assert poll_until(lambda: asked.append(1), 60.0, 0.0, alive=lambda: next(alive)) is None
    assert len(asked) == 2


def test_poll_until_stops_when_the_wait_says_so_and_lets_errors_through() -> None:
    assert poll_until(lambda: None, 60.0, 1.0, wait=lambda _s: True) is None
    with pytest.raises(OSError, match="boom"):
        poll_until(lambda: (_ for _ in ()).throw(OSError("boom")), 60.0, 1.0)
