"""The lake Maintainer on its own (the sink wires it in): it compacts every ``compact_interval_s`` and
optimizes every ``optimize_interval_s`` while changes keep arriving; a failure is logged, retried at
the next interval, and after ``max_consecutive_failures`` in a row it stops and says so; stop() ends
its thread."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing

from cdcd.lake.maintenance.compact import NotADeltaLake, compacted_version, table_version
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions, MaintenanceFailed
from cdcd.lake.table import CHANGES
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import wait_for

DEADLINE_S = 300.0


def operations(table: Path) -> list[str]:
    from deltalake import DeltaTable

    return [h["operation"] for h in DeltaTable(str(table)).history()]


def test_compacts_and_optimizes_on_schedule_while_changes_arrive(spark: Any, tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    from cdcd import metrics

    metrics.export(metrics.LAKE)
    lake = tmp_path / "lake"
    rows = [change("orders", "0", '"first"', 1)]
    append_changes(lake, rows)
    m = Maintainer(lake, spark, MaintainerOptions(compact_interval_s=0.2, optimize_interval_s=2.0))
    started = time.time()
    m.start()
    try:
        for i in range(1, 4):  # each batch is picked up by a later scheduled compaction
            batch = [
                change("orders", str(i), f'"v{i}"', 10 + i),
                change("orders", "0", None if i == 3 else f'"{i}"', 20 + i),
            ]
            rows += batch
            version = append_changes(lake, batch)
            wait_for(
                lambda v=version: compacted_version(lake) >= v,
                DEADLINE_S,
                f"compaction up to changes version {version}",
            )
            assert state_rows(lake) == expected_state(rows)
        wait_for(lambda: "OPTIMIZE" in operations(lake / CHANGES), DEADLINE_S, "a scheduled OPTIMIZE of changes")
        # The counters follow the commits (a run counts once it returned).
        wait_for(lambda: m.compactions >= 3 and m.optimizations >= 1, DEADLINE_S, "the runs to be counted")
        assert m.alive() and m.error is None and m.failures == 0
        m.check()
    finally:
        m.stop()
    # each task's last success is stamped at the end of its run, within this test
    for task in ("compact", "optimize"):
        last = REGISTRY.get_sample_value("cdcd_lake_last_maintenance_timestamp_seconds", {"task": task})
        assert last is not None and started < last <= time.time(), (task, last)
    assert not any(t.name == "cdcd-lake-maintainer" for t in __import__("threading").enumerate())
    # The OPTIMIZE changed no data: the state still equals every change folded, nothing left to compact.
    assert state_rows(lake) == expected_state(rows)
    assert compacted_version(lake) <= (table_version(lake / CHANGES) or 0)


def test_each_run_s_duration_is_measured_and_exported(spark: Any, tmp_path: Path) -> None:
    """A successful run's duration lands in `cdcd_lake_last_maintenance_duration_seconds{task}` (the last run's)
    and `cdcd_lake_maintenance_duration_seconds{task}` (every run's). The Maintainer's clock jumps 100 s times
    the run's number inside each real compaction: the figures can only come from measuring each run on that
    clock, one run at a time (never the sum of runs, never the wall time between them)."""
    from prometheus_client import REGISTRY

    from cdcd import metrics
    from cdcd.lake.maintenance.compact import CompactResult, compact

    metrics.export(metrics.LAKE)

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"task": "compact"}) or 0.0

    count_before = sample("cdcd_lake_maintenance_duration_seconds_count")
    sum_before = sample("cdcd_lake_maintenance_duration_seconds_sum")
    jumped_s = [0.0]
    runs: list[CompactResult] = []

    def clock() -> float:
        return time.monotonic() + jumped_s[0]

    def compact_then_jump(session: Any, lake: Path) -> CompactResult:
        result = compact(session, lake)
        runs.append(result)
        jumped_s[0] += 100.0 * len(runs)
        return result

    lake = tmp_path / "lake"
    append_changes(lake, [change("orders", "0", '"first"', 1)])
    m = Maintainer(
        lake,
        spark,
        MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0),
        compact_fn=compact_then_jump,
        clock=clock,
    )
    started = time.monotonic()
    m.start()
    try:
        wait_for(lambda: m.compactions >= 2, DEADLINE_S, "two scheduled compactions")
    finally:
        m.stop()
    real_s = time.monotonic() - started  # every run's real time is within this
    n = m.compactions
    assert n == len(runs) >= 2 and m.failures == 0
    last = sample("cdcd_lake_last_maintenance_duration_seconds")
    assert 100.0 * n <= last < 100.0 * n + real_s, (n, last, real_s)
    assert sample("cdcd_lake_maintenance_duration_seconds_count") - count_before == n
    jumps_s = 100.0 * n * (n + 1) / 2
    assert jumps_s <= sample("cdcd_lake_maintenance_duration_seconds_sum") - sum_before < jumps_s + real_s


def test_failures_are_logged_retried_then_surfaced(spark: Any, tmp_path: Path) -> None:
    """A lake whose changes table is not a Delta table: every compaction fails; each failure is logged
    with its exception, and after three in a row the Maintainer stops: alive() False, check() raises
    naming the error."""
    from prometheus_client import REGISTRY

    from cdcd import metrics

    metrics.export(metrics.LAKE)

    def failures() -> float:
        return REGISTRY.get_sample_value("cdcd_lake_maintenance_failures_total", {"task": "compact"}) or 0.0

    before = failures()
    lake = tmp_path / "lake"
    (lake / CHANGES).mkdir(parents=True)
    m = Maintainer(
        lake, spark, MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0, max_consecutive_failures=3)
    )
    # structlog's own capture: whatever an earlier test in this worker left configured (caplog then sees none)
    with structlog.testing.capture_logs() as logs:
        m.start()
        wait_for(lambda: not m.alive(), DEADLINE_S, "the maintainer to give up")
        m.stop()
    assert m.failures == 3 and failures() - before == 3
    assert isinstance(m.error, NotADeltaLake)
    with pytest.raises(MaintenanceFailed, match=r"failed 3 times in a row, last: NotADeltaLake: .*not a Delta table"):
        m.check()
    failed = [e for e in logs if e["event"] == "lake_maintenance_failed"]
    assert len(failed) == 3
    assert all(isinstance(e["exc_info"], NotADeltaLake) and "not a Delta table" in str(e["exc_info"]) for e in failed)
    assert any(e["event"] == "lake_maintenance_stopped" for e in logs)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"compact_interval_s = -1: must be >= 0"):
        MaintainerOptions(compact_interval_s=-1)
    with pytest.raises(ValueError, match=r"max_consecutive_failures = 0"):
        MaintainerOptions(max_consecutive_failures=0)


def test_the_lake_sink_runs_it_and_fails_when_it_gave_up(spark: Any, tmp_path: Path) -> None:
    """`compact_interval_s` in the sink's options: the JVM-free writer lands a node's WAL and the sink's
    Maintainer (on the process's SparkSession) compacts it into `state` without an operator; a Maintainer
    that gave up makes `alive()` raise its error (the daemon's exit line names it) and the next batch fail
    with it."""
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from cdcd.node import Node
    from tests.support.delta_lake import wal_batch

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    with Node.open(node_dir) as node:
        node.cache("orders").put_all({i: {"n": i} for i in range(50)})
        node.cache("orders").remove(7)
    opts = LakeOptions(
        lake_path=str(lake), writer="deltalake", spark_master="local[2]", compact_interval_s=0.5, optimize_interval_s=0
    )
    sink = LakeConsumer(opts)
    sink.start()
    try:
        assert sink.on_events(wal_batch(node_dir)) is True
        changes_version = table_version(lake / CHANGES)
        wait_for(lambda: compacted_version(lake) == changes_version, DEADLINE_S, "the sink's scheduled compaction")
        assert {key for _, key in state_rows(lake)} == {str(i) for i in range(50) if i != 7}
        assert sink.alive()
        maintainer = sink._maintainer
        assert maintainer is not None
        maintainer.error = RuntimeError("disk on fire")  # what the thread sets after max failures in a row
        with pytest.raises(MaintenanceFailed, match="failed 3 times in a row, last: RuntimeError: disk on fire"):
            sink.alive()
        with pytest.raises(MaintenanceFailed, match="disk on fire"):
            sink.on_events(wal_batch(node_dir))
    finally:
        sink.stop()


class ConcurrentAppend(Exception):
    """What a lost delta-spark commit looks like from Python (a Py4J error carrying the Java class and trace)."""


CONFLICT_TEXT = (
    "An error occurred while calling o88.execute.\n"
    ": io.delta.exceptions.ConcurrentAppendException: Files were added to partition [cache=orders] by a "
    "concurrent update. Please try the operation again.\n"
    "\tat io.delta.exceptions.ConcurrentAppendException$.apply(DeltaErrors.scala:1)\n"
)


def test_conflicts_with_a_neighbour_are_retried_not_counted(spark: Any, tmp_path: Path) -> None:
    """A compaction losing to another writer's commit three times in a row (Delta's ConcurrentAppendException)
    with max_consecutive_failures = 1: no failure is counted, the Maintainer stays alive, counts the conflicts
    (cdcd_lake_maintenance_conflicts_total{task="compact"}) and compacts once the neighbour lets it."""
    from prometheus_client import REGISTRY

    from cdcd import metrics
    from cdcd.lake.maintenance.compact import compact
    from cdcd.lake.maintenance.maintainer import is_conflict

    metrics.export(metrics.LAKE)
    lake = tmp_path / "lake"
    rows = [change("orders", "0", '"first"', 1)]
    version = append_changes(lake, rows)
    lost = [0]

    def loses_three_times(session: Any, path: Path) -> Any:
        if lost[0] < 3:
            lost[0] += 1
            raise ConcurrentAppend(CONFLICT_TEXT)
        return compact(session, path)

    def conflicts() -> float:
        return REGISTRY.get_sample_value("cdcd_lake_maintenance_conflicts_total", {"task": "compact"}) or 0.0

    def failures() -> float:
        return REGISTRY.get_sample_value("cdcd_lake_maintenance_failures_total", {"task": "compact"}) or 0.0

    before, failures_before = conflicts(), failures()
    m = Maintainer(
        lake,
        spark,
        MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0, max_consecutive_failures=1),
        compact_fn=loses_three_times,
    )
    m.start()
    try:
        wait_for(lambda: m.compactions >= 1 or not m.alive(), DEADLINE_S, "a compaction after the conflicts")
        assert m.alive() and m.failures == 0 and m.conflicts == 3, (m.failures, m.conflicts, m.error)
        m.check()
    finally:
        m.stop()
    assert compacted_version(lake) >= version and state_rows(lake) == expected_state(rows)
    assert conflicts() - before == 3 and failures() == failures_before
    assert is_conflict(ConcurrentAppend(CONFLICT_TEXT))
    assert not is_conflict(NotADeltaLake("lake/changes is not a Delta table"))
    from deltalake.exceptions import CommitFailedError

    assert is_conflict(CommitFailedError("Transaction failed: version already exists: 7"))


def test_a_table_created_by_a_neighbour_meanwhile_is_a_conflict(tmp_path: Path) -> None:
    """Two first compactions create `state` at once; the loser's "not empty and also not a Delta table" is a
    conflict once the location is a Delta table (the neighbour's), a failure while it is not."""
    from cdcd.lake.maintenance.maintainer import is_conflict

    state = tmp_path / "lake" / "state"
    state.mkdir(parents=True)
    error = Exception(
        "[DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION] Cannot create table ('`delta`.`" + str(state) + "`'). "
        f"The associated location ('{state}') is not empty and also not a Delta table."
    )
    assert not is_conflict(error), "a stray directory is a real failure"
    (state / "_delta_log").mkdir()
    assert is_conflict(error)


def test_stop_also_cancels_a_spark_job_the_run_starts_after_the_stop(spark: Any, tmp_path: Path) -> None:
    """A compaction caught between Spark jobs (planning, or its delta-rs part) when stop() comes submits its
    next job after the cancel; stop() cancels again until the run ends, so it returns, not waits for that job
    (one that would never end here) until its timeout."""
    import threading

    from py4j.protocol import Py4JJavaError

    began = threading.Event()
    finished: list[str] = []
    maintainer: list[Maintainer] = []

    def compact_then_an_endless_job(session: Any, _lake: Any) -> Any:
        began.set()
        maintainer[0]._stop.wait()  # stop() has been called (and has cancelled what ran): the next job starts
        try:
            session.range(0, 1 << 62, numPartitions=2).selectExpr("sum(id % 7)").collect()
        except Py4JJavaError as exc:
            finished.append("cancelled" if "cancel" in str(exc).lower() else f"failed: {exc}")
            raise
        finished.append("completed")
        raise AssertionError("an endless job completed")

    m = Maintainer(
        tmp_path / "lake",
        spark,
        MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0, max_consecutive_failures=1),
        compact_fn=compact_then_an_endless_job,
    )
    maintainer.append(m)
    m.start()
    try:
        assert began.wait(DEADLINE_S), "the scheduled compaction never began"
        m.stop(timeout_s=DEADLINE_S)
    finally:
        spark.sparkContext.cancelAllJobs()  # whatever happened, no endless job outlives the test
    assert finished == ["cancelled"]
    assert m.alive() and m.failures == 0, "a run cancelled by stop() is not a failure"


def _counter(name: str, task: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"task": task}) or 0.0


def test_a_compaction_lost_to_a_neighbour_that_folded_the_same_changes_is_progress(spark: Any, tmp_path: Path) -> None:
    """A neighbour's compaction commits the changes this run was folding, and this run loses to it: no conflict
    to retry and no failure, but a run done by the neighbour (logged, counted in
    cdcd_lake_maintenance_by_neighbour_total{task="compact"}, the last-maintenance time set) and state current."""
    from cdcd import metrics
    from cdcd.lake.maintenance.compact import compact

    metrics.export(metrics.LAKE)
    lake = tmp_path / "lake"
    rows = [change("orders", str(i), f'"v{i}"', i + 1) for i in range(3)]
    version = append_changes(lake, rows)
    neighbour_ran: list[int] = []

    def neighbour_first(session: Any, path: Path) -> Any:
        if not neighbour_ran:
            neighbour_ran.append(compact(spark.newSession(), path).to_version)  # the neighbour's run, committed
            raise ConcurrentAppend(CONFLICT_TEXT)  # ... before this one's: it loses
        return compact(session, path)

    before = _counter("cdcd_lake_maintenance_by_neighbour_total", "compact")
    conflicts_before = _counter("cdcd_lake_maintenance_conflicts_total", "compact")
    m = Maintainer(
        lake,
        spark,
        MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0, max_consecutive_failures=1),
        compact_fn=neighbour_first,
    )
    m.start()
    try:
        wait_for(lambda: m.compactions >= 1 or not m.alive(), DEADLINE_S, "a compaction after the neighbour's")
        assert m.alive() and (m.failures, m.conflicts, m.by_neighbour["compact"]) == (0, 0, 1), m.error
    finally:
        m.stop()
    assert neighbour_ran == [version] and compacted_version(lake) >= version
    assert state_rows(lake) == expected_state(rows)
    assert _counter("cdcd_lake_maintenance_by_neighbour_total", "compact") - before == 1
    assert _counter("cdcd_lake_maintenance_conflicts_total", "compact") == conflicts_before


def test_an_optimize_lost_to_a_neighbours_is_retried_and_recognised_as_done(spark: Any, tmp_path: Path) -> None:
    """This daemon's OPTIMIZE loses to a neighbour's real OPTIMIZE of the same small files: a conflict, retried
    after a backoff; the retry finds the neighbour's commit since the lost attempt began and counts the run as
    done by the neighbour instead of rewriting the files again; the next scheduled run is its own."""
    from cdcd import metrics
    from cdcd.lake.maintenance.ops import optimize

    metrics.export(metrics.LAKE)
    lake = tmp_path / "lake"
    for i in range(3):  # three small files in one partition: OPTIMIZE has something to commit
        append_changes(lake, [change("orders", str(i), f'"v{i}"', i + 1)])
    calls: list[str] = []

    def loses_to_the_neighbour_once(session: Any, path: Path) -> Any:
        if not calls:
            calls.append("lost")
            optimize(spark, path)  # the neighbour's OPTIMIZE commits first
            raise ConcurrentAppend(CONFLICT_TEXT.replace("ConcurrentAppendException", "ConcurrentDeleteReadException"))
        calls.append("own")
        return optimize(session, path)

    before = _counter("cdcd_lake_maintenance_by_neighbour_total", "optimize")
    m = Maintainer(
        lake,
        spark,
        MaintainerOptions(compact_interval_s=0, optimize_interval_s=0.2, max_consecutive_failures=1),
        optimize_fn=loses_to_the_neighbour_once,
    )
    m.start()
    try:
        wait_for(lambda: m.optimizations >= 1 or not m.alive(), DEADLINE_S, "an own OPTIMIZE after the neighbour's")
        assert m.alive() and (m.failures, m.conflicts, m.by_neighbour["optimize"]) == (0, 1, 1), m.error
    finally:
        m.stop()
    assert calls[:2] == ["lost", "own"]
    assert operations(lake / CHANGES).count("OPTIMIZE") == 1, "the retry rewrote the neighbour's work again"
    assert _counter("cdcd_lake_maintenance_by_neighbour_total", "optimize") - before == 1


def test_a_gap_in_the_changes_log_seen_while_neighbours_commit_is_a_conflict(tmp_path: Path) -> None:
    """delta-spark listing `_delta_log` while neighbours commit can miss a file created during the listing and
    report the versions not contiguous; that is a conflict when the missing commits are there now, near the
    table's head, and a real failure when a commit is missing for good."""
    from cdcd.lake.maintenance.maintainer import is_conflict

    lake = tmp_path / "lake"
    for i in range(5):
        append_changes(lake, [change("orders", str(i), f'"v{i}"', i + 1)])

    def gap(versions: str) -> Exception:
        return Exception(
            f"An error occurred while calling o658.executeCompaction. <- : org.apache.spark.sql.delta."
            f"DeltaIllegalStateException: [DELTA_VERSIONS_NOT_CONTIGUOUS] Versions ({versions}) are not contiguous."
        )

    assert is_conflict(gap("0, 1, 3, 4"), lake)
    assert not is_conflict(gap("0, 1, 3, 4"))  # no lake to look in: a failure
    (lake / CHANGES / "_delta_log" / f"{2:020d}.json").unlink()
    assert not is_conflict(gap("0, 1, 3, 4"), lake), "a commit missing for good is a real failure"


def test_an_optimize_longer_than_its_interval_is_followed_after_as_long_again(spark: Any, tmp_path: Path) -> None:
    """OPTIMIZE every 0.05 s, each run taking 0.6 s: the next starts only after as long as the last took (less
    the schedule's jitter), so the thread is free for compaction at least half the time instead of running
    OPTIMIZE back to back."""
    from cdcd.lake.maintenance.maintainer import SCHEDULE_JITTER

    runs: list[tuple[float, float]] = []

    def slow_optimize(_session: Any, _lake: Path) -> None:
        began = time.monotonic()
        time.sleep(0.6)  # the run's length is the experiment
        runs.append((began, time.monotonic()))

    m = Maintainer(
        tmp_path / "lake",
        spark,
        MaintainerOptions(compact_interval_s=0, optimize_interval_s=0.05),
        optimize_fn=slow_optimize,
    )
    m.start()
    try:
        wait_for(lambda: len(runs) >= 3 or not m.alive(), DEADLINE_S, "three OPTIMIZE runs")
    finally:
        m.stop()
    assert m.alive(), m.error
    for (began, ended), (next_began, _) in itertools.pairwise(runs):
        assert next_began - ended >= (ended - began) * (1 - SCHEDULE_JITTER), runs
