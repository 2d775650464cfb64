"""Realtime CDC under faults: SIGKILLed node and daemon, a daemon that is down, closing mid-handshake.

Same rig and reference as ``test_realtime.py``: a ``node_main`` node process with a JSON-lines
realtime consumer, a ``cdcd run`` daemon with its own JSON-lines file; the WAL's markers say
which side owns which entry, and each side's file (split into runs at its SIGKILLs) must be
exactly its share, every restarted run beginning at the position that side had committed.
"""

from __future__ import annotations

import itertools
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.control import request
from cdcd.daemon.config import load_daemon_config
from cdcd.daemon.ops import show_state
from cdcd.node import Node
from cdcd.wal.records import DataRecord, RealtimeCdcRecord, StopRealtimeCdcRecord, TryStartRealtimeCdcRecord
from cdcd.wal.segment import list_segments
from tests.support.ports import free_port
from tests.support.procs import log_events, wait_for
from tests.support.realtime import (
    Rig,
    as_pos,
    check_delivery,
    entries_in,
    markers,
    node_realtime_state,
    read_runs,
    rig_maker,
)
from tests.support.wal import archived_segments, cdc_links, wal_events, wal_records

SEED = 104


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


@pytest.mark.parametrize(
    "exact",
    [
        pytest.param(False, id="from_committed_record"),
        pytest.param(True, id="from_committed_entry"),
    ],
)
def test_node_sigkill_in_realtime_mode_restores_from_its_committed_position(rig_factory: Any, exact: bool) -> None:
    """A node SIGKILLed twice while it delivers in realtime restores from its committed position on restart (log
    line realtime_restored with a records count): nothing is lost and nothing is skipped; exact: only entries after
    the last commit are delivered again (otherwise: from the first entry of the committed record on)."""
    rng = random.Random(SEED)
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    restored = []
    for k in range(2):
        rig.wait_delivered("node", rng.randint(600, 1200))  # a random point of a run, each run over 500 events
        rig.kill_node()
        resume = rig.node_resumes[-1]
        assert resume is not None, "the killed node had realtime enabled with a committed position"
        rig.start_node(first_tx=100_000 * (k + 1), pause_ms=30)
        rig.wait_mode("on", "PASSIVE")
        # The node says ON as it opens; the read-back runs on its worker thread after that.
        wait_for(
            lambda: any(e["event"] == "realtime_restored" for e in log_events(rig.node_log)),
            60,
            "the restarted node's realtime_restored line",
        )
        st = rig.status()
        events = [e for e in rig.node_log_events() if e["event"] in ("realtime_restoring", "realtime_restored")]
        assert [e["event"] for e in events][-2:] == ["realtime_restoring", "realtime_restored"]
        assert events[-2]["position"] == f"{resume[0]}:{resume[1]}#{resume[2]}"
        assert isinstance(events[-1]["records"], int) and events[-1]["records"] >= 1
        assert st["realtime"]["restored_records"] == events[-1]["records"]
        restored.append(events[-1]["records"])
    rig.wait_delivered("node", 600)
    rig.stop_node()
    rig.stop_daemon()

    _, daemon_exp, intervals = check_delivery(rig, node_whole_record=not exact)
    assert len(intervals) == 1 and daemon_exp == [], "the daemon stayed PASSIVE: the node delivered everything"
    runs = read_runs(rig.node_out, rig.node_cuts)
    assert len(runs) == 3 and all(len(r) > 500 for r in runs)
    assert not any(
        isinstance(rec, StopRealtimeCdcRecord) and rec.reason != "node_start_realtime_off"
        for _, rec in markers(rig.node_dir)
    )


def test_daemon_sigkill_during_a_switch_completes_after_restart(rig_factory: Any) -> None:
    """SIGKILLing the daemon around `realtime on` (once frozen before it can see the TryStart record, then 5 ms and
    40 ms after the command), then restarting it: each switch completes, nothing is lost, and the daemon re-delivers
    only what it had not committed."""
    rig: Rig = rig_factory(realtime_cdc=False)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    seen = []
    for delay in (None, 0.005, 0.04):
        rig.wait_delivered("daemon", 600)
        assert rig.daemon is not None
        if delay is None:
            rig.daemon.send_signal(signal.SIGSTOP)  # killed for sure before it handles the TryStart
        assert request(rig.socket, {"cmd": "realtime", "state": "on"}) == {
            "ok": True,
            "realtime": "try_start",
            "consumer": "default",
        }
        if delay is not None:
            time.sleep(delay)  # where the kill lands (the fault under test), not a synchronisation
        rig.kill_daemon()
        seen.append((rig.status()["realtime"]["mode"], daemon_mode(rig)))
        rig.start_daemon()
        rig.wait_mode("on", "PASSIVE")
        rig.wait_delivered("node", 150)
        rig.switch_off()
    rig.wait_delivered("daemon", 600)
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()

    assert seen[0] == ("try_start", "ACTIVE"), seen
    node_exp, daemon_exp, intervals = check_delivery(rig)
    tries = [rec for _, rec in markers(rig.node_dir) if isinstance(rec, TryStartRealtimeCdcRecord)]
    assert len(tries) == 3 and len(intervals) == 4
    assert all(entries_in(daemon_exp, a, b) > 500 for a, b in intervals)
    assert all(entries_in(node_exp, b, a2) > 100 for (_, b), (a2, _) in itertools.pairwise(intervals))
    print(f"\nnode/daemon state at the kills: {seen}")


def daemon_mode(rig: Rig) -> str:
    """The (stopped) daemon's persisted mode."""
    return str(show_state(load_daemon_config(rig.daemon_config, environ={}))["mode"])


def test_on_while_the_daemon_is_down_overflows_and_falls_back(rig_factory: Any) -> None:
    """`realtime on` while the daemon is down (a `cdcd node run` node under load, small cdc_buffer_bytes): the buffer
    overflows, the node falls back (mode off, stop reason overflow), and the restarted daemon delivers from the Stop
    record; the node delivers nothing; nothing is lost."""
    rig: Rig = rig_factory(realtime_cdc=False, cdc_buffer_bytes=128 * 1024)
    rig.start_node_run(load_rate=4000)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 100)
    rig.stop_daemon()
    assert rig.control("realtime", "on").strip() == "realtime: try_start"
    # "ACTIVE": the stopped daemon's persisted mode (it never saw the TryStart).
    st = rig.wait_mode("off", "ACTIVE", timeout=20, stops={"overflow": 1})
    assert st["realtime"]["buffer_used_bytes"] == 0 and st["realtime"]["try_start"] is None
    assert (st["cdc_mode"], st["delivering"]) == ("DAEMON_ACTIVE", "daemon")
    rig.wait_written(1)  # more writes after the overflow, for the restarted daemon
    rig.start_daemon()
    rig.wait_delivered("daemon", 100)
    rig.stop_node_run()
    # `node run` leaves its last segment active: reopen the node to archive it (realtime stays off).
    node = Node.from_config_file(rig.node_config)
    try:
        assert node.realtime.mode.value == "off"
        node.force_archive()
    finally:
        node.close()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()

    node_exp, daemon_exp, intervals = check_delivery(rig)
    assert node_exp == [] and rig.node_out.read_bytes() == b"", "the node never delivered"
    stops = [(p, rec) for p, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert [s.reason for _, s in stops] == ["node_start_realtime_off", "overflow", "node_start_realtime_off"]
    ((ts_ptr, _ts),) = [(p, r) for p, r in markers(rig.node_dir) if isinstance(r, TryStartRealtimeCdcRecord)]
    assert as_pos(stops[1][1].last) == (ts_ptr.segment + 1, 0, 0), "the daemon goes on right after the TryStart"
    assert intervals == [((0, 0, 0), (ts_ptr.segment, ts_ptr.offset, 0)), ((ts_ptr.segment + 1, 0, 0), None)]
    assert entries_in(daemon_exp, *intervals[1]) > 1000


def test_pending_try_start_survives_a_node_sigkill(rig_factory: Any) -> None:
    """A node SIGKILLed while its try-start waits for a stopped daemon comes back still in try_start with the same
    TryStart pointer (and the records since it restored); once the daemon runs the switch completes and the node
    delivers everything from the TryStart on."""
    rig: Rig = rig_factory(realtime_cdc=False)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 100)
    rig.stop_daemon()
    assert rig.control("realtime", "on").strip() == "realtime: try_start"
    st = rig.wait_mode("try_start", None)
    try_start = st["realtime"]["try_start"]
    rig.wait_written(1)  # records after the TryStart, for the restore
    rig.kill_node()
    saved = node_realtime_state(rig.node_dir)
    assert not saved.enabled and str(saved.try_start) == try_start
    # No writes until the restore is done: it races with the archiving of the active segment (see
    # test_restore_while_the_active_segment_is_archived).
    rig.start_node(first_tx=100_000, pause_ms=30, go=False)
    st = rig.wait_mode("try_start", None)
    assert st["realtime"]["try_start"] == try_start
    events = rig.node_log_events()
    assert any(e["event"] == "realtime_try_start_resumed" and e["try_start"] == try_start for e in events)
    wait_for(lambda: rig.status()["realtime"]["restored_records"] > 0, 10, "the restore of the records since TryStart")
    restored = [e for e in rig.node_log_events() if e["event"] == "realtime_restored"]
    assert len(restored) == 1 and restored[0]["records"] == rig.status()["realtime"]["restored_records"]
    rig.go()
    rig.wait_written(1)
    assert rig.status()["realtime"]["mode"] == "try_start", "never delivers before the daemon passed the TryStart"
    assert rig.node_out.read_bytes() == b""
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.wait_delivered("node", 100)
    rig.stop_node()
    rig.stop_daemon()

    node_exp, _, intervals = check_delivery(rig)
    seg = int(try_start.split(":")[0])
    assert intervals[-1][1] == (seg, int(try_start.split(":")[1]), 0)
    assert node_exp[0]["pos"][0] == seg + 1
    before_kill = [e for e in node_exp if e["value"] is not None and e["value"]["n"] < 100_000]
    assert len(before_kill) > 500, "the node delivered (restored) what was written before the kill"


def test_restore_while_the_active_segment_is_archived(rig_factory: Any) -> None:
    """A node restarted in try_start with a long stretch to restore, writing at full speed at once, restores it while
    its active segment is rolled and archived underneath, and stays in try_start (no restore_failed stop)."""
    # Segments roll only when full; a small WAL buffer keeps the flusher close behind the writer.
    # A buffer that holds the whole restore even when a loaded machine delays delivery (an overflow
    # would stop realtime: another test's subject).
    rig: Rig = rig_factory(
        realtime_cdc=True, wal_force_archive_timeout_ms=0, wal_buffer_bytes=256 * 1024, cdc_buffer_bytes=512 << 20
    )
    rig.start_node(pause_ms=30, every=1)  # no daemon: the try-start waits
    rig.wait_mode("try_start", None)
    rig.burst()
    rig.wait_written(40)  # a few MiB to restore (64 KiB segments)
    rig.burst(False)  # one transaction per 30 ms: a segment lasts ~0.7 s

    def active_segment() -> tuple[int, int]:
        """(-1, 0) when there is none, or when it was archived between the listing and the stat (the node writes on)."""
        work = list_segments(rig.node_dir / "wal")[0]
        if not work:
            return (-1, 0)
        try:
            return (max(work), work[max(work)].stat().st_size)
        except FileNotFoundError:
            return (-1, 0)

    last: list[tuple[int, int]] = []

    def steady_and_partly_filled() -> bool:
        """The same partly filled segment as at the previous look, not shrunk (wait_for looks every 0.1 s)."""
        seg2, size2 = active_segment()
        seen, last[:] = last[:], [(seg2, size2)]
        return bool(seen) and seen[0][0] == seg2 and 4096 < seen[0][1] <= size2 < 48 * 1024

    wait_for(steady_and_partly_filled, 60, "a partly filled active segment, the flusher caught up")
    rig.kill_node()
    rig.start_node(first_tx=100_000, pause_ms=0)  # that segment fills (and is archived) in a few ms

    def this_run() -> list[dict[str, Any]]:
        """The restarted node's own log lines (the first run's would satisfy the waits below at once)."""
        return log_events(rig.tmp / f"node-{rig.node_runs}.log")

    wait_for(lambda: any(e["event"] == "node_opened" for e in this_run()), 60, "the restarted node's node_opened")
    opened = next(e for e in this_run() if e["event"] == "node_opened")
    assert not opened["wal_position"].endswith(":0"), f"precondition: reopened inside a segment, {opened}"
    wait_for(
        lambda: any(e["event"] in ("realtime_restored", "realtime_restore_failed") for e in this_run()),
        60,
        "the end of the restore",
    )
    failed = [e["error"] for e in this_run() if e["event"] == "realtime_restore_failed"]
    st = rig.status()["realtime"]
    assert failed == [] and st["mode"] == "try_start" and st["stops"] == {}, (failed, st)


def test_close_with_realtime_on_drains_the_buffer(rig_factory: Any, tmp_path: Path) -> None:
    """Node.close() with realtime on and a backlog in the buffer (a slow consumer) delivers all of it, commits the end
    in the metastorage and a RealtimeCdcRecord; the daemon stays PASSIVE and delivers nothing."""
    consumer = {
        "kind": "python",
        "class": "rt_plugins:Slow",
        "options": {"path": str(tmp_path / "node.jsonl"), "delay_ms": 15},
    }
    rig: Rig = rig_factory(realtime_cdc=True, consumer=consumer, realtime_batch_max_events=100)
    rig.start_node(pause_ms=30, go=False)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.go()
    # A backlog builds up behind the slow consumer, after over 5000 events were delivered (how many the writer
    # wrote by the time the backlog formed depends on the machine's speed): close() has something to drain.
    wait_for(
        lambda: rig.delivered("node") > 5000 and rig.status()["realtime"]["buffer_used_bytes"] > 100_000,
        120,
        "5000 events delivered and a realtime backlog",
    )
    rig.stop_node()
    final = rig.final_status()  # just before close()
    assert final["realtime"]["mode"] == "on"
    assert final["realtime"]["buffer_used_bytes"] > 50_000, "a backlog was left for close() to drain"
    rig.stop_daemon()

    node_exp, daemon_exp, _ = check_delivery(rig)
    assert daemon_exp == [] and len(node_exp) > 5000
    last = tuple(node_exp[-1]["pos"])
    state = node_realtime_state(rig.node_dir)
    assert state.enabled and state.position is not None
    assert as_pos(state.position) > last, "close() committed everything it delivered"
    last_marker = markers(rig.node_dir)[-1][1]
    assert isinstance(last_marker, RealtimeCdcRecord) and last_marker.last == state.position
    assert not any(e["event"] == "realtime_close_timeout" for e in rig.node_log_events())


def test_close_timeout_leaves_realtime_off(rig_factory: Any, tmp_path: Path) -> None:
    """When close() gives up on a busy realtime consumer (realtime_close_timeout_ms) it leaves realtime off for good:
    Stop(close_timeout) is the node's last word in the WAL, the metastorage says disabled, and the restarted node does
    not deliver in realtime while the daemon (ACTIVE since the Stop) does; nothing is lost."""
    consumer = {
        "kind": "python",
        "class": "rt_plugins:Busy",
        "options": {"path": str(tmp_path / "node.jsonl"), "delay_ms": 1500},
    }
    rig: Rig = rig_factory(
        realtime_cdc=False, consumer=consumer, realtime_close_timeout_ms=300, realtime_batch_max_events=100
    )
    # The daemon delivers first, so the caches exist before the hand-over (no CacheRecord while it is PASSIVE:
    # see test_cache_created_while_passive_keeps_the_links_the_node_needs).
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 100)
    rig.switch_on()
    rig.wait_batch_started(0)  # the consumer is inside its first batch (1.5 s)
    rig.stop_node()
    assert any(e["event"] == "realtime_close_timeout" for e in rig.node_log_events())
    stop_at = [
        p for p, r in markers(rig.node_dir) if isinstance(r, StopRealtimeCdcRecord) and r.reason == "close_timeout"
    ]
    assert len(stop_at) == 1
    after = [r for p, r in markers(rig.node_dir) if p > stop_at[0]]
    state = node_realtime_state(rig.node_dir)
    problems = []
    if after:
        problems.append(f"markers after Stop(close_timeout): {after}")
    if state.enabled:
        problems.append(f"metastorage after close: {state}")

    # Restart (realtime_cdc off in the config now): the saved state decides.
    rig.write_node_config(consumer, realtime_cdc=False, realtime_close_timeout_ms=300)
    size = rig.node_out.stat().st_size
    rig.start_node(first_tx=100_000, pause_ms=30)
    rig.wait_written(1)
    st = rig.status()
    if st["realtime"]["mode"] != "off" or st["daemon"]["mode"] != "ACTIVE":
        problems.append(f"after restart: node realtime {st['realtime']['mode']}, daemon {st['daemon']['mode']}")
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    if rig.node_out.stat().st_size != size:
        problems.append("the restarted node delivered in realtime while the daemon was ACTIVE")
    assert not problems, problems
    # Nothing lost: together the two files cover the WAL.
    got = {tuple(e["pos"]) for path in (rig.node_out, rig.daemon_out) for e in read_runs(path, [])[0]}
    assert got == {tuple(e["pos"]) for e in wal_events(rig.node_dir)}


def test_a_consumer_call_that_outlives_the_close_is_left_running_not_stopped_under_it(
    rig_factory: Any, tmp_path: Path
) -> None:
    """A consumer call still running after ``realtime_close_timeout_ms`` and its interrupt: the node does not stop the
    consumer under it (a native writer's buffers freed mid-call crashed the process), says so in one line, writes
    Stop(close_timeout) and exits 0; the daemon delivers that batch and everything after it."""
    consumer = {
        "kind": "python",
        "class": "rt_plugins:GatedWatchingStop",
        "options": {"path": str(tmp_path / "node.jsonl"), "gate": str(tmp_path / "never")},
    }
    rig: Rig = rig_factory(
        realtime_cdc=False, consumer=consumer, realtime_close_timeout_ms=300, realtime_batch_max_events=100
    )
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 100)
    rig.switch_on()
    rig.wait_batch_started(0)  # held for good: the gate never opens
    rig.stop_node()
    events = [e["event"] for e in rig.node_log_events()]
    assert "realtime_close_timeout" in events and "realtime_consumer_left_running" in events, events
    assert not (tmp_path / "node.jsonl.stopped_in_call").exists()
    assert any(isinstance(r, StopRealtimeCdcRecord) and r.reason == "close_timeout" for _p, r in markers(rig.node_dir))
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    got = {tuple(e["pos"]) for e in read_runs(rig.daemon_out, [])[0]}
    assert got == {tuple(e["pos"]) for e in wal_events(rig.node_dir)}


def test_cache_created_while_passive_keeps_the_links_the_node_needs(rig_factory: Any, tmp_path: Path) -> None:
    """Caches created (in segment 2) while the daemon is PASSIVE and the node's realtime consumer still works on its
    first batch (segment 1) do not make the daemon delete link 1: when that batch fails, the daemon delivers from the
    Stop record's position 1:0#0 (nothing lost, nothing twice)."""
    trigger = tmp_path / "fail.trigger"
    consumer = {
        "kind": "python",
        "class": "rt_plugins:FailOnTrigger",
        "options": {"path": str(tmp_path / "node.jsonl"), "trigger": str(trigger), "delay_ms": 1000},
    }
    rig: Rig = rig_factory(realtime_cdc=True, consumer=consumer)
    (rig.ctl / "warmup").touch()  # one entry in segment 1, then orders/users/events are created in segment 2
    rig.start_node(pause_ms=30, go=False)
    rig.start_daemon()
    st = rig.wait_mode("on", "PASSIVE")
    assert st["realtime"]["committed"] == "1:0#0"
    trigger.touch()
    rig.go()
    # The first batch (the warmup entry) fails after 1 s: Stop(last = 1:0#0).
    rig.wait_mode("off", "ACTIVE", stops={"consumer_error": 1})
    rig.wait_delivered("daemon", 1100)
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    stops = [r for _, r in markers(rig.node_dir) if isinstance(r, StopRealtimeCdcRecord)]
    assert [(s.reason, as_pos(s.last) if s.last else None) for s in stops] == [
        ("node_start_realtime_off", None),
        ("consumer_error", (1, 0, 0)),
    ]
    node_exp, daemon_exp, _ = check_delivery(rig)
    assert node_exp == [] and rig.node_out.read_bytes() == b""
    assert daemon_exp[0]["cache"] == "warmup" and len(daemon_exp) > 1000


def test_close_with_pending_try_start_lets_the_daemon_deliver(rig_factory: Any) -> None:
    """Node.close() while a try-start waits writes StopRealtimeCdcRecord(last = right after the TryStart) and clears
    the pending try-start, so the daemon, started later, delivers everything the node wrote while it was closed."""
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=30)  # no daemon: the try-start cannot complete
    st = rig.wait_mode("try_start", None)
    ts = st["realtime"]["try_start"]
    rig.wait_written(1)
    rig.stop_node()  # force_archive(), then close()
    ((ts_ptr, _),) = [(p, r) for p, r in markers(rig.node_dir) if isinstance(r, TryStartRealtimeCdcRecord)]
    assert str(ts_ptr) == ts
    stop_ptr, stop = markers(rig.node_dir)[-1]
    assert isinstance(stop, StopRealtimeCdcRecord) and stop.reason == "close_during_try_start"
    assert as_pos(stop.last) == (ts_ptr.segment + 1, 0, 0)
    state = node_realtime_state(rig.node_dir)
    assert not state.enabled and state.try_start is None and as_pos(state.position) == (ts_ptr.segment + 1, 0, 0)
    assert rig.node_out.read_bytes() == b""
    data_segments = {p.segment for p, r in wal_records(rig.node_dir) if isinstance(r, DataRecord)}
    assert max(data_segments) <= max(archived_segments(rig.node_dir)), "every data entry is archived"

    rig.start_daemon()
    rig.wait_daemon_caught_up(timeout=10)  # fails today: the daemon waits PASSIVE, at segment ts+1
    rig.stop_daemon()
    node_exp, daemon_exp, _ = check_delivery(rig)
    assert node_exp == [] and len(daemon_exp) > 1000
    assert stop_ptr.segment in archived_segments(rig.node_dir)


def test_stop_record_written_at_restart_reaches_the_daemon(rig_factory: Any) -> None:
    """A node restarted without its realtime consumer (after delivering in realtime) writes a Stop record that the
    PASSIVE daemon sees within the force-archive timeout, so it takes over delivering the node's new writes."""
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.wait_delivered("node", 100)
    rig.stop_node()  # force_archive(), then close() writes a Checkpoint and a RealtimeCdcRecord: a non-empty segment
    assert cdc_links(rig.node_dir) == {} or min(cdc_links(rig.node_dir)) >= 1
    rig.write_node_config(consumer={}, realtime_cdc=False)  # the operator turns realtime CDC off
    rig.start_node(first_tx=100_000, count=5)  # a few writes, then idle
    wait_for(lambda: (rig.ctl / "written").exists(), 10, "the writes")
    rig.wait_mode("off", "ACTIVE", timeout=5)  # fails today: the daemon stays PASSIVE
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    _, daemon_exp, _ = check_delivery(rig)
    assert sum(1 for e in daemon_exp if e["value"] is not None and e["value"]["n"] >= 100_000) > 0
    assert wal_events(rig.node_dir)[-1] == daemon_exp[-1]


def test_close_interrupts_a_realtime_consumer_retrying_a_dead_target(rig_factory: Any, tmp_path: Path) -> None:
    """A node whose realtime replication consumer retries a dead target (retry_timeout_s 120) closes
    within seconds: after realtime_close_timeout_ms, close() interrupts the retries, writes
    Stop(close_timeout), and the daemon then delivers what the node could not."""
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123")
    token.chmod(0o600)
    dead_port = free_port()  # reserved: nobody listens on it
    consumer = {
        "kind": "replication",
        "target": f"127.0.0.1:{dead_port}",
        "token_file": str(token),
        "retry_timeout_s": 120,
    }
    rig: Rig = rig_factory(realtime_cdc=False, consumer=consumer, realtime_close_timeout_ms=300)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 100)
    rig.switch_on()
    wait_for(
        lambda: any(e["event"] == "consumer_retrying" for e in log_events(rig.node_log)),
        60,
        "the consumer retrying its first batch",
    )
    t0 = time.monotonic()
    rig.stop_node()
    took = time.monotonic() - t0
    events = [e["event"] for e in rig.node_log_events()]
    assert "consumer_retrying" in events and "realtime_close_timeout" in events
    assert took < 15, f"close took {took:.1f} s"
    assert [r.reason for _p, r in markers(rig.node_dir) if isinstance(r, StopRealtimeCdcRecord)][-1] == "close_timeout"
