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

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")


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
        return self.median >= self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "metric": self.metric,
            "unit": self.unit,
            "goal": self.goal,
            "median": self.median if self.values else None,
            "min": self.min if self.values else None,
            "max": self.max if self.values else None,
            "values": self.values,
            "passed": self.passed,
            "error": self.error,
            "params": self.params,
            "runs": [{"count": m.count, "seconds": m.seconds, **m.extra} for m in self.measurements],
        }


def run_bench(bench: Bench, repeats: int, log: Callable[[str], None], profile_dir: Path | None = None) -> Result:
    """Setup, ``repeats`` timed repetitions (median reported), teardown; an exception is recorded.

    ``profile_dir``: afterwards run one more, untimed repetition under cProfile (calling thread only),
    write ``profile-<name>.prof`` there and log the top functions by own time.
    """
    result = Result(bench.name, bench.description, bench.metric, bench.unit, bench.goal, [], [], bench.params)
    try:
        if bench.setup is not None:
            t0 = time.perf_counter()
            bench.setup()
            log(f"  setup {time.perf_counter() - t0:.1f}s")
        for i in range(repeats):
            gc.collect()
            m = bench.run_once()
            result.measurements.append(m)
            result.values.append(m.rate)
            notes = " ".join(f"{k}={v}" for k, v in m.extra.items())
            log(f"  run {i + 1}/{repeats}: {m.count} in {m.seconds:.3f}s = {fmt_num(m.rate)} {bench.unit}  {notes}")
        if profile_dir is not None:
            _profile(bench, profile_dir, log)
    except Exception as exc:  # one broken benchmark must not hide the others' numbers
        result.error = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {result.error}")
    finally:
        if bench.teardown is not None:
            bench.teardown()
    return result


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
