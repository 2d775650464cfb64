"""Shared pieces of the benchmark suite: the benchmark description, timing and repetition; an
in-process ``Daemon.run()`` until a segment is passed; child processes (environment, stop, kill)."""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import io
import math
import os
import pstats
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdcd.daemon.daemon import Daemon
from cdcd.wal.segment import list_segments

VALUE_100B = b"v" * 98
"""A value whose MessagePack encoding is exactly 100 bytes (bin8: 2-byte header + 98 bytes)."""


@dataclass
class Measurement:
    """One timed repetition: ``count`` units of work done in ``seconds``."""

    count: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    value: float | None = None
    """The reported number when it is not ``count / seconds`` (a latency, a size)."""

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")

    @property
    def reported(self) -> float:
        return self.value if self.value is not None else self.rate


@dataclass(frozen=True)
class Metric:
    """A further table row of a benchmark: the median over its runs of ``Measurement.extra[key]``."""

    metric: str
    key: str
    unit: str
    goal: float | None = None
    lower_is_better: bool = False


@dataclass
class Bench:
    """One benchmark. ``run_once`` does (and times) one repetition; ``setup``/``teardown`` are untimed
    and run once around all repetitions (e.g. writing the WAL that a read benchmark reads)."""

    name: str
    description: str
    run_once: Callable[[], Measurement]
    metric: str = "throughput"
    unit: str = "entries/s"
    goal: float | None = None
    """The median must be >= goal (None: informational only)."""
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    lower_is_better: bool = False
    """The goal is a ceiling (latency, memory): the median must be <= goal."""
    max_repeats: int | None = None
    """At most this many repetitions (long benchmarks)."""
    more: tuple[Metric, ...] = ()
    """Further rows, read from each run's ``extra``."""


@dataclass
class Result:
    name: str
    description: str
    metric: str
    unit: str
    goal: float | None
    values: list[float]
    measurements: list[Measurement]
    params: dict[str, Any]
    error: str | None = None
    lower_is_better: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def min(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def max(self) -> float:
        return max(self.values) if self.values else float("nan")

    @property
    def passed(self) -> bool | None:
        if self.error is not None:
            return False
        if self.goal is None:
            return None
        return self.median <= self.goal if self.lower_is_better else self.median >= self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "metric": self.metric,
            "unit": self.unit,
            "goal": self.goal,
            "goal_op": "<=" if self.lower_is_better else ">=",
            "median": self.median if self.values else None,
            "min": self.min if self.values else None,
            "max": self.max if self.values else None,
            "values": self.values,
            "passed": self.passed,
            "error": self.error,
            "params": self.params,
            "runs": [{"count": m.count, "seconds": m.seconds, **m.extra} for m in self.measurements],
        }


def run_bench(bench: Bench, repeats: int, log: Callable[[str], None], profile_dir: Path | None = None) -> list[Result]:
    """Setup, ``repeats`` timed repetitions (median reported), teardown; an exception is recorded.

    Returns the benchmark's row, then one per ``bench.more``.

    ``profile_dir``: afterwards run one more, untimed repetition under cProfile (calling thread only),
    write ``profile-<name>.prof`` there and log the top functions by own time.
    """
    result = Result(
        bench.name,
        bench.description,
        bench.metric,
        bench.unit,
        bench.goal,
        [],
        [],
        bench.params,
        lower_is_better=bench.lower_is_better,
    )
    if bench.max_repeats is not None:
        repeats = min(repeats, bench.max_repeats)
    try:
        if bench.setup is not None:
            t0 = time.perf_counter()
            bench.setup()
            log(f"  setup {time.perf_counter() - t0:.1f}s")
        for i in range(repeats):
            gc.collect()
            m = bench.run_once()
            result.measurements.append(m)
            result.values.append(m.reported)
            notes = " ".join(f"{k}={v}" for k, v in m.extra.items())
            log(
                f"  run {i + 1}/{repeats}: {m.count} in {m.seconds:.3f}s = "
                f"{fmt_value(m.reported, bench.unit)} {bench.unit}  {notes}"
            )
        if profile_dir is not None:
            _profile(bench, profile_dir, log)
    except Exception as exc:  # one broken benchmark must not hide the others' numbers
        result.error = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {result.error}")
    finally:
        if bench.teardown is not None:
            bench.teardown()
    rows = [result]
    for extra in bench.more:
        row = Result(
            bench.name,
            bench.description,
            extra.metric,
            extra.unit,
            extra.goal,
            [m.extra[extra.key] for m in result.measurements if m.extra.get(extra.key) is not None],
            result.measurements,
            bench.params,
            result.error,
            extra.lower_is_better,
        )
        rows.append(row)
    return rows


def _profile(bench: Bench, profile_dir: Path, log: Callable[[str], None]) -> None:
    prof = cProfile.Profile()
    prof.enable()
    try:
        bench.run_once()
    finally:
        prof.disable()
    path = profile_dir / f"profile-{bench.name}.prof"
    prof.dump_stats(path)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    log(f"  profile written to {path}; top functions by own time:\n{out.getvalue()}")


def fmt_value(x: float | None, unit: str) -> str:
    """A rate (unit ``.../s``) as ``fmt_num`` does; anything else (ms, MB, %) plainly."""
    if unit.endswith("/s") or x is None or math.isnan(x):
        return fmt_num(x)
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def fmt_num(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    if x >= 1_000_000:
        return f"{x / 1_000_000:.2f}M"
    if x >= 10_000:
        return f"{x / 1000:.0f}k"
    if x >= 1000:
        return f"{x / 1000:.1f}k"
    return f"{x:.0f}"


ROOT = Path(__file__).resolve().parents[2]
DRAIN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


def _links(cdc_dir: Path) -> dict[int, Path]:
    return list_segments(cdc_dir)[0]


# --- replay in-process ----------------------------------------------------------------------------
async def _run_until(daemon: Daemon, last_segment: int) -> tuple[float, bool]:
    """``run()`` as a task until the committed position passes ``last_segment``, then ``stop()``.

    Returns the seconds to get there and whether ``run()`` failed to return after ``stop()`` (a cdcd
    bug on Python 3.11: a CDC-dir wake-up landing just as the pipeline tasks are cancelled makes the
    reader swallow its cancellation inside ``asyncio.wait_for`` and block on its full queue). Then
    the task is cancelled once more, which lets ``run()`` finish.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    task = asyncio.create_task(daemon.run(), name="bench-daemon-run")
    while True:
        pos = daemon.state.position
        if pos is not None and pos.segment > last_segment:
            break
        if task.done():
            task.result()
            raise RuntimeError(f"run() returned at {pos} before passing segment {last_segment}")
        if time.monotonic() > deadline:
            daemon.stop()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(task, 10)
            raise TimeoutError(
                f"run() stuck at {daemon.state} after {DRAIN_TIMEOUT_S:.0f}s (last segment {last_segment}, "
                f"{daemon.events_delivered:,} events delivered, links left {sorted(_links(daemon.cdc_dir))})"
            )
        await asyncio.sleep(0.005)
    seconds = time.perf_counter() - t0
    daemon.stop()
    done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
    if done:
        task.result()
        return seconds, False
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return seconds, True


# --- subprocesses ---------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _what(proc: subprocess.Popen[Any]) -> str:
    """``cdcd run`` or ``tests.bench.bench_daemon lag-writer``: the child's command after the interpreter."""
    args = proc.args
    return " ".join(map(str, args[2:4])) if isinstance(args, list) else str(args)


def _stop(proc: subprocess.Popen[Any], log_path: Path | None = None, timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"pid {proc.pid} ({_what(proc)}) did not exit {timeout_s:.0f}s after SIGTERM "
            "(see _run_until: run() can miss stop())"
        ) from None
    if proc.returncode != 0:
        tail = _tail(log_path) if log_path is not None else ""
        raise RuntimeError(f"pid {proc.pid} ({_what(proc)}) exited {proc.returncode}:\n{tail}")


def _percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    idx = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return float(sorted_values[idx])
