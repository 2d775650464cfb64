"""Scheduled lake maintenance inside the lake sink's process: ``compact`` every ``compact_interval_s`` and
``optimize`` every ``optimize_interval_s``, on the sink's SparkSession or, without one, on delta-rs.

One owned background thread. A failed run is logged with its exception and counted
(``cdcd_lake_maintenance_failures_total``; a successful one sets
``cdcd_lake_last_maintenance_timestamp_seconds`` and its duration,
``cdcd_lake_last_maintenance_duration_seconds``, and is observed in
``cdcd_lake_maintenance_duration_seconds``); the next run
is tried at its normal time (a manual ``cdcd lake compact`` committing at the same moment makes
one MERGE lose, harmlessly). A run that loses to another writer's concurrent commit (another
daemon's maintenance on the same lake: Delta's concurrent-modification conflicts) is no failure:
it is logged, counted (``cdcd_lake_maintenance_conflicts_total``) and tried again after a backoff
delay. A run a neighbour had done already (a compaction that lost to one folding the same range,
an OPTIMIZE due moments after a neighbour's) is progress, not a conflict: it is logged
(``lake_maintenance_by_neighbour``), counted (``cdcd_lake_maintenance_by_neighbour_total``) and the
next run comes at its normal time. Scheduled delays carry a little jitter, so daemons started
together drift apart instead of running in step, and an OPTIMIZE that ran longer than its interval
is followed by the next only after as long again (compaction is never starved by it).
A typed table that cannot be opened or compacted fails no run: compaction skips it, naming it
(``lake_maintenance_table_skipped``, ``cdcd_lake_typed_table_failures_total``), and goes on with the rest.
``max_consecutive_failures`` real failures in a row stop the thread:
``alive()`` turns False and ``check()`` raises ``MaintenanceFailed`` naming the last error, so the
owner (the sink's ``alive()``/``on_events``) fails loudly instead of a lake whose state silently
stops advancing. Every step is idempotent (compaction through its application transaction), so
cancelling a run at ``stop()`` loses nothing.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import structlog
from deltalake.exceptions import DeltaError

from cdcd import metrics
from cdcd.lake.deltalog import LOG_DIR
from cdcd.lake.maintenance.autocompact import FilePolicy, bound_changes, bound_compacted
from cdcd.lake.maintenance.compact import CompactResult, compact, compacted_version
from cdcd.lake.maintenance.log_cleanup import clean_logs
from cdcd.lake.maintenance.ops import optimize, optimized_since
from cdcd.lake.maintenance.vacuum_rs import sweep_lake
from cdcd.lake.storage import open_delta
from cdcd.lake.table import CHANGES, STATE
from cdcd.logging import describe
from cdcd.retry import Backoff

log = structlog.get_logger("cdcd.lake")


class MaintenanceFailed(RuntimeError):
    """Scheduled maintenance gave up after ``max_consecutive_failures`` failures in a row."""


CONFLICTS = (
    "ConcurrentTransactionException",
    "ConcurrentDeleteReadException",
    "ConcurrentDeleteDeleteException",
    "ConcurrentAppendException",
    "MetadataChangedException",
    "ProtocolChangedException",
    "CommitFailedError",
    "Transaction failed: ",
    "version already exists",
)
"""Delta's concurrent-modification conflicts: delta-spark's exception classes (in the Py4J error's
text) and delta-rs' ``CommitFailedError``. Another writer committed first; the run can be redone."""

CONFLICT_BACKOFF = Backoff(initial_ms=500, max_ms=30_000, jitter=0.5)
"""Between a lost run and its retry: jittered, so that two daemons do not collide again in step."""
NEW_CACHE_DELAY_S = 1.0
"""A cache seen landing for the first time makes the next compaction due this soon (the rest of its first
burst lands meanwhile): its typed table and its rows in ``state`` answer queries seconds after its first
change, not a ``compact_interval_s`` later."""
CANCEL_REPEAT_S = 0.5
"""How often ``stop`` cancels the maintenance job group again while the run winds down."""
SCHEDULE_JITTER = 0.1
"""Each scheduled delay is drawn from ``interval * [1 - SCHEDULE_JITTER, 1 + SCHEDULE_JITTER]``."""
MAX_NICE = 19
"""The lowest CPU priority Linux has (nice 19)."""
VACUUM_FIRST_DELAY_S = 300.0
"""The first vacuum after a start runs this soon (or at ``vacuum_interval_s`` when shorter): a daemon restarted
more often than its interval still vacuums."""


_NOT_CONTIGUOUS = re.compile(r"DELTA_VERSIONS_NOT_CONTIGUOUS\] Versions \(([0-9, ]+)\)")
"""delta-spark listed ``_delta_log`` while neighbours committed: a directory listing is no snapshot, so a
commit file created during it can be missed while a later one is seen (a gap that is not in the log)."""
GAP_NEAR_HEAD_VERSIONS = 1000
"""A gap this close to its table's newest version whose files exist now was a listing race."""

_CREATED_BESIDE = re.compile(r"DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION.*?location \('([^']+)'\)")
"""Two first compactions creating one table (``state``) at once: the loser finds the winner's files."""


def is_conflict(exc: BaseException, lake: Path | None = None) -> bool:
    """Whether ``exc`` (or what caused it) is a Delta concurrent-modification conflict, a table creation
    that lost to a neighbour's (the location it found not empty is a Delta table now), or (with ``lake``)
    a gap in the changes log seen while neighbours committed that is no gap now."""
    text = f"{type(exc).__name__}: {describe(exc)}"
    if any(name in text for name in CONFLICTS):
        return True
    gap = _NOT_CONTIGUOUS.search(text)
    if gap is not None and lake is not None:
        return _gap_closed(lake, [int(v) for v in gap.group(1).replace(" ", "").split(",") if v])
    created = _CREATED_BESIDE.search(text)
    return created is not None and (Path(created.group(1)) / "_delta_log").is_dir()


def _gap_closed(lake: Path, listed: list[int]) -> bool:
    """Whether the versions missing between ``listed`` are commits of ``<lake>/changes`` (or ``state``, both
    committed to by neighbours) now, near its newest version (a gap that stays is a real failure)."""
    missing = sorted(set(range(min(listed), max(listed) + 1)) - set(listed)) if listed else []
    if not missing:
        return False
    for table in (lake / CHANGES, lake / STATE):
        if not all((table / LOG_DIR / f"{v:020d}.json").exists() for v in missing):
            continue
        try:
            newest = int(open_delta(table).version())
        except Exception:  # unreadable: no listing race to excuse the error, which is reported as it is
            log.debug("lake_maintenance_gap_check_failed", table=str(table), exc_info=True)
            continue
        if newest - max(listed) <= GAP_NEAR_HEAD_VERSIONS:
            return True
    return False


def lower_priority(increment: int) -> None:
    """Add ``increment`` to the calling thread's niceness (at most 19; Linux keeps it per thread, and threads
    this one starts inherit it). Lowering a priority needs no privilege; a system without per-thread
    priorities (not Linux) is logged and left as it is."""
    if not increment:
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + increment))
    except (OSError, AttributeError) as exc:
        log.warning("lake_maintenance_priority_unchanged", nice=increment, error=describe(exc))


def _table_fields(lake: Path, cache: str) -> set[str]:
    """The fields ``cache``'s typed table has a column for (none: no table, or one that cannot be read now)."""
    from cdcd.lake.typed.layout import read_layout, table_dir

    path = table_dir(lake, cache)
    if not (path / LOG_DIR).is_dir():
        return set()
    try:
        return set(read_layout(path).columns)
    except Exception:  # unreadable now: every field counts as new, one early compaction too many
        log.debug("lake_table_fields_unread", cache=cache, exc_info=True)
        return set()


def _compacted_caches(lake: Path) -> set[str]:
    """Caches with a typed table or rows in ``state``: compacted at least once."""
    from cdcd.lake.typed.layout import list_tables

    caches = set(list_tables(lake))
    if (lake / STATE / LOG_DIR).is_dir():
        try:
            adds = pa.table(open_delta(lake / STATE).get_add_actions(flatten=True))
            if adds.num_rows:
                caches |= {str(c) for c in adds.column("partition.cache").to_pylist()}
        except Exception:  # unreadable now: every cache counts as new, one early compaction too many
            log.debug("lake_state_caches_unread", exc_info=True)
    return caches


@dataclass(frozen=True)
class MaintainerOptions:
    compact_interval_s: float = 20.0
    """Seconds between compactions (changes -> state by MERGE); 0: never."""
    optimize_interval_s: float = 10.0
    """Seconds between OPTIMIZE runs on both tables (small files bin-packed); 0: never. Live traffic
    adds about one file per cache partition and second: this bounds the files a partition holds."""
    max_consecutive_failures: int = 3
    """Failed runs in a row (of either kind) after which the Maintainer stops and reports failure."""
    files: FilePolicy | None = None
    """Files per partition bounded by size tiers (cdcd/lake/maintenance/autocompact.py): the scheduled ``optimize`` is
    then that rewrite of ``changes``, without Spark, in a lane of its own, and each compaction bounds the
    files of ``state`` and the typed tables it committed to before it returns. None: Spark's OPTIMIZE of
    every table, in the compaction's thread (as before; ``cdcd lake optimize``)."""

    ready_within_s: float = 15.0
    """A new cache's typed table and its rows in ``state`` answer queries within this long of its first commit:
    a cache landing for the first time makes the next compaction due in ``NEW_CACHE_DELAY_S``, and one that
    took longer is logged (``lake_new_cache_ready`` at warning level, with the seconds)."""
    nice: int = 0
    """Niceness added to the maintenance threads (Linux; 0: the process's own priority, up to 19): the CPU
    they share with delivery (or with a node's realtime worker beside the daemon) goes to delivery first."""
    vacuum_interval_s: float = 3600.0
    """Seconds between vacuums of every table (files replaced longer than ``vacuum_retain_hours`` ago deleted,
    cdcd/lake/maintenance/vacuum_rs.py), in the optimize lane, without a JVM; 0: never."""
    vacuum_retain_hours: int = 24
    """How long a replaced file, a change data feed file or an orphan stays before a vacuum deletes it."""

    def __post_init__(self) -> None:
        if self.vacuum_retain_hours < 1:
            raise ValueError(f"vacuum_retain_hours = {self.vacuum_retain_hours}: must be >= 1")
        for name in ("compact_interval_s", "optimize_interval_s", "ready_within_s", "vacuum_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 0 (0 turns it off)")
        if self.max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures = {self.max_consecutive_failures}: must be >= 1")
        if not 0 <= self.nice <= MAX_NICE:
            raise ValueError(f"maintenance_nice = {self.nice}: must be from 0 to {MAX_NICE}")


class Maintainer:
    """``Maintainer(lake, spark, options)``; ``start()`` once, ``stop()`` once (idempotent).

    ``spark``: the owner's SparkSession (it stays the owner's: the Maintainer never stops it), or None: the
    tasks run without a JVM (``compact_fn`` then compacts on delta-rs).
    ``compact_fn``/``optimize_fn``: what runs (tests pass wrappers); default the lake's own."""

    def __init__(
        self,
        lake: Path,
        spark: Any,
        options: MaintainerOptions | None = None,
        *,
        compact_fn: Callable[[Any, Path], CompactResult] = compact,
        optimize_fn: Callable[[Any, Path], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lake = lake
        self.options = options or MaintainerOptions()
        self._spark = spark
        self._compact = compact_fn
        files = self.options.files
        if optimize_fn is None:
            optimize_fn = optimize if files is None else (lambda _spark, lake: bound_changes(lake, files))
        self._optimize = optimize_fn
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set when a new cache landed: the compaction lane runs soon (``NEW_CACHE_DELAY_S``)."""
        self._known_caches: set[str] | None = None
        self._fields: dict[str, set[str]] = {}
        """Per cache, the top-level fields its typed table has a column for, or that landed since."""
        self._new_caches: dict[str, float] = {}
        """Caches seen landing for the first time, not yet compacted: when (wall time) they landed."""
        self._threads: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._group = f"cdcd-lake-maintainer-{id(self):x}"
        self.compactions = 0
        self.optimizations = 0
        self.vacuums = 0
        self.failures = 0
        self.conflicts = 0
        self.by_neighbour = {"compact": 0, "optimize": 0}
        """Runs a neighbour had done already (see the module doc), per task."""
        self._optimize_since_s: float | None = None
        """Wall time from which a neighbour's OPTIMIZE makes this one's due run needless: the start of its
        last attempt that lost, or the end of its last own run (None: none yet; the interval before)."""
        self._rng = random.Random()
        self.last_compact: CompactResult | None = None
        self.error: BaseException | None = None
        """The exception that stopped the Maintainer (None while healthy)."""
        self.last_failure: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Maintainer.start() called twice")
        opts = self.options
        if not opts.compact_interval_s and not opts.optimize_interval_s and not opts.vacuum_interval_s:
            return  # all off: nothing to run, no thread
        # Separate lanes when OPTIMIZE is the JVM-free rewrite of changes: it never touches what compaction
        # commits to, and a long one never delays the compaction that keeps the tables current. The vacuum, on
        # delta-rs, joins the lane that is not compaction's when there is one.
        lanes = [["compact"], ["optimize", "vacuum"]] if opts.files is not None else [["compact", "optimize", "vacuum"]]
        for i, tasks in enumerate(t for t in lanes if any(self._interval(k) for k in t)):
            name = "cdcd-lake-maintainer" if i == 0 else f"cdcd-lake-maintainer-{tasks[0]}"
            thread = threading.Thread(target=self._run, args=(tasks,), name=name, daemon=True)
            self._threads.append(thread)
        self._thread = self._threads[0]
        for thread in self._threads:
            thread.start()

    def _interval(self, task: str) -> float:
        opts = self.options
        if task == "vacuum":
            return opts.vacuum_interval_s
        return opts.compact_interval_s if task == "compact" else opts.optimize_interval_s

    def _first_delay(self, task: str) -> float:
        interval = self._interval(task)
        return min(interval, VACUUM_FIRST_DELAY_S) if task == "vacuum" else interval

    def landed(self, rows_per_cache: Mapping[str, int], fields: Mapping[str, Collection[str]] | None = None) -> None:
        """Called by the sink after each commit: a cache landing for the first time (no typed table, no
        rows in ``state`` yet), or a known cache's value bringing a top-level field its typed table has no
        column for (``fields``: cache -> the fields of its values in the commit, when the sink read them),
        makes the next compaction due in ``NEW_CACHE_DELAY_S``."""
        if not self.options.compact_interval_s:
            return
        if self._known_caches is None:
            self._known_caches = _compacted_caches(self.lake)
        new = [c for c in rows_per_cache if c not in self._known_caches]
        grown: dict[str, list[str]] = {}
        for cache, names in (fields or {}).items():
            known = self._known_fields(cache)
            unseen = [f for f in names if f not in known]
            if unseen:
                known.update(unseen)
                if cache not in new:
                    grown[cache] = sorted(unseen)
        if new:
            self._known_caches.update(new)
            now = time.time()
            with self._lock:
                for cache in new:
                    self._new_caches.setdefault(cache, now)
            log.info("lake_maintenance_new_cache", caches=sorted(new), compact_in_s=NEW_CACHE_DELAY_S)
        if grown:
            log.info("lake_maintenance_new_fields", fields=grown, compact_in_s=NEW_CACHE_DELAY_S)
        if new or grown:
            self._wake.set()

    def _known_fields(self, cache: str) -> set[str]:
        """The fields ``cache``'s typed table has a column for (read once; then grown by what landed)."""
        known = self._fields.get(cache)
        if known is None:
            known = self._fields[cache] = _table_fields(self.lake, cache)
        return known

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the thread; a run in progress is cancelled (its Spark jobs): Delta discards their
        partial work. A compaction's typed tables, merged before state without Spark, may be
        committed already; the next compaction skips them (their application transaction) and
        finishes state and the cut. Waits up to ``timeout_s``."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            # Again and again: a cancel ends only the jobs running at that moment, and a compaction caught
            # planning (or in its delta-rs part) would start its next Spark job after a single one.
            while thread.is_alive() and (left_s := deadline - time.monotonic()) > 0:
                if self._spark is not None:
                    try:
                        self._spark.sparkContext.cancelJobGroup(self._group)
                    except Exception:  # the session may already be stopped by its owner
                        log.debug("lake_maintainer_cancel_failed", exc_info=True)
                thread.join(min(left_s, CANCEL_REPEAT_S))
            if thread.is_alive():
                raise TimeoutError(f"lake maintainer did not stop within {timeout_s:g} s")

    def alive(self) -> bool:
        """False once it gave up (``error`` set); True while running, or when never started/stopped cleanly."""
        return self.error is None

    def check(self) -> None:
        """Raise ``MaintenanceFailed`` if the Maintainer gave up."""
        if self.error is not None:
            raise MaintenanceFailed(
                f"{self.lake}: scheduled lake maintenance failed {self.options.max_consecutive_failures} times "
                f"in a row, last: {describe(self.error)}"
            ) from None  # the text carries the cause, on the one line the daemon exits with

    # --- the thread --------------------------------------------------------------------------------
    def _run(self, tasks: list[str]) -> None:
        lower_priority(self.options.nice)
        opts = self.options
        now = self._clock()
        due = {task: now + self._jittered(self._first_delay(task)) for task in tasks if self._interval(task)}
        consecutive = 0
        conflict_delays = CONFLICT_BACKOFF.delays_s()
        if self._spark is not None:
            self._spark.sparkContext.setJobGroup(self._group, "cdcd lake maintenance", interruptOnCancel=True)
        while not self._stop.is_set():
            if "compact" in due and self._wake.is_set():
                self._wake.clear()
                due["compact"] = min(due["compact"], self._clock() + NEW_CACHE_DELAY_S)
            task = min(due, key=lambda k: due[k])
            wait_s = due[task] - self._clock()
            if wait_s > 0:
                woken = self._wake.wait(wait_s) if "compact" in due else self._stop.wait(wait_s)
                if self._stop.is_set():
                    break
                if woken or self._clock() < due[task]:
                    continue
            run_started = self._clock()
            behind = False
            try:
                started = self._clock()
                behind = self._run_one(task)
                metrics.LAKE_LAST_MAINTENANCE.labels(task).set(time.time())
                run_s = self._clock() - started
                metrics.LAKE_MAINTENANCE_SECONDS.labels(task).observe(run_s)
                metrics.LAKE_LAST_MAINTENANCE_SECONDS.labels(task).set(run_s)
                consecutive = 0
                conflict_delays = CONFLICT_BACKOFF.delays_s()
            except Exception as exc:
                if self._stop.is_set():
                    break  # cancelled by stop(): idempotent work, nothing to report
                if is_conflict(exc, self.lake):
                    retry_in_s = next(conflict_delays)
                    self.conflicts += 1
                    metrics.LAKE_MAINTENANCE_CONFLICTS.labels(task).inc()
                    log.warning(
                        "lake_maintenance_conflict", task=task, error=describe(exc), retry_in_s=round(retry_in_s, 3)
                    )
                    due[task] = self._clock() + retry_in_s
                    continue
                consecutive += 1
                self.failures += 1
                metrics.LAKE_MAINTENANCE_FAILURES.labels(task).inc()
                self.last_failure = exc
                log.error("lake_maintenance_failed", task=task, consecutive=consecutive, exc_info=exc)
                if consecutive >= opts.max_consecutive_failures:
                    self.error = exc
                    self._stop.set()
                    self._wake.set()
                    log.error("lake_maintenance_stopped", lake=str(self.lake), failures=consecutive)
                    return
            interval = self._interval(task)
            if task == "optimize":
                # An OPTIMIZE that took longer than its interval (minutes over a backlog of small files on
                # busy cores) waits as long as it took: compaction, which keeps state current, gets at
                # least half of the thread, and a neighbour's OPTIMIZE meanwhile makes the next needless.
                interval = max(interval, self._clock() - run_started)
            # From the end of the run: a compaction longer than its interval is followed by the next at once,
            # never by a backlog of missed ones; one that left changes behind (its bound of rows per run) too.
            due[task] = self._clock() + (0.0 if behind else self._jittered(interval))

    def _report_ready(self, waiting: Mapping[str, float]) -> None:
        """The new caches this compaction brought into ``state`` and their tables: how long after landing."""
        if not waiting:
            return
        now = time.time()
        with self._lock:
            for cache in waiting:
                self._new_caches.pop(cache, None)
        worst = max(now - landed for landed in waiting.values())
        late = worst > self.options.ready_within_s
        (log.warning if late else log.info)(
            "lake_new_cache_ready",
            caches=sorted(waiting),
            seconds=round(worst, 3),
            ready_within_s=self.options.ready_within_s,
        )

    def _jittered(self, interval_s: float) -> float:
        return interval_s * self._rng.uniform(1.0 - SCHEDULE_JITTER, 1.0 + SCHEDULE_JITTER)

    def _by_neighbour(self, task: str, **fields: Any) -> None:
        self.by_neighbour[task] += 1
        metrics.LAKE_MAINTENANCE_BY_NEIGHBOUR.labels(task).inc()
        log.info("lake_maintenance_by_neighbour", task=task, **fields)

    def _clean_logs(self, compacted_to: int) -> None:
        """Old log files removed after a compaction (cdcd/lake/maintenance/log_cleanup.py). A cleanup that fails
        leaves the log longer, never shorter than it should be: a warning, and the next compaction tries again."""
        try:
            cleaned = clean_logs(self.lake, compacted_to)
        except (DeltaError, OSError, ValueError) as exc:
            metrics.LAKE_MAINTENANCE_FAILURES.labels("log_cleanup").inc()
            log.warning("lake_log_cleanup_failed", error=describe(exc))
            return
        for table, done in cleaned.items():
            metrics.LAKE_LOG_FILES.labels(table).set(done.remaining)
            if done.deleted:
                log.info("lake_log_cleaned", table=table, deleted=done.deleted, readable_from_version=done.kept_from)

    def _run_one(self, task: str) -> bool:
        """Run ``task`` once; True: a compaction left changes for the next run (``compact_max_rows``)."""
        started = self._clock()
        if task == "compact":
            with self._lock:
                waiting = dict(self._new_caches)  # landed before this run read changes: it compacts them
            mark = compacted_version(self.lake)
            try:
                result = self._compact(self._spark, self.lake)
            except Exception as exc:
                if self._stop.is_set() or not is_conflict(exc, self.lake):
                    raise
                # Lost to a neighbour's compaction that began from the same mark: it folded this run's range
                # (up to the changes its run had seen, a moment older than this one's); the next scheduled
                # compaction, this daemon's or a neighbour's, folds the few landed since.
                folded = compacted_version(self.lake)
                if folded <= mark:
                    raise
                self._by_neighbour("compact", compacted_from=mark, compacted_to=folded, error=describe(exc))
                return False
            files = self.options.files
            if files is not None and result.did_work:
                # What this compaction committed to state and the typed tables, bounded before the next.
                bound_compacted(self.lake, files)
            if result.to_version >= 0:
                self._clean_logs(result.to_version)
            self.last_compact = result
            self.compactions += 1
            if not result.behind:  # a run that left changes behind may not have reached a new cache's first
                self._report_ready(waiting)
            log.info(
                "lake_maintenance_compacted",
                to_version=result.to_version,
                keys=result.keys,
                seconds=round(self._clock() - started, 3),
                behind=result.behind,
            )
            for bad in result.skipped:
                # One bad typed table is no failed run (state and the other tables are current): a problem
                # line per run while it lasts, and cdcd_lake_typed_table_failures_total, not an exit.
                log.warning("lake_maintenance_table_skipped", path=str(bad.path), cache=bad.cache, error=bad.error)
            return result.behind
        elif task == "vacuum":
            swept = sweep_lake(self.lake, self.options.vacuum_retain_hours)
            # Also where this maintainer does not compact (compaction from a timer): the logs it would clean.
            self._clean_logs(compacted_version(self.lake))
            self.vacuums += 1
            for table, done in swept.items():
                if done.deleted_bytes:
                    metrics.LAKE_VACUUM_DELETED_BYTES.labels(table.split("/")[0]).inc(done.deleted_bytes)
            log.info(
                "lake_maintenance_vacuumed",
                deleted=sum(d.deleted_files for d in swept.values()),
                deleted_bytes=sum(d.deleted_bytes for d in swept.values()),
                seconds=round(self._clock() - started, 3),
            )
            return False
        else:
            # A neighbour's OPTIMIZE since then bin-packed the small files this run was due for: a second would
            # rewrite the few added since, or lose to it.
            since_s = self._optimize_since_s
            if since_s is None:
                since_s = time.time() - self.options.optimize_interval_s
            version = optimized_since(self.lake, int(since_s * 1000))
            if version is not None:
                self._by_neighbour("optimize", optimized_version=version)
                self._optimize_since_s = time.time()
                return False
            self._optimize_since_s = time.time()  # should this run lose, the winner's commit comes after
            self._optimize(self._spark, self.lake)
            self._optimize_since_s = time.time()  # this run's own commits are no neighbour's
            self.optimizations += 1
            log.info("lake_maintenance_optimized", seconds=round(self._clock() - started, 3))
            return False
