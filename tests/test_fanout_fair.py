"""A consumer catching up must not hold back the live ones (issue 45's goal; ``catchup_max_share``).

Real processes: writer nodes and a ``cdcd run`` daemon of two consumers of ``tests.support.gil_hog:GilHog`` (a
jsonl file whose consumer holds the GIL a fixed time per event, as a sink busy in Python does): ``live``, added
with ``start = "now"``, follows a live writer; ``late`` catches up over a backlog written before. Both hold the
GIL in their own calls, ``late`` in longer pieces (as a C extension's call does): run flat out, it leaves ``live``
too little of the process to keep up with the writer, and ``live`` falls seconds behind. With ``late`` working at
most ``catchup_max_share`` of the time while ``live`` is at the head, ``live`` keeps up.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from cdcd.config import ConfigError
from cdcd.daemon.config import lane_policy, load_daemon_config
from cdcd.sinks import load_consumer
from tests.support.fanout import SLOW_CALLS, fanout_config, newest_commit_ns
from tests.support.procs import child_env, log_events, start_daemon, state_show, stop_daemon, wait_for
from tests.support.wal import archived_segments, read_jsonl, wal_events
from tests.support.writer import start_writer

BACKLOG_TX = 3600
"""Transactions of about 50 entries written before the daemon starts: ``late``'s backlog, long enough that ``late``
catching up flat out leaves ``live`` far further behind than the bound (over twice as far), however busy the cores."""
WRITER_PAUSE_MS = 500
"""The live writer's pause after every 10 transactions: about 1,000 entries/s."""
BATCH_MAX_EVENTS = 1000
LATE_HOLD_US, LATE_PIECE_US = 100, 20_000
"""``late``: 0.1 s of GIL per full batch, in calls of 20 ms."""
LIVE_HOLD_US, LIVE_PIECE_US = 550, 1000
"""``live``: at the writer's rate, about 40% of the time, in calls of 1 ms."""
SHARE = 0.5
SLACK_S = 5.0
"""For what the daemon does besides the consumer calls, on a machine whose cores are busy (the suite runs three
test processes on two cores)."""


def test_a_consumer_catching_up_holds_the_live_one_back_at_most_its_share(tmp_path: Path) -> None:
    """While ``late`` catches up, ``live``'s lag (now minus the commit time of the newest entry it wrote) stays
    under a bound from the config: the writer's pause, plus ``late``'s longest step (a full batch's hold) and the
    pause after it (``(1 - share) / share`` of it), plus SLACK_S. ``late`` logged that it was throttled;
    ``late``'s file is the whole WAL and ``live``'s the WAL from its start, each exactly once and in order."""
    node_dir = tmp_path / "node"
    live, late = tmp_path / "live.jsonl", tmp_path / "late.jsonl"
    (tmp_path / "backlog").mkdir()
    backlog = start_writer(tmp_path / "backlog", node_dir, count=BACKLOG_TX)
    assert backlog.wait(300) == 0, (tmp_path / "backlog" / "writer.log").read_text()[-3000:]
    first_live = max(archived_segments(node_dir)) + 1
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "late": {
                "kind": "python",
                "class": "tests.support.gil_hog:GilHog",
                "options": {"path": str(late), "hold_us_per_event": LATE_HOLD_US, "piece_us": LATE_PIECE_US},
                "catchup_max_share": SHARE,
            },
            "live": {
                "kind": "python",
                "class": "tests.support.gil_hog:GilHog",
                "options": {"path": str(live), "hold_us_per_event": LIVE_HOLD_US, "piece_us": LIVE_PIECE_US},
                "start": "now",
            },
        },
        batch_max_events=BATCH_MAX_EVENTS,
    )
    step_s = BATCH_MAX_EVENTS * LATE_HOLD_US / 1e6
    bound_s = WRITER_PAUSE_MS / 1000 + step_s / SHARE + SLACK_S
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=child_env())
    writer = None
    lags: list[float] = []
    try:
        wait_for(lambda: any(e.get("event") == "daemon_started" for e in log_events(err)), 60, "the daemon")
        writer = start_writer(tmp_path, node_dir, count=0, pause_ms=WRITER_PAUSE_MS, key_base=10_000)
        wait_for(lambda: newest_commit_ns(live) > 0, 60, "a first delivery to live")
        began_ns = time.time_ns()

        def caught_up() -> bool:
            lags.append((time.time_ns() - newest_commit_ns(live)) / 1e9)
            assert proc.poll() is None, err.read_text()[-3000:]
            return newest_commit_ns(late) > began_ns

        wait_for(caught_up, 600, "late to catch up with the live writer")
        took_s = (time.time_ns() - began_ns) / 1e9
    finally:
        if writer is not None:
            (tmp_path / "writer.stop").touch()
            assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(
            lambda: {tuple(c["position_parts"] or ()) for c in state_show(config)["consumers"].values()} == {end},
            120,
            "both at the end",
        )
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    print(f"live's lag while late caught up ({took_s:.1f} s): max {max(lags):.2f} s (bound {bound_s:.2f} s)")
    assert max(lags) <= bound_s, f"live fell {max(lags):.2f} s behind while late caught up (bound {bound_s:.2f} s)"
    switched = [e["event"] for e in log_events(err) if e.get("consumer") == "late" and "catchup" in e["event"]]
    assert switched[:1] == ["consumer_catchup_throttled"], switched
    expected = wal_events(node_dir)
    assert read_jsonl(late) == expected
    assert read_jsonl(live) == [e for e in expected if e["pos"][0] >= first_live]


SLOW_CALL_S = 1.5
"""Each call of the slow consumer: a sleep, so its pace does not depend on how busy the cores are."""
SLOW_CALLS_SEEN = 16


def test_a_live_consumer_slower_than_the_writes_takes_what_came_meanwhile_in_one_batch(tmp_path: Path) -> None:
    """A live consumer whose calls take longer than the node takes to fill a segment: the batch that is due while
    it is in a call stays open until it asks for the next, so each call takes what came during the one before
    and an event waits about one call before its own begins: the waits do not grow from call to call (they stay
    within three calls of the shortest, whatever a busy machine adds to reading every one of them). Batches cut at
    every segment queued up behind such a consumer instead (two queued, one more waiting to be): 3 s at the
    third call, 1.5 s more at each one after. The file is the whole WAL from its start, once and in order."""
    (tmp_path / "slowsink.py").write_text(SLOW_CALLS)
    node_dir = tmp_path / "node"
    out, calls = tmp_path / "slow.jsonl", tmp_path / "calls.jsonl"
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "slow": {
                "kind": "python",
                "class": "slowsink:SlowCalls",
                "options": {"path": str(out), "calls": str(calls), "call_s": SLOW_CALL_S},
            }
        },
        batch_max_events=1_000_000,
        batch_max_bytes=256 << 20,
        read_chunk_records=1024,
    )
    # About 2,500 entries/s at most, segments of 64 KiB: a few segments a call, little to read and decode
    # beside the calls (the daemon keeps up with the writer on busy cores).
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=200)
    err = tmp_path / "daemon.err"
    proc = None

    def seen() -> list[dict[str, int]]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    try:
        wait_for(lambda: (node_dir / "cdc").is_dir(), 60, "the node")
        proc = start_daemon(config, err, env=child_env(tmp_path))
        wait_for(lambda: len(seen()) >= SLOW_CALLS_SEEN, 120, f"{SLOW_CALLS_SEEN} calls of the slow consumer")
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: tuple(state_show(config)["consumers"]["slow"]["position_parts"] or ()) == end, 120, "the end")
    finally:
        assert proc is not None and stop_daemon(proc) == 0, err.read_text()[-3000:]
    # From the fifth call on: the first ones take what was there when the daemon started, and until the lane
    # knows how long its calls take it holds a batch only briefly (``Lane._holds``).
    waits = [(c["began_ns"] - c["first_ns"]) / 1e9 for c in seen()[4:SLOW_CALLS_SEEN]]
    print(f"waits before each call: {[round(w, 2) for w in waits]} s")
    # The spread, not the level: on busy cores reading and archiving add to every wait alike (a CI run saw 3.1-5.9 s);
    # queued batches add a call's length to each wait after the one before.
    # Queued, the twelve waits from the fifth call would spread over eleven calls; here they stay within three.
    spread_s, bound_s = max(waits) - min(waits), 3 * SLOW_CALL_S
    assert spread_s <= bound_s, f"the waits grew by {spread_s:.2f} s over {len(waits)} calls (bound {bound_s:.2f} s)"
    assert read_jsonl(out) == wal_events(node_dir)


@pytest.mark.parametrize(
    ("top", "table", "message"),
    [
        ("", "catchup_max_share = 0", "consumers.x: key 'catchup_max_share': 0: must be a number > 0 and <= 1"),
        ("", "catchup_max_share = 1.5", "key 'catchup_max_share': 1.5: must be a number > 0 and <= 1"),
        ("", 'catchup_max_share = "half"', "key 'catchup_max_share': 'half': must be a number > 0 and <= 1"),
        ("", "catchup_max_shares = 0.5", "did you mean 'catchup_max_share'?"),
        ("catchup_max_share = 0.0\n", "", "bad.toml: key 'catchup_max_share': out of range: 0.0"),
    ],
)
def test_catchup_max_share_errors_name_the_key(tmp_path: Path, top: str, table: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'node_dir = "{tmp_path}"\n{top}[consumers.x]\nkind = "null"\n{table}\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = load_daemon_config(path, environ={})
        load_consumer(config.named_consumers()["x"], "consumers.x")  # a consumer table's unknown keys: here


def test_catchup_max_share_per_consumer_over_the_daemons(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text(
        f'node_dir = "{tmp_path}"\ncatchup_max_share = 0.25\n[consumers.a]\nkind = "null"\n'
        '[consumers.b]\nkind = "null"\ncatchup_max_share = 1.0\n'
    )
    config = load_daemon_config(path, environ={})
    tables = config.named_consumers()
    assert lane_policy(tables["a"], "a", config.catchup_max_share).catchup_max_share == 0.25
    assert lane_policy(tables["b"], "b", config.catchup_max_share).catchup_max_share == 1.0
