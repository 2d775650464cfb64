"""The lake rig: the test process's SparkSession, lake consumer configs, daemon processes of the lake tests, and
the reference checks of the change log against the WAL."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.daemon.config import load_daemon_config
from cdcd.daemon.ops import show_state
from cdcd.lake.log import LogEntry
from tests.support.procs import start_daemon, stop_daemon, wait_for
from tests.support.wal import archived_segments, wal_events

Pos = tuple[int, int, int]
TEST_MASTER = "local[2]"
"""The test process's own SparkSession (reading the lake)."""
QUICK_START = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
"""For daemons and nodes that start often: a JVM without the C2 JIT starts (and runs its first job) about twice as
fast on a small machine."""


# --- configs and processes ------------------------------------------------------------------------
def toml_value(v: Any) -> str:
    """A TOML value; table keys are quoted (``"spark.driver.host" = ...`` must not become nested tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def spark_consumer(lake: Path, master: str = "local[2]", **options: Any) -> dict[str, Any]:
    return {"kind": "spark", "lake_path": str(lake), "spark_master": master, **options}


def write_config(path: Path, node_dir: Path, consumer: dict[str, Any], **settings: Any) -> Path:
    """A daemon TOML config: no metrics port, quick polling, ``settings`` on top, ``[consumer]``."""
    values: dict[str, Any] = {
        "node_dir": str(node_dir),
        "metrics_address": "",
        "lock_timeout_ms": 5000,
        "check_interval_ms": 50,
        "batch_max_delay_ms": 200,
        **settings,
    }
    lines = [f"{k} = {toml_value(v)}" for k, v in values.items()]
    lines.append("[consumer]")
    lines += [f"{k} = {toml_value(v)}" for k, v in consumer.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def position(config: Path) -> Pos | None:
    """The daemon's committed position, read in-process from its LMDB state (None: none yet or unreadable)."""
    try:
        parts = show_state(load_daemon_config(config, environ={}))["position_parts"]
    except lmdb.Error:  # a daemon starting for the first time has not created its databases yet
        return None
    return tuple(parts) if parts is not None else None


def wait_started(proc: subprocess.Popen[bytes], err: Path, timeout: float = 120) -> None:
    wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, timeout, "daemon start")
    assert proc.poll() is None, err.read_text()[-3000:]


def caught_up(node_dir: Path) -> Pos:
    """The position a daemon has once it delivered every archived segment."""
    return (max(archived_segments(node_dir)) + 1, 0, 0)


def wait_caught_up(proc: subprocess.Popen[bytes], config: Path, node_dir: Path, err: Path, timeout: float) -> None:
    until = caught_up(node_dir)
    wait_for(
        lambda: proc.poll() is not None or position(config) == until, timeout, f"the daemon to commit {until}", 0.25
    )
    assert proc.poll() is None, err.read_text()[-3000:]


def run_to_end(config: Path, node_dir: Path, err: Path, timeout: float = 300) -> None:
    """Start ``cdcd run``, let it deliver every archived segment, SIGTERM it: exit 0."""
    proc = start_daemon(config, err)
    try:
        wait_started(proc, err)
        wait_caught_up(proc, config, node_dir, err, timeout)
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants (the daemon's Spark JVM), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Wait until these processes ended (a killed daemon's JVM notices its parent's death by itself)."""
    wait_for(lambda: not any(running(p) for p in pids), timeout, f"processes {pids} to end")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("cdcd: error:")]


# --- the lake and the reference -------------------------------------------------------------------
def read_log(lake: Path) -> list[LogEntry]:
    """The lake's commit log, in sequence order (read here, not with cdcd's LakeLog)."""
    paths = [p for p in (lake / "_cdcd_log").iterdir() if p.suffix == ".json" and p.stem.isdigit()]
    entries = [msgspec.json.decode(p.read_bytes(), type=LogEntry) for p in sorted(paths)]
    assert [e.seq for e in entries] == list(range(len(entries))), "log sequence numbers are contiguous"
    assert [int(p.stem) for p in sorted(paths)] == [e.seq for e in entries], "file names are the entries' seq"
    return entries


def visible_files(lake: Path) -> set[str]:
    """Parquet files a reader of ``<lake>/changes`` sees (Spark skips ``.``/``_``-prefixed names), relative."""
    changes = lake / "changes"
    out = set()
    for p in changes.rglob("*.parquet"):
        rel = p.relative_to(changes)
        if not any(part.startswith((".", "_")) for part in rel.parts):
            out.add(str(rel))
    return out


def staging_contents(lake: Path) -> list[str]:
    staging = lake / "_staging"
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*")) if staging.exists() else []


def as_pos(p: Any) -> Pos:
    return (p.segment, p.offset, p.entry_index)


def entry_range(entry: LogEntry) -> tuple[Pos, Pos]:
    return as_pos(entry.first), as_pos(entry.last)


def check_log_invariants(lake: Path, wal_positions: list[Pos]) -> list[LogEntry]:
    """What must hold at any moment, also right after a SIGKILL: the log's entries cover disjoint, increasing
    ranges of WAL data entries, and every Parquet file visible under ``changes/`` is named by an entry."""
    entries = read_log(lake)
    index = {p: i for i, p in enumerate(wal_positions)}
    by_source: dict[str, list[LogEntry]] = {}
    for e in entries:
        by_source.setdefault(e.source, []).append(e)
    for source, es in by_source.items():
        prev: Pos | None = None
        for e in es:
            first, last = entry_range(e)
            assert first in index and last in index, f"entry {e.seq}: {first}..{last} are not WAL data entries"
            assert first <= last, f"entry {e.seq}: empty range"
            assert prev is None or first > prev, f"entry {e.seq} of {source}: {first} overlaps the previous {prev}"
            prev = last
            assert e.files, f"entry {e.seq} names no file"
    named = {rel for e in entries for rel in e.files}
    orphans = visible_files(lake) - named
    assert not orphans, f"Parquet files under changes/ that no log entry names (visible to readers): {orphans}"
    return entries


def check_lake(spark: Any, lake: Path, node_dir: Path, expected: list[dict[str, Any]] | None = None) -> list[LogEntry]:
    """The lake is exactly the WAL: see the module docstring. Also: staging empty, no temp log file."""
    expected = wal_events(node_dir) if expected is None else expected
    positions = [tuple(e["pos"]) for e in expected]
    entries = check_log_invariants(lake, positions)
    named = {rel for e in entries for rel in e.files}
    assert visible_files(lake) == named, f"files named by the log but missing: {named - visible_files(lake)}"
    assert staging_contents(lake) == [], "staging is empty once no writer runs"
    assert [p.name for p in (lake / "_cdcd_log").iterdir() if not p.stem.isdigit()] == [], "no temp log file left"

    # Each entry's files hold exactly the WAL entries of its range.
    index = {p: i for i, p in enumerate(positions)}
    covered = 0
    for e in entries:
        first, last = entry_range(e)
        want = positions[index[first] : index[last] + 1]
        got: list[Pos] = []
        for rel in e.files:
            t = pq.read_table(lake / "changes" / rel, columns=["wal_segment", "wal_offset", "wal_index"])
            got += zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True)
        assert sorted(got) == want, f"entry {e.seq} ({first}..{last}): its files hold other rows"
        assert sum(s.rows for s in e.caches.values()) == len(want)
        covered += len(want)
    assert covered == len(expected), f"the log covers {covered} of {len(expected)} WAL entries"

    # What a reader sees: one row per WAL data entry, equal to it.
    df = spark.read.parquet(str(lake / "changes"))
    assert df.count() == len(expected)
    table = df.toArrow()
    table = table.set_column(
        table.schema.get_field_index("commit_ts"), "commit_ts", table.column("commit_ts").cast(pa.int64())
    )
    rows = table.to_pylist()
    pos_of = [(r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in rows]
    dupes = [p for p, n in Counter(pos_of).items() if n > 1]
    assert not dupes, f"{len(dupes)} WAL entries landed more than once, e.g. {dupes[:5]}"
    assert Counter(pos_of) == Counter(positions), "the change log's positions are not the WAL's data entries"
    sources = {e.source for e in entries}
    assert len(sources) == 1
    by_pos = dict(zip(pos_of, rows, strict=True))
    for ev in expected:
        r = by_pos[tuple(ev["pos"])]
        got_row = {
            "cache": r["cache"],
            "op": r["op"],
            "key": json.loads(r["key"]),
            "value": json.loads(r["value"]) if r["value"] is not None else None,
            "partition": r["partition"],
            "primary": r["primary"],
            "order": r["version_order"],
            "cluster_id": r["version_cluster_id"],
            "commit_ts_us": r["commit_ts"],
            "source": r["source_node"],
        }
        want_row = {
            "cache": ev["cache"],
            "op": ev["op"],
            "key": ev["key"],
            "value": ev["value"] if ev["op"] != "delete" else None,
            "partition": ev["partition"],
            "primary": ev["primary"],
            "order": ev["version"]["order"],
            "cluster_id": ev["version"]["cluster_id"],
            "commit_ts_us": ev["commit_ts_ns"] // 1000,
            "source": next(iter(sources)),
        }
        assert got_row == want_row, f"row at {ev['pos']}"
        if "day" in r:  # partition_by_day: the commit's UTC day (Spark's partition discovery reads it as a date)
            day = datetime.fromtimestamp(r["commit_ts"] / 1e6, UTC).date()
            assert str(r["day"]) == str(day), f"row at {ev['pos']}: day {r['day']} != {day}"
    return entries


def fake_compacted_state(lake: Path, cache: str, rows: list[tuple[str, str]]) -> None:
    """A lake whose compacted state of ``cache`` holds ``rows`` (key JSON, value JSON), without running Spark."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (lake / "_cdcd_log").mkdir(parents=True, exist_ok=True)
    state = lake / "state" / f"cache={cache}"
    state.mkdir(parents=True)
    keys, values = [k for k, _ in rows], [v for _, v in rows]
    pq.write_table(pa.table({"key": keys, "value": values}), state / "part-0.parquet")


def covered_below(lake: Path, positions: list[Pos], until: Pos | None) -> None:
    """The daemon's committed position ``until`` is never past the lake: every WAL entry before it is in the log."""
    if until is None:
        return
    index = {p: i for i, p in enumerate(positions)}
    covered = set()
    for e in read_log(lake):
        first, last = entry_range(e)
        covered.update(range(index[first], index[last] + 1))
    missing = [p for p in positions if p < until and index[p] not in covered]
    assert not missing, f"the daemon committed {until} but {len(missing)} entries before it are not in the lake"


def check_state_matches_lake(lake: Path, positions: list[Pos], state: Pos | None) -> None:
    """After a consumer failure (not a kill) the daemon's state is exactly where the lake ends: it confirmed every
    batch that landed (not behind) and none that did not (not past)."""
    covered_below(lake, positions, state)
    landed = sum(
        len(positions[positions.index(a) : positions.index(b) + 1]) for a, b in map(entry_range, read_log(lake))
    )
    before = sum(1 for p in positions if state is not None and p < state)
    assert before == landed, f"the daemon's state {state} covers {before} entries, the lake holds {landed}"
