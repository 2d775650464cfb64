"""The lake sink's writer side on Delta (DESIGN §7): ``<lake>/changes`` against the WAL, exactly once.

The reference is the WAL (``tests.test_daemon_e2e.wal_events``). ``check_lake`` compares a lake with it: the
table (read with delta-rs) holds exactly one row per WAL data entry, equal to it; every commit lands whole
DataRecords (no record's rows in two commits); each source's application transaction names the last
record landed.

Here: the sink in-process (replays, partly new batches, every cache name the node accepts), two processes
committing to one table at the same moment, a reader polling while ``cdcd run`` writes, a node dir restored
from a backup, and the hand-over between the node's realtime worker and the daemon. Kills and faults are in
``test_lake_faults.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdcd.lake.landing.delta import MAX_OFFSET, MAX_SEGMENT, LakeWriteError, app_id, decode_version, encode_version
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.node import Node
from cdcd.wal import WalPointer
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import (
    Pos,
    check_lake,
    check_whole_records,
    deliver,
    delta_commits,
    lake_consumer,
    lake_rows,
    record_sizes,
    sub_batch,
    wal_batch,
)
from tests.support.lake import error_lines, position, run_to_end, toml_value, wait_started, write_config
from tests.support.procs import ROOT, child_env, start_daemon, stop_daemon, wait_for
from tests.support.wal import archived_segments, wal_events
from tests.support.writer import make_node, start_writer


# --- the sink in-process ---------------------------------------------------------------------------------
def test_version_encoding_orders_like_the_wal_and_refuses_what_it_cannot_hold() -> None:
    """The application transaction version is strictly increasing with the WAL pointer over the whole range it
    holds, a non-negative Java long, and a pointer beyond it is an error (never a wrapped, smaller version)."""
    ptrs = [WalPointer(0, 0), WalPointer(0, 1), WalPointer(0, MAX_OFFSET), WalPointer(1, 0), WalPointer(MAX_SEGMENT, 0)]
    ptrs.append(WalPointer(MAX_SEGMENT, MAX_OFFSET))
    versions = [encode_version(p) for p in ptrs]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert 0 <= min(versions) and max(versions) == 2**63 - 1
    assert [decode_version(v) for v in versions] == ptrs
    for bad in (WalPointer(MAX_SEGMENT + 1, 0), WalPointer(0, MAX_OFFSET + 1)):
        with pytest.raises(LakeWriteError, match="keep wal_segment_size_bytes below 4 GiB"):
            encode_version(bad)


def test_replays_and_partly_new_batches_land_once(tmp_path: Path) -> None:
    """Batches of records, replayed whole, replayed with a new tail, and handed by a second sink on the same table
    land every WAL entry once; a replay writes no commit; a partly new batch commits only its new records."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=3, tx_per_segment=10)
    whole = wal_batch(node_dir)
    n = len(whole.peek_slices())
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        assert sink.on_events(sub_batch(whole, 0, 10)) is True
        v1 = DeltaTable(str(lake / "changes")).version()
        assert sink.on_events(sub_batch(whole, 0, 10)) is True  # a replay: no commit
        assert DeltaTable(str(lake / "changes")).version() == v1
        assert sink.batches_skipped == 1
        assert sink.on_events(sub_batch(whole, 5, 20)) is True  # partly new: records 10..19 only
        commits = delta_commits(lake)
        assert commits[-1]["cdcd"]["first"] == str(whole.peek_slices()[10].pointer)
        assert commits[-1]["cdcd"]["rows"] == sum(len(s.record.entries) for s in whole.peek_slices()[10:20])
    finally:
        sink.stop()
    other = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    other.start()
    try:
        assert other.on_events(sub_batch(whole, 15, n)) is True
    finally:
        other.stop()
    check_lake(lake, node_dir)
    assert len(delta_commits(lake)) == 4  # create + three batches


@pytest.mark.parametrize("writer", ["deltalake", "spark"])
def test_every_cache_name_the_node_accepts_lands(tmp_path: Path, writer: str) -> None:
    """Cache names of 255 characters, of 200 x "é" (400 bytes), with "%", spaces, a leading "." or "_" (names
    readers skip as hidden files): every one lands with
    its real name in the `cache` column and as the Delta partition value; no directory name exceeds 255 bytes;
    two names differing only past any prefix get two directories."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    names = ["a" * 255, "é" * 200, "50%half", "with space", ".hidden", "_under", "a" * 254 + "b", "plain-name_1.x"]
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        for i, name in enumerate(names):
            node.cache(name).put(i, {"name": name})
        node.force_archive()
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer=writer, spark_master="local[1]", **NO_MAINTENANCE))
    sink.start()
    try:
        deliver(sink, wal_batch(node_dir))
    finally:
        sink.stop()
    check_lake(lake, node_dir)
    rows = lake_rows(lake).to_pylist()
    assert sorted(r["cache"] for r in rows) == sorted(names)
    assert all(json.loads(r["value"])["name"] == r["cache"] for r in rows)
    adds = pa.table(DeltaTable(str(lake / "changes")).get_add_actions(flatten=True)).to_pylist()
    assert sorted(a["partition.cache"] for a in adds) == sorted(names)
    dirs = {a["path"].split("/")[0] for a in adds}
    assert len(dirs) == len(names)
    assert max(len(d.encode()) for d in dirs) <= 255
    assert "cache=plain-name_1.x" in dirs, "a plain name is its own directory"


@pytest.mark.parametrize("partition_by_day", [False, True])
def test_spark_writer_lands_one_partition_batches_straight_and_mixed_ones_through_partitioning(
    tmp_path: Path, partition_by_day: bool
) -> None:
    """The Spark writer writes a batch of one partition straight into its directory and a batch of
    several through Spark's partitioning: both land every row once, under the real cache name (odd ones
    too), with the partition columns only in the Delta log (a file holding them would be read with
    them twice by some readers)."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    names = ["a" * 255, "plain", ".hidden", "é" * 200]
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        for i, name in enumerate(names):
            for tx in range(3):
                node.cache(name).put_all({k: {"name": name, "k": k} for k in range(tx * 4, tx * 4 + 4)})
        node.force_archive()
    batch = wal_batch(node_dir)
    sink = LakeConsumer(
        LakeOptions(lake_path=str(lake), spark_master="local[1]", partition_by_day=partition_by_day, **NO_MAINTENANCE)
    )
    sink.start()
    try:
        # one cache, one cache, two caches
        deliver(sink, *(sub_batch(batch, start, stop) for start, stop in ((0, 3), (3, 6), (6, 12))))
    finally:
        sink.stop()
    check_lake(lake, node_dir)
    rows = lake_rows(lake).to_pylist()
    assert sorted(r["cache"] for r in rows) == sorted(n for n in names for _ in range(12))
    assert all(json.loads(r["value"])["name"] == r["cache"] for r in rows)
    dt = DeltaTable(str(lake / "changes"))
    adds = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    assert sorted({a["partition.cache"] for a in adds}) == sorted(names)
    for add in adds:
        meta = pq.read_metadata(lake / "changes" / add["path"])
        assert "cache" not in meta.schema.names and "day" not in meta.schema.names


def test_restored_node_continues_as_a_new_generation(tmp_path: Path) -> None:
    """A node dir restored from an earlier copy reuses WAL positions the lake already holds: its 10,000 new entries
    all land (as generation 1 of the source, next to generation 0's rows), none is dropped as a replay, a warning
    says so, and the records the copy shares with the lake are not landed twice."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "backup"
    n = make_node(node_dir, segments=2, tx_per_segment=20)
    shutil.copytree(node_dir, backup)
    make_node(node_dir, segments=14, tx_per_segment=20, first_tx=n)
    first = wal_batch(node_dir, "node-a")
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        assert sink.on_events(first) is True
        landed = lake_rows(lake).num_rows
        shutil.rmtree(node_dir)
        shutil.copytree(backup, node_dir)
        before = len(wal_events(node_dir))
        make_node(node_dir, segments=12, tx_per_segment=20, first_tx=n + 5000)
        again = wal_batch(node_dir, "node-a")
        assert again.peek_slices()[-1].pointer <= first.peek_slices()[-1].pointer, "all at positions the lake holds"
        assert sink.on_events(again) is True
        landed_both = lake_rows(lake).num_rows
        # Delivered again (a daemon restarted before confirming): the records of both histories it holds are
        # replays now, nothing lands and no third generation starts.
        assert sink.on_events(wal_batch(node_dir, "node-a")) is True
        assert lake_rows(lake).num_rows == landed_both
    finally:
        sink.stop()
    assert DeltaTable(str(lake / "changes")).transaction_version(app_id("node-a", 2)) is None
    rows = lake_rows(lake).to_pylist()
    new = [r for r in rows if r["source_generation"] == 1]
    after = wal_events(node_dir)
    assert len(rows) == landed + len(after) - before, "every new entry landed, the shared ones once"
    assert sorted((r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in new) == [
        tuple(e["pos"]) for e in after[before:]
    ]
    assert len(new) >= 10_000
    dt = DeltaTable(str(lake / "changes"))
    assert dt.transaction_version(app_id("node-a", 1)) == encode_version(again.peek_slices()[-1].pointer)


# --- two processes committing at the same moment -------------------------------------------------------
def test_processes_committing_at_once_land_exactly_once(tmp_path: Path) -> None:
    """Three processes commit to one table at the same moment: two land the same WAL as one source (batches of 3
    and of 5 records), the third lands it as another source. They race for every table version (put-if-absent
    commits, re-read on a lost race), yet each source has every entry once, in commits of whole records."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=4, tx_per_segment=40)
    go = tmp_path / "go"
    procs = []
    runs = [("node-a", 3), ("node-a", 5), ("node-b", 4)]
    for i, (source, per) in enumerate(runs):
        code = "import tests.support.delta_lake as t; t.land_main()"
        args = [str(node_dir), str(lake), str(per), str(go), str(tmp_path / f"out-{i}.json"), source]
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], env=child_env(), cwd=ROOT))
    # All have opened the table (created once, by whichever came first) before they race.
    ready = [tmp_path / f"out-{i}.json.ready" for i in range(len(runs))]
    wait_for(lambda: all(r.exists() for r in ready) or any(p.poll() is not None for p in procs), 120, "")
    assert all(r.exists() for r in ready), [p.poll() for p in procs]
    go.touch()
    assert [p.wait(300) for p in procs] == [0, 0, 0]
    outs = [json.loads((tmp_path / f"out-{i}.json").read_text()) for i in range(len(runs))]
    commits_a = check_lake(lake, node_dir, source="node-a")
    commits_b = check_lake(lake, node_dir, source="node-b")
    assert outs[0]["commits"] + outs[1]["commits"] == sum(1 for c in commits_a if c["adds"])
    assert outs[2]["commits"] == sum(1 for c in commits_b if c["adds"])
    assert sum(o["conflicts"] for o in outs) > 0, f"the processes raced for versions: {outs}"


def test_a_commit_lost_to_another_writer_of_the_same_records_is_neither_counted_nor_kept(tmp_path: Path) -> None:
    """Two writers land the same records as one source from the same mark; the second loses the race for the
    version. The mark it then reads is the one it wanted, yet the commit is the other's: it must not count it as
    its own (the racing test above once saw 55 commits counted for 54 in the log, after a
    lake_commit_error_after_landing warning), and its own files, named by no commit, are deleted. It answers
    False: the caller filters the batch again and finds nothing left to land."""
    from cdcd.lake.landing.arrow import build_table
    from cdcd.lake.landing.delta import ChangeTable

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=1, tx_per_segment=5)
    batch = wal_batch(node_dir, "node-a")
    slices = batch.peek_slices()
    rows, _ = build_table(slices, batch, "node-a", False)
    winner, loser = ChangeTable(lake, False), ChangeTable(lake, False)
    winner.open()
    loser.open()
    read_w, read_l = winner.mark("node-a"), loser.mark("node-a")
    files_w, files_l = winner.write_arrow(rows), loser.write_arrow(rows)
    paths_w, paths_l = [a.path for a in files_w.adds], [a.path for a in files_l.adds]
    where = {"source": "node-a", "generation": 0, "last": slices[-1].pointer, "first": slices[0].pointer}
    assert winner.commit(files_w, read=read_w, metadata={}, **where) is True
    assert loser.commit(files_l, read=read_l, metadata={}, **where) is False
    assert (winner.commits, loser.commits, loser.conflicts) == (1, 0, 1)
    live = pa.table(DeltaTable(str(lake / "changes")).get_add_actions(flatten=True)).column("path").to_pylist()
    assert sorted(live) == sorted(paths_w)
    assert not any((lake / "changes" / p).exists() for p in paths_l), "the loser's files are deleted"


# --- a reader polling while the daemon writes ----------------------------------------------------------
@pytest.mark.chaos  # tests/test_lake_faults.py reads the table at every SIGKILL point (only whole records, nothing
# twice) and tests/test_lake_cuts.py holds a compaction between its commits and reads there; this one polls at
# luck's moments
def test_reader_polling_never_sees_half_a_transaction(tmp_path: Path) -> None:
    """While a node writes transactions that span two caches and `cdcd run` lands them in small batches, a reader
    polling the table (delta-rs, latest snapshot each time) never sees part of a transaction: 100+ polls over 10+
    table versions; afterwards every version the log holds, read by time travel, has only whole transactions."""
    t0 = time.monotonic()
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    writer = start_writer(tmp_path, node_dir, count=300, pause_ms=50)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 60, "the node's cdc dir")
    config = write_config(
        tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=400, batch_max_delay_ms=50
    )
    err = tmp_path / "daemon.err"
    daemon = start_daemon(config, err)
    polls, versions = 0, set()
    seen: list[tuple[int, pa.Table]] = []  # checked once the WAL is complete: reading it per poll is slow
    try:
        wait_started(daemon, err)
        wait_for(lambda: (lake / "changes" / "_delta_log").is_dir(), 60, "the changes table")
        done_at: float | None = None
        while True:
            dt = DeltaTable(str(lake / "changes"))
            seen.append((dt.version(), dt.to_pyarrow_table(columns=["wal_segment", "wal_offset", "cache"])))
            polls += 1
            versions.add(dt.version())
            if writer.poll() is not None and done_at is None:
                done_at = time.monotonic()
            if done_at is not None:
                # On until the polls have crossed 10 versions (the daemon may still be landing the backlog), or a
                # minute after the writer ended: the assertion below then says how many they crossed.
                waited_s = time.monotonic() - done_at
                if polls >= 100 and waited_s > 2 and (len(versions) >= 10 or waited_s > 60):
                    break
            assert polls < 5000
            assert daemon.poll() is None, err.read_text()[-3000:]
            time.sleep(0.05)  # a reader's pace, not a wait for anything: polling flat out took a core from the daemon
    finally:
        writer.wait(120)
        rc = stop_daemon(daemon, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    # The polls must span many versions: each poll reads the growing table, so on a loaded machine
    # 100 of them cover fewer versions (19 of 65 in one loaded run); 10 still crosses many commits.
    last_version = DeltaTable(str(lake / "changes")).version()
    assert polls >= 100 and len(versions) >= min(10, last_version), (polls, len(versions), last_version)
    print(f"\n{polls} polls over {len(versions)} versions, {time.monotonic() - t0:.0f}s")
    events = wal_events(node_dir)
    sizes = record_sizes(events)
    caches_of: dict[tuple[int, int], set[str]] = {}
    for e in events:
        caches_of.setdefault((e["pos"][0], e["pos"][1]), set()).add(e["cache"])
    assert sum(1 for c in caches_of.values() if len(c) == 2) >= 100, "transactions span two caches"
    for k, (version, table) in enumerate(seen):
        check_whole_records(table, sizes, f"poll {k} (version {version})")
    last = DeltaTable(str(lake / "changes")).version()
    caches_per_version = []
    step = max(1, last // 30)
    for v in sorted({*range(1, last + 1, step), last}):
        t = lake_rows(lake, v)
        check_whole_records(t, sizes, f"version {v}")
        caches_per_version.append(len(set(t.column("cache").to_pylist())))
    assert max(caches_per_version) >= 2


# --- hand-over between the node's realtime worker and the daemon -------------------------------------------
def test_handover_between_node_and_daemon_lands_every_entry_once(tmp_path: Path) -> None:
    """With the lake sink on both sides of one lake (node: delta-rs writer, no JVM; daemon: Spark writer),
    `cdcd control realtime off` / `on` twice under load hands delivery between the node's realtime worker and the
    daemon: every WAL entry lands exactly once, each by the side whose share it is."""
    from tests.support.realtime import (
        DAEMON_SETTINGS,
        NODE_SETTINGS,
        Rig,
        StopRealtimeCdcRecord,
        expected_shares,
        markers,
    )

    lake = tmp_path / "lake"
    node_settings = {"realtime_cdc": True, "realtime_close_timeout_ms": 120_000, "realtime_batch_max_events": 5000}
    rig = Rig(tmp_path, **node_settings)
    lines = [
        f"{k} = {toml_value(v)}" for k, v in {"node_dir": str(rig.node_dir), **NODE_SETTINGS, **node_settings}.items()
    ]
    node_consumer = lake_consumer(lake, "deltalake")
    lines += ["[realtime_consumer]", *(f"{k} = {toml_value(v)}" for k, v in node_consumer.items())]
    rig.node_config.write_text("\n".join(lines) + "\n")
    rig.daemon_config = write_config(
        tmp_path / "cdcd-lake.toml", rig.node_dir, lake_consumer(lake, "spark"), **DAEMON_SETTINGS
    )
    pids: dict[str, int] = {}
    try:
        rig.node_runs += 1
        code = "import tests.support.realtime as t; t.node_main()"
        args = [str(rig.node_config), str(rig.ctl), "0", "100", "5", "0"]  # 5 tx (~250 entries) per 100 ms
        with rig.node_log.open("wb") as log:
            rig.node = subprocess.Popen(
                [sys.executable, "-c", code, *args], stdout=log, stderr=log, env=child_env(rig.plugins), cwd=ROOT
            )
        wait_for(lambda: rig.socket.exists() or rig.node.poll() is not None, 120, "the node's control socket")
        assert rig.node.poll() is None, rig.node_log.read_text()[-3000:]
        pids["node"] = rig.node.pid
        rig.daemon_runs += 1
        rig.daemon = start_daemon(rig.daemon_config, rig.daemon_err)
        wait_started(rig.daemon, rig.daemon_err)
        pids["daemon"] = rig.daemon.pid
        st = rig.wait_mode("on", "PASSIVE", timeout=120)
        assert st["delivering"] == "node"
        rig.go()
        for state in ("off", "on", "off", "on"):
            # Let each side land batches before the next switch (condition, not a fixed sleep).
            landed = len(delta_commits(lake)) if (lake / "changes" / "_delta_log").is_dir() else 0
            wait_for(lambda n=landed: len(delta_commits(lake)) >= n + 3, 120, "batches of the delivering side")
            assert rig.control("realtime", state).strip() in ("realtime: off", "realtime: on", "realtime: try_start")
            st = rig.wait_mode(state, "ACTIVE" if state == "off" else "PASSIVE", timeout=120)
            assert st["delivering"] == ("daemon" if state == "off" else "node")
        landed = len(delta_commits(lake))
        wait_for(lambda: len(delta_commits(lake)) >= landed + 3, 120, "batches of the node")
        rig.stop_node()
        assert rig.final_status()["realtime"]["mode"] == "on"
        assert rig.final_status()["realtime"]["stops"] == {"command": 2}
        rc = stop_daemon(rig.daemon, timeout=60)
        assert rc == 0, rig.daemon_err.read_text()[-3000:]
        rig.daemon = None
    finally:
        rig.close()

    expected = wal_events(rig.node_dir)
    commits = check_lake(lake, rig.node_dir, expected)
    node_exp, daemon_exp, intervals = expected_shares(rig.node_dir)
    stops = [rec.reason for _, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert stops == ["node_start_realtime_off", "command", "command"]
    assert len(intervals) == 3 and all(b is not None for _, b in intervals)
    writer_of: dict[Pos, int] = {}
    for c in commits:
        for a in c["adds"]:
            t = pq.read_table(lake / "changes" / a["path"], columns=["wal_segment", "wal_offset", "wal_index"])
            for p in zip(*(t.column(i).to_pylist() for i in range(3)), strict=True):
                writer_of[p] = c["cdcd"]["pid"]
    assert set(writer_of.values()) == {pids["node"], pids["daemon"]}
    by_node = sorted(p for p, pid in writer_of.items() if pid == pids["node"])
    by_daemon = sorted(p for p, pid in writer_of.items() if pid == pids["daemon"])
    assert by_node == [tuple(e["pos"]) for e in node_exp], "the node landed other entries than its share"
    assert by_daemon == [tuple(e["pos"]) for e in daemon_exp], "the daemon landed other than its share"
    assert len(daemon_exp) > 1000 and len(node_exp) > 1000, (len(node_exp), len(daemon_exp))


# --- stopping a Spark-writer daemon -----------------------------------------------------------------------
# SIGINT to a group holding a Spark JVM is also what tests/test_demo.py presses as Ctrl-C: here in make chaos only.
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.chaos)])
def test_spark_writer_daemon_stops_cleanly_on_a_signal_to_its_process_group(tmp_path: Path, signum: int) -> None:
    """SIGTERM (systemd signals every process of the unit) or SIGINT (Ctrl-C: the terminal's process group) to the
    process group of a `cdcd run` landing a backlog through Spark: exit 0, the log says "daemon_stopped", no
    traceback; the JVM's batch in flight is not cut short by the signal; a later run lands the rest exactly once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=16, tx_per_segment=50)
    config = write_config(
        tmp_path / "cdcd.toml", node_dir, lake_consumer(lake, "spark"), batch_max_events=3000, batch_max_delay_ms=50
    )
    err = tmp_path / "daemon.err"
    with err.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=child_env(),
            start_new_session=True,  # its own process group, as under a shell or systemd
        )
    try:
        wait_started(proc, err)
        wait_for(lambda: len(delta_commits(lake)) > 2 if (lake / "changes" / "_delta_log").is_dir() else False, 180, "")
        os.killpg(proc.pid, signum)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text and "Aborted" not in text and error_lines(text) == [], text[-3000:]
    events = [json.loads(line)["event"] for line in text.splitlines() if line.startswith("{")]
    assert "daemon_stopping" in events and events[-1] == "daemon_stopped", events[-5:]
    after = position(config)
    assert after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "stopped mid-backlog"
    landed = lake_rows(lake)
    expected = wal_events(node_dir)
    assert landed.num_rows == sum(1 for e in expected if tuple(e["pos"]) < after), "the state is where the lake ends"
    run_to_end(config, node_dir, tmp_path / "run-2.err")
    check_lake(lake, node_dir, expected)


def test_the_node_realtime_worker_defaults_to_the_jvm_free_writer() -> None:
    """A `[realtime_consumer]` lake table without `writer` writes with delta-rs and schedules no maintenance (no
    JVM in the node's process); the daemon's `[consumer]` defaults to Spark and compacts every 60 s and optimizes
    every 10 s; the kind's and the writer's pre-release names are read as the new ones (deprecated), others refused."""
    from cdcd.config import ConfigError
    from cdcd.sinks import load_consumer

    def writer(table: dict[str, Any], source: str) -> str:
        consumer = load_consumer(table, source).consumer
        assert isinstance(consumer, LakeConsumer)
        return consumer.options.writer

    assert writer({"kind": "lake", "lake_path": "/x"}, "realtime_consumer") == "deltalake"
    assert writer({"kind": "lake", "lake_path": "/x"}, "cdcd.toml: consumer") == "spark"
    # Read as lake and deltalake, with a warning, until 0.3.0 (tests/test_versions_and_config.py).
    assert writer({"kind": "spark", "lake_path": "/x", "writer": "arrow"}, "cdcd.toml: consumer") == "deltalake"
    with pytest.raises(ConfigError, match="key 'writer': Invalid enum value 'parquet'"):
        load_consumer({"kind": "lake", "lake_path": "/x", "writer": "parquet"}, "cdcd.toml: consumer")
    assert writer({"kind": "lake", "lake_path": "/x", "writer": "spark"}, "realtime_consumer") == "spark"

    def maintenance(table: dict[str, Any], source: str) -> tuple[float, float]:
        opts = load_consumer(table, source).consumer.options  # type: ignore[attr-defined]
        return opts.compact_interval_s, opts.optimize_interval_s

    assert maintenance({"kind": "lake", "lake_path": "/x"}, "cdcd.toml: consumer") == (20.0, 10.0)
    assert maintenance({"kind": "lake", "lake_path": "/x"}, "realtime_consumer") == (0.0, 0.0)
    assert maintenance({"kind": "lake", "lake_path": "/x", "compact_interval_s": 5}, "realtime_consumer") == (5.0, 0.0)


def test_a_table_that_would_expire_application_transactions_is_refused(tmp_path: Path) -> None:
    """Exactly once depends on every source's application transaction staying in the log: a changes table with
    `delta.setTransactionRetentionDuration` set is refused at start, naming the property."""
    lake = tmp_path / "lake"
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    sink.stop()
    DeltaTable(str(lake / "changes")).alter.set_table_properties(
        {"delta.setTransactionRetentionDuration": "interval 7 days"}, raise_if_not_exists=False
    )
    with pytest.raises(LakeWriteError, match="setTransactionRetentionDuration = interval 7 days would let"):
        LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE)).start()
