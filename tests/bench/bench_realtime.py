"""Capture lag: from "commit returned" to "consumer called", realtime (in the node) vs archive (daemon).

One process: paced writer threads, the node (its flusher, realtime worker and checkpointer) and,
for archive mode, an in-process ``Daemon.run()`` on an asyncio loop in a background thread.
Writers use fresh int keys and 100-byte values; transaction ``g`` is scheduled at
``t0 + g / (rate / batch)`` (open loop: a writer that falls behind does not sleep until it has
caught up). Each writer notes ``perf_counter_ns()`` when ``put``/``put_all`` returns; the
consumer (``tests.support.rt_lag_consumer``) notes ``perf_counter_ns()`` when ``on_events`` is
called, and keys match the two. Only transactions that returned inside the measured window
(after the warm-up) count; afterwards the run waits for all of them to be delivered.

* ``realtime.lag.<rate>.flush<ms>``: ``realtime_cdc = true``, ``cdc_enabled = false`` (no daemon
  and no hard links: the worker needs no hand-over to start), ``wal_mode = "fsync"``. Every commit
  asks for a flush at once, so ``wal_flush_interval_ms`` only sets how often an idle flusher wakes
  up; it hardly matters in fsync mode. The flusher offers a chunk to the worker *before* it wakes
  the committers, so an event can reach the consumer before its ``put`` returned: lag < 0 is
  possible and counted as is. ``realtime.lag.10k.flush<ms>.background``: the same with
  ``wal_mode = "background"`` (``put`` returns at once; the flush interval is then the lag).
* ``archive.lag.<rate>``: realtime off, ``wal_force_archive_timeout_ms = 1000``, the daemon with
  its default ``batch_max_delay_ms = 100``.
* ``realtime.switch``: 5k entries/s with realtime on and the daemon running (PASSIVE); after 5 s
  ``request_off()`` (the daemon takes over), after 10 s ``request_on()`` (hand-over back), end at
  15 s. Draws ``results/realtime-switch.png`` (and ``docs/realtime-switch.png``; ``--quick``
  draws ``results/realtime-switch-quick.png`` only) and checks that every entry arrived.

Rates: 1k/s as single puts from one thread; 10k/s and 50k/s as 10-entry ``put_all``s from 2 and
24 threads (fsync mode: a thread waits for the fsync of each of its commits, ~0.5 ms here, so 50k/s
needs group commit across many threads; on 2 cores it reaches 35-50k). The "achieved rate" row
says whether the schedule was met. Each run is one repetition (``realtime.lag.10k.flush2``, which
has the goal p99 <= 10 ms, three); the JSON ``runs`` also hold p90, min, commit latency and more.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdcd.daemon import Daemon, DaemonConfig
from cdcd.node.node import Node
from cdcd.realtime import RealtimeMode
from tests.support import rt_lag_consumer
from tests.support.bench import VALUE_100B, Bench, Measurement, Metric

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONSUMER_CLASS = "tests.support.rt_lag_consumer:LagConsumer"
FORCE_ARCHIVE_MS = 1000
GOAL_P99_MS = 10.0
"""Realtime at 10k entries/s with a 2 ms flush interval: p99 capture lag at most this."""
GOAL_P999_MS = 1.0
"""... and p99.9 at most this (issue 18), on a quiet machine."""

# rate (entries/s) -> (entries per transaction, writer threads)
LOAD_SHAPES = {1_000: (1, 1), 10_000: (10, 2), 50_000: (10, 24)}

_run_ids = itertools.count()


def _rate_name(rate: int) -> str:
    return f"{rate // 1000}k" if rate % 1000 == 0 else str(rate)


def _pct(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    idx = min(len(sorted_values) - 1, max(0, int(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# --- the load ----------------------------------------------------------------------------------------
@dataclass
class Load:
    """Paced writers: transaction ``g`` writes keys ``g*batch .. g*batch+batch-1`` at ``t0 + g*interval``."""

    node: Node
    rate: float
    batch: int
    threads: int
    seconds: float
    commit_ns: list[int] = field(default_factory=list)
    """perf_counter_ns when transaction g's put/put_all returned (0: not written)."""
    call_ns: list[int] = field(default_factory=list)
    late_ns: list[int] = field(default_factory=list)
    """How late (vs its schedule) transaction g was started."""
    t0_ns: int = 0
    end_ns: int = 0
    errors: list[BaseException] = field(default_factory=list)
    cpu_percent: float = 0.0
    """CPU time of the whole process over the load's wall time (200 = both cores of this machine)."""
    loadavg_1m: float = 0.0
    """The machine's 1-minute load average at the end: other work on the box skews every number."""
    _workers: list[threading.Thread] = field(default_factory=list)
    _cpu0: float = 0.0

    def start(self, delay_s: float = 0.05) -> None:
        tx_rate = self.rate / self.batch
        n_tx = int(self.seconds * tx_rate) + 1
        self.commit_ns = [0] * n_tx
        self.call_ns = [0] * n_tx
        self.late_ns = [0] * n_tx
        self.t0_ns = time.perf_counter_ns() + int(delay_s * 1e9)
        self.end_ns = self.t0_ns + int(self.seconds * 1e9)
        interval_ns = 1e9 / tx_rate
        self._cpu0 = time.process_time()
        self._workers = [
            threading.Thread(target=self._write, args=(j, n_tx, interval_ns), name=f"bench-rt-writer-{j}", daemon=True)
            for j in range(self.threads)
        ]
        for w in self._workers:
            w.start()

    def _write(self, j: int, n_tx: int, interval_ns: float) -> None:
        try:
            cache = self.node.cache("lag")
            put, put_all = cache.put, cache.put_all
            value, batch = VALUE_100B, self.batch
            perf, sleep = time.perf_counter_ns, time.sleep
            t0, end = self.t0_ns, self.end_ns
            commit, call, late = self.commit_ns, self.call_ns, self.late_ns
            for g in range(j, n_tx, self.threads):
                target = t0 + int(g * interval_ns)
                now = perf()
                if target >= end or now >= end:
                    break
                if target > now:
                    sleep((target - now) / 1e9)
                t1 = perf()
                if batch == 1:
                    put(g, value)
                else:
                    first = g * batch
                    put_all({k: value for k in range(first, first + batch)})
                t2 = perf()
                commit[g] = t2
                call[g] = t2 - t1
                late[g] = t1 - target
        except BaseException as exc:
            self.errors.append(exc)

    def join(self) -> None:
        for w in self._workers:
            w.join()
        wall_s = (time.perf_counter_ns() - self.t0_ns) / 1e9 + 0.05
        self.cpu_percent = round(100 * (time.process_time() - self._cpu0) / wall_s, 1)
        self.loadavg_1m = round(os.getloadavg()[0], 2)
        if self.errors:
            raise self.errors[0]

    def keys_committed(self, lo_ns: int, hi_ns: int) -> list[int]:
        """Transactions whose commit returned in [lo, hi)."""
        return [g for g, t in enumerate(self.commit_ns) if t and lo_ns <= t < hi_ns]


@dataclass
class Arrivals:
    """Per transaction: the first arrival (ns, source) and how many times its keys arrived."""

    first_ns: list[int]
    source: list[str]
    count: list[int]


def _arrivals(load: Load, rec: rt_lag_consumer.Recorder) -> Arrivals:
    n_tx = len(load.commit_ns)
    first = [0] * n_tx
    source = [""] * n_tx
    count = [0] * n_tx
    batch = load.batch
    for t_ns, src, keys in rec.snapshot():
        for key in keys:
            g = key // batch
            if g >= n_tx:
                continue
            if not count[g]:
                first[g], source[g] = t_ns, src
            count[g] += 1
    return Arrivals(first, source, count)


def _wait_delivered(load: Load, rec: rt_lag_consumer.Recorder, timeout_s: float) -> None:
    """Until every committed key has arrived (or the timeout)."""
    want = sum(1 for t in load.commit_ns if t) * load.batch
    deadline = time.monotonic() + timeout_s
    while rec.delivered() < want and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_mode(node: Node, mode: RealtimeMode, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while node.realtime.mode is not mode:
        if time.monotonic() > deadline:
            now = node.realtime.mode.value
            raise RuntimeError(f"realtime mode still {now} after {timeout_s}s, wanted {mode.value}")
        time.sleep(0.01)


# --- the daemon in a thread ----------------------------------------------------------------------------
class DaemonThread:
    """``Daemon.run()`` on its own asyncio loop in a background thread."""

    def __init__(self, node_dir: Path, channel: str) -> None:
        config = DaemonConfig(node_dir=str(node_dir), metrics_address="", log_format="console")
        self.daemon = Daemon(config, rt_lag_consumer.LagConsumer(channel, "daemon"), show_progress=False)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="bench-daemon", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.daemon.run())
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self.daemon.start()
        self._thread.start()

    def stop(self) -> None:
        self.daemon.stop()
        self._thread.join(10)
        self.daemon.close()
        if self.error is not None:
            raise RuntimeError(f"daemon failed: {type(self.error).__name__}: {self.error}") from self.error


def _consumer_table(channel: str) -> dict[str, Any]:
    return {"kind": "python", "class": CONSUMER_CLASS, "options": {"channel": channel, "source": "node"}}


def _tmpdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("CDCD_BENCH_DIR") or None))


# --- lag at a steady rate -----------------------------------------------------------------------------
def run_lag(
    *,
    mode: str,
    rate: int,
    flush_ms: int = 10,
    wal_mode: str = "fsync",
    warmup_s: float,
    seconds: float,
    drain_s: float,
) -> Measurement:
    batch, threads = LOAD_SHAPES[rate]
    channel = f"lag-{os.getpid()}-{next(_run_ids)}"
    rec = rt_lag_consumer.recorder(channel, fresh=True)
    tmp = _tmpdir(f"cdcd-bench-{mode}-")
    realtime = mode == "realtime"
    daemon: DaemonThread | None = None
    try:
        node = Node.open(
            tmp,
            wal_mode=wal_mode,
            wal_flush_interval_ms=flush_ms,
            wal_force_archive_timeout_ms=FORCE_ARCHIVE_MS,
            realtime_cdc=realtime,
            realtime_consumer=_consumer_table(channel) if realtime else {},
            cdc_enabled=not realtime,
        )
        try:
            if realtime:
                _wait_mode(node, RealtimeMode.ON, 5.0)
            else:
                daemon = DaemonThread(tmp, channel)
                daemon.start()
            load = Load(node, rate, batch, threads, warmup_s + seconds)
            load.start()
            load.join()
            _wait_delivered(load, rec, drain_s)
            rt_status = node.realtime.status()
        finally:
            try:
                if daemon is not None:
                    daemon.stop()
            finally:
                node.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        rt_lag_consumer.drop(channel)

    lo = load.t0_ns + int(warmup_s * 1e9)
    hi = load.end_ns
    window = load.keys_committed(lo, hi)
    arr = _arrivals(load, rec)
    lags = sorted((arr.first_ns[g] - load.commit_ns[g]) / 1e6 for g in window if arr.count[g])
    missing = sum(1 for g in window if not arr.count[g]) * batch
    dups = sum(max(0, arr.count[g] - batch) for g in window)
    entries = len(window) * batch
    calls = sorted(load.call_ns[g] / 1e6 for g in window)
    late = sorted(load.late_ns[g] / 1e6 for g in window)
    if not lags:
        raise RuntimeError(f"no entry of the measured window arrived ({entries} committed)")
    p99 = _pct(lags, 99)
    assert p99 is not None
    extra: dict[str, Any] = {
        "lag_p50_ms": _ms(_pct(lags, 50)),
        "lag_p90_ms": _ms(_pct(lags, 90)),
        "lag_p99_ms": _ms(p99),
        "lag_p999_ms": _ms(_pct(lags, 99.9)),
        "lag_max_ms": _ms(lags[-1]),
        "lag_min_ms": _ms(lags[0]),
        "lag_negative": sum(1 for x in lags if x < 0),
        "rate": round(entries / seconds),
        "missing": missing,
        "duplicates": dups,
        "commit_p50_ms": _ms(_pct(calls, 50)),
        "commit_p99_ms": _ms(_pct(calls, 99)),
        "start_late_p99_ms": _ms(_pct(late, 99)),
        "consumer_calls": rec.calls,
        "process_cpu_percent": load.cpu_percent,
        "loadavg_1m": load.loadavg_1m,
    }
    if realtime:
        extra["rt_buffer_max_used_bytes"] = rt_status["buffer_max_used_bytes"]
        extra["rt_stops"] = rt_status["stops"]
    if missing:
        raise RuntimeError(f"{missing} of {entries} committed entries never arrived ({extra})")
    return Measurement(entries, seconds, extra, value=p99)


# --- the off -> on switch ---------------------------------------------------------------------------------
@dataclass
class SwitchRun:
    phase_s: float
    png: list[Path]
    rate: int = 5_000
    batch: int = 10
    threads: int = 2
    flush_ms: int = 2
    warmup_s: float = 1.0


def run_switch(spec: SwitchRun) -> Measurement:
    channel = f"switch-{os.getpid()}-{next(_run_ids)}"
    rec = rt_lag_consumer.recorder(channel, fresh=True)
    tmp = _tmpdir("cdcd-bench-switch-")
    daemon: DaemonThread | None = None
    marks: dict[str, int] = {}
    try:
        node = Node.open(
            tmp,
            wal_mode="fsync",
            wal_flush_interval_ms=spec.flush_ms,
            wal_force_archive_timeout_ms=FORCE_ARCHIVE_MS,
            realtime_cdc=True,
            realtime_consumer=_consumer_table(channel),
        )
        try:
            daemon = DaemonThread(tmp, channel)
            daemon.start()
            _wait_mode(node, RealtimeMode.ON, 10.0)  # the daemon let the node's try-start through
            load = Load(node, spec.rate, spec.batch, spec.threads, spec.warmup_s + 3 * spec.phase_s)
            load.start()
            t_zero = load.t0_ns + int(spec.warmup_s * 1e9)

            def at(seconds: float) -> None:
                time.sleep(max(0.0, (t_zero + int(seconds * 1e9) - time.perf_counter_ns()) / 1e9))

            at(spec.phase_s)
            marks["off"] = time.perf_counter_ns()
            node.realtime.request_off()
            marks["off_returned"] = time.perf_counter_ns()
            at(2 * spec.phase_s)
            marks["on"] = time.perf_counter_ns()
            node.realtime.request_on()
            marks["on_returned"] = time.perf_counter_ns()
            load.join()
            _wait_delivered(load, rec, 5.0)
            status = node.status()
        finally:
            try:
                if daemon is not None:
                    daemon.stop()
            finally:
                node.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        rt_lag_consumer.drop(channel)

    arr = _arrivals(load, rec)
    window = load.keys_committed(t_zero, load.end_ns)
    missing = sum(1 for g in window if not arr.count[g]) * spec.batch
    dups = sum(max(0, arr.count[g] - spec.batch) for g in window)
    points = [
        ((load.commit_ns[g] - t_zero) / 1e9, (arr.first_ns[g] - load.commit_ns[g]) / 1e6, arr.source[g])
        for g in window
        if arr.count[g]
    ]
    batches = rec.snapshot()

    def first_after(t_ns: int, source: str) -> float | None:
        ts = [t for t, src, keys in batches if src == source and t >= t_ns and keys]
        return (min(ts) - t_ns) / 1e6 if ts else None

    def lag_stats(lo_s: float, hi_s: float, source: str) -> list[float]:
        return sorted(lag for x, lag, src in points if lo_s <= x < hi_s and src == source)

    ph = spec.phase_s
    off_ns, on_ns = marks["off_returned"], marks["on_returned"]
    back_ms = first_after(marks["on"], "node")
    settle_s = (back_ms or 0) / 1000 + 0.5
    node_lags = sorted(lag_stats(0, ph, "node") + lag_stats(2 * ph + settle_s, 3 * ph, "node"))
    daemon_lags = lag_stats(ph, 2 * ph, "daemon")
    extra: dict[str, Any] = {
        "handover_on_ms": _ms(back_ms),
        "handover_off_ms": _ms(first_after(marks["off"], "daemon")),
        "request_on_call_ms": _ms((marks["on_returned"] - marks["on"]) / 1e6),
        "node_lag_p50_ms": _ms(_pct(node_lags, 50)),
        "node_lag_p99_ms": _ms(_pct(node_lags, 99)),
        "daemon_lag_p50_ms": _ms(_pct(daemon_lags, 50)),
        "daemon_lag_max_ms": _ms(daemon_lags[-1] if daemon_lags else None),
        "lag_max_ms": _ms(max((lag for _, lag, _ in points), default=None)),
        "by_node": sum(1 for _, _, s in points if s == "node") * spec.batch,
        "by_daemon": sum(1 for _, _, s in points if s == "daemon") * spec.batch,
        "missing": missing,
        "duplicates": dups,
        # Who delivered what was committed (put() returned) after request_off() / request_on() returned:
        "by_node_after_off": sum(1 for g in window if arr.source[g] == "node" and off_ns <= load.commit_ns[g] < on_ns)
        * spec.batch,
        "by_daemon_after_on": sum(1 for g in window if arr.source[g] == "daemon" and load.commit_ns[g] >= on_ns)
        * spec.batch,
        "rate": round(len(window) * spec.batch / (3 * ph)),
        "realtime_stops": status["realtime"]["stops"],
        "process_cpu_percent": load.cpu_percent,
        "loadavg_1m": load.loadavg_1m,
    }
    for path in spec.png:
        _plot(points, spec, extra, path)
    extra["png"] = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in spec.png]
    if back_ms is None:
        raise RuntimeError(f"the node never delivered again after request_on() ({extra})")
    return Measurement(len(window) * spec.batch, 3 * ph, extra, value=back_ms)


def _fmt(x: float | None, div: float, unit: str, digits: int) -> str:
    return "n/a" if x is None else f"{x / div:.{digits}f}{' ' if unit else ''}{unit}"


def _plot(points: list[tuple[float, float, str]], spec: SwitchRun, extra: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    styles = {"node": ("tab:blue", "node (realtime worker)"), "daemon": ("tab:orange", "daemon (archived segments)")}
    for source, (color, label) in styles.items():
        xs = [x for x, _, s in points if s == source]
        ys = [lag for _, lag, s in points if s == source]
        n = extra[f"by_{source}"]
        ax.scatter(xs, ys, s=3, c=color, alpha=0.5, linewidths=0, label=f"{label}: {n:,} entries", rasterized=True)
    ph = spec.phase_s
    marks = (
        (ph, "request_off()", f"daemon delivers {_fmt(extra['handover_off_ms'], 1000, 's', 2)} later"),
        (2 * ph, "request_on()", f"node delivers {_fmt(extra['handover_on_ms'], 1, 'ms', 0)} later"),
    )
    for x, text, note in marks:
        ax.axvline(x, color="0.3", linestyle="--", linewidth=1)
        ax.text(x, 1.02, text, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=9)
        ax.text(x + 0.08, 0.5, note, transform=ax.get_xaxis_transform(), ha="left", va="center", fontsize=8)
    ax.axhline(FORCE_ARCHIVE_MS, color="tab:red", linestyle=":", linewidth=1)
    ax.text(
        3 * ph - 0.1, FORCE_ARCHIVE_MS * 1.15, "wal_force_archive_timeout_ms", color="tab:red", fontsize=8, ha="right"
    )
    # symlog: linear within +-1 ms, so the lags < 0 (the consumer ran before put() returned) show too
    ax.set_yscale("symlog", linthresh=1.0, linscale=0.6)
    top = max(3000.0, max((lag for _, lag, _ in points), default=1) * 1.5)
    bottom = min(-1.0, min((lag for _, lag, _ in points), default=-1) * 1.3)
    ax.set_ylim(bottom, top)
    ax.set_xlim(0, 3 * ph)
    ax.set_xlabel("commit time (s)")
    ax.set_ylabel("capture lag: put() returned -> consumer called (ms, symlog)")
    ax.set_title(
        f"Realtime on -> off -> on under {spec.rate:,} entries/s (put_all of {spec.batch}, wal_mode=fsync, "
        f"flush {spec.flush_ms} ms, daemon running)",
        fontsize=10,
        pad=18,
    )
    notes = (
        f"node lag p50/p99 {_fmt(extra['node_lag_p50_ms'], 1, '', 2)}/{_fmt(extra['node_lag_p99_ms'], 1, 'ms', 1)}; "
        f"daemon lag p50 {_fmt(extra['daemon_lag_p50_ms'], 1, 'ms', 0)}, "
        f"max {_fmt(extra['daemon_lag_max_ms'], 1, 'ms', 0)}; "
        f"missing {extra['missing']}, duplicates {extra['duplicates']}. "
        "Lag < 0: the realtime worker is offered a chunk before the committers wake."
    )
    fig.text(0.01, 0.01, notes, fontsize=8, color="0.25")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower center", markerscale=4, fontsize=9, framealpha=0.9)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- the suite ------------------------------------------------------------------------------------------
_LAG_ROWS = (
    Metric("lag p50", "lag_p50_ms", "ms", lower_is_better=True),
    Metric("lag p99.9", "lag_p999_ms", "ms", lower_is_better=True),
    Metric("lag max", "lag_max_ms", "ms", lower_is_better=True),
    Metric("achieved rate", "rate", "entries/s"),
)


def benchmarks(quick: bool) -> list[Bench]:
    warmup_s, seconds = (0.3, 1.0) if quick else (1.0, 5.0)
    out: list[Bench] = []

    def lag_bench(
        name: str, desc: str, run: Callable[[], Measurement], params: dict[str, Any], goal: float | None
    ) -> Bench:
        return Bench(
            name=name,
            description=desc,
            run_once=run,
            metric="lag p99",
            unit="ms",
            goal=goal,
            lower_is_better=True,
            max_repeats=1 if goal is None else 3,  # ~7 s a run: repeat only the one with a goal
            more=_LAG_ROWS
            if goal is None
            else tuple(
                Metric(m.metric, m.key, m.unit, GOAL_P999_MS, lower_is_better=True) if m.key == "lag_p999_ms" else m
                for m in _LAG_ROWS
            ),
            params=params,
        )

    for rate, (batch, threads) in LOAD_SHAPES.items():
        shape = f"{'single puts' if batch == 1 else f'put_all of {batch}'}, {threads} writer thread(s)"
        wal_modes = ("fsync", "background") if rate == 10_000 else ("fsync",)
        for wal_mode, flush_ms in itertools.product(wal_modes, (2, 10)):
            params = {
                "mode": "realtime",
                "rate": rate,
                "flush_ms": flush_ms,
                "wal_mode": wal_mode,
                "warmup_s": warmup_s,
                "seconds": seconds,
                "drain_s": 3.0,
            }
            goal = GOAL_P99_MS if (rate, flush_ms, wal_mode) == (10_000, 2, "fsync") else None
            suffix = "" if wal_mode == "fsync" else f".{wal_mode}"
            out.append(
                lag_bench(
                    f"realtime.lag.{_rate_name(rate)}.flush{flush_ms}{suffix}",
                    f"realtime capture lag, {rate:,} entries/s ({shape}), {wal_mode}, flush {flush_ms} ms",
                    lambda p=params: run_lag(**p),
                    {**params, "batch": batch, "threads": threads},
                    goal,
                )
            )
    for rate, (batch, threads) in LOAD_SHAPES.items():
        params = {"mode": "archive", "rate": rate, "warmup_s": warmup_s, "seconds": seconds, "drain_s": 5.0}
        out.append(
            lag_bench(
                f"archive.lag.{_rate_name(rate)}",
                f"daemon capture lag, {rate:,} entries/s, fsync, force-archive {FORCE_ARCHIVE_MS} ms",
                lambda p=params: run_lag(**p),
                {
                    **params,
                    "batch": batch,
                    "threads": threads,
                    "wal_mode": "fsync",
                    "wal_force_archive_timeout_ms": FORCE_ARCHIVE_MS,
                },
                None,
            )
        )

    pngs = (
        [RESULTS_DIR / "realtime-switch-quick.png"]
        if quick
        else [
            RESULTS_DIR / "realtime-switch.png",
            ROOT / "docs" / "realtime-switch.png",
        ]
    )
    spec = SwitchRun(phase_s=2.0 if quick else 5.0, warmup_s=0.3 if quick else 1.0, png=pngs)
    out.append(
        Bench(
            name="realtime.switch",
            description=f"realtime on -> off -> on, 5k entries/s, daemon running ({spec.phase_s:g} s each)",
            run_once=lambda: run_switch(spec),
            metric="back to node after request_on",
            unit="ms",
            lower_is_better=True,
            max_repeats=1,
            more=(
                Metric("daemon takes over after off", "handover_off_ms", "ms", lower_is_better=True),
                Metric("node lag p99 (on phases)", "node_lag_p99_ms", "ms", lower_is_better=True),
                Metric("daemon lag p50 (off phase)", "daemon_lag_p50_ms", "ms", lower_is_better=True),
                Metric("entries missing", "missing", "entries", goal=0, lower_is_better=True),
                Metric("entries duplicated", "duplicates", "entries", lower_is_better=True),
            ),
            params={
                "rate": spec.rate,
                "batch": spec.batch,
                "threads": spec.threads,
                "flush_ms": spec.flush_ms,
                "phase_s": spec.phase_s,
                "wal_mode": "fsync",
                "wal_force_archive_timeout_ms": FORCE_ARCHIVE_MS,
            },
        )
    )
    return out
