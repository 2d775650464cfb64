"""Shared pieces of the benchmark suite: the benchmark description, timing and repetition."""

from __future__ import annotations

import cProfile
import gc
import io
import math
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
