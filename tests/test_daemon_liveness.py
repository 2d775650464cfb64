"""A hung or dead consumer is visible and ends the daemon (issue 13 item 4), asserted on real scrapes.

A real ``cdcd run`` process with a python consumer from a module written by the test; a node writes
in another process (or in this one). Metric values are checked exactly, the way Ignite's CDC tests
call ``checkMetrics``: lag against the commit time of the oldest entry not yet confirmed, pending
links against the CDC dir's listing, histogram counts against the events handed over.
"""

from __future__ import annotations

import json
import re
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

from cdcd.node import Node
from tests.support.chaos import scrape
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import (
    child_env,
    error_lines,
    reap,
    run_daemon_until_exit,
    start_daemon,
    state_position,
    stop_daemon,
    wait_for,
)
from tests.support.wal import cdc_links, jsonl_lines, wal_events
from tests.support.writer import make_node, start_writer, tx_writes

CONSUMERS = textwrap.dedent(
    '''
    """Test consumers for `kind = "python"`."""
    import json
    import os
    import time

    from cdcd.consumer import Consumer


    class Blocked(Consumer):
        """Writes ``dir/entered.json`` (events, first commit time) on its first on_events, then never returns."""

        def __init__(self, dir):
            self.dir = dir

        def on_events(self, batch):
            first = next(iter(batch))
            tmp = os.path.join(self.dir, "entered.tmp")
            with open(tmp, "w") as f:
                json.dump({"events": len(batch), "first_ts_ns": first.commit_ts_ns, "first": str(first.position)}, f)
            os.replace(tmp, os.path.join(self.dir, "entered.json"))
            while True:
                time.sleep(3600)


    class DiesWhenIdle(Consumer):
        """Confirms every batch (counting events in ``dir/events``); alive() is False once ``dir/dead`` exists."""

        def __init__(self, dir):
            self.dir, self.events = dir, 0

        def on_events(self, batch):
            self.events += len(batch)
            tmp = os.path.join(self.dir, "events.tmp")
            with open(tmp, "w") as f:
                f.write(str(self.events))
            os.replace(tmp, os.path.join(self.dir, "events"))
            return True

        def alive(self):
            return not os.path.exists(os.path.join(self.dir, "dead"))
    '''
)


def python_consumer(tmp_path: Path, cls: str, **options: Any) -> tuple[dict[str, Any], dict[str, str]]:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "liveness_sinks.py").write_text(CONSUMERS)
    return {"kind": "python", "class": f"liveness_sinks:{cls}", "options": options}, child_env(mods)


def try_scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    try:
        return scrape(port, timeout=10)
    except OSError:
        return None


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    matching = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == x for k, x in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def pending_links(node_dir: Path, position: tuple[int, int, int] | None) -> int:
    """Links not wholly consumed: every link from the committed position's segment on."""
    return sum(1 for seg in cdc_links(node_dir) if position is None or seg >= position[0])


def timed_scrape(port: int) -> tuple[float, dict[str, list[tuple[dict[str, str], float]]], float]:
    before = time.time()
    samples = scrape(port, timeout=10)
    return before, samples, time.time()


def test_hung_consumer_lag_grows_pending_links_counted_then_stall_exits_6(tmp_path: Path) -> None:
    """With the consumer blocked in on_events while a node writes: the daemon's lag is now - commit time of the
    first event of the blocked batch (and grows), segments_pending equals the links from the committed position
    on, the capture histogram counted exactly the blocked batch. With consumer_stall_timeout_ms = 1000 the daemon
    then exits 6 with one line naming the stalled call and the pending links, committing nothing."""
    node_dir = tmp_path / "node"
    writer = start_writer(tmp_path, node_dir)
    try:
        wait_for(lambda: (node_dir / "cdc").is_dir(), 60, "the writer's node")
        port = free_port()
        consumer, env = python_consumer(tmp_path, "Blocked", dir=str(tmp_path))
        config = write_daemon_config(
            tmp_path / "cdcd.toml",
            node_dir,
            consumer,
            metrics_address=f"127.0.0.1:{port}",
            consumer_stall_timeout_ms=600_000,
        )
        err = tmp_path / "run1.err"
        proc = start_daemon(config, err, env=env)
        try:
            entered = wait_for(
                lambda: (tmp_path / "entered.json").exists() and json.loads((tmp_path / "entered.json").read_text()),
                60,
                "the consumer's first on_events",
            )
            first_s = entered["first_ts_ns"] / 1e9
            t0, s1, t1 = timed_scrape(port)
            lag1 = value(s1, "cdcd_daemon_lag_seconds")
            assert t0 - first_s - 1e-3 <= lag1 <= t1 - first_s + 1e-3, (t0 - first_s, lag1, t1 - first_s)
            assert value(s1, "cdcd_daemon_event_capture_seconds_count") == entered["events"]
            # Segments wholly committed before the blocked batch count as consumed (a segment of node records
            # without entries, archived while a loaded writer had not written yet); nothing after them.
            committed = state_position(config)
            assert value(s1, "cdcd_daemon_segment_consuming_seconds_count") == (committed[0] if committed else 0)
            assert total(s1, "cdcd_daemon_events_total") == 0

            # The node goes on writing: links pile up behind the blocked batch.
            start_links = len(cdc_links(node_dir))
            wait_for(lambda: len(cdc_links(node_dir)) >= start_links + 5, 120, "five more links")
            (tmp_path / "writer.stop").touch()
            assert writer.wait(120) == 0
            position = state_position(config)
            expected_pending = pending_links(node_dir, position)
            assert expected_pending >= 5
            t0, s2, t1 = timed_scrape(port)
            lag2 = value(s2, "cdcd_daemon_lag_seconds")
            assert t0 - first_s - 1e-3 <= lag2 <= t1 - first_s + 1e-3, (t0 - first_s, lag2, t1 - first_s)
            assert lag2 > lag1
            assert value(s2, "cdcd_daemon_segments_pending") == expected_pending
            assert value(s2, "cdcd_daemon_event_capture_seconds_count") == entered["events"]
            assert proc.poll() is None, "the daemon ended although the stall timeout is 600 s"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

        # Again with a short stall timeout: the same batch blocks, and the daemon gives up on it.
        (tmp_path / "entered.json").unlink()
        write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, consumer_stall_timeout_ms=1000)
        err = tmp_path / "run2.err"
        assert run_daemon_until_exit(config, err, timeout=120, env=env) == 6
        lines = error_lines(err)
        assert len(lines) == 1, err.read_text()[-3000:]
        entered2 = json.loads((tmp_path / "entered.json").read_text())
        # The unconfirmed batch came again from its first event (its size depends on what was
        # readable when it was cut, which differs between the two runs).
        assert (entered2["first"], entered2["first_ts_ns"]) == (entered["first"], entered["first_ts_ns"])
        match = re.fullmatch(
            r"cdcd: error: pipeline stalled: consumer on_events\(\) with (\d+) events from (\S+) has not returned "
            r"for ([\d.]+) s \(consumer_stall_timeout_ms = 1000, consumer\); (\d+) segment link\(s\) pending",
            lines[0],
        )
        assert match, lines[0]
        assert int(match[1]) == entered2["events"] and match[2] == entered["first"]
        assert float(match[3]) >= 1.0
        assert int(match[4]) == expected_pending
        assert state_position(config) == position, "nothing may be committed past the stalled batch"
    finally:
        (tmp_path / "writer.stop").touch()
        if writer.poll() is None:
            writer.kill()
        writer.wait()


def test_idle_daemon_polls_alive_and_exits_4_when_it_turns_false(tmp_path: Path) -> None:
    """A caught-up daemon with nothing to deliver still calls alive() on every poll (IGNITE-18249): a consumer that
    reports itself dead while idle ends the daemon with exit 4 and one line saying so."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=2)
    expected = len(wal_events(node_dir))
    consumer, env = python_consumer(tmp_path, "DiesWhenIdle", dir=str(tmp_path))
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)
    try:
        events = tmp_path / "events"
        wait_for(lambda: events.exists() and int(events.read_text()) == expected, 60, "every event delivered")
        assert proc.poll() is None
        (tmp_path / "dead").touch()
        assert proc.wait(60) == 4
    finally:
        reap(proc)
    assert error_lines(err) == ["cdcd: error: consumer reports alive() == False"]


def test_metrics_after_catch_up_and_while_waiting_for_a_segment_roll(tmp_path: Path) -> None:
    """Caught up: lag 0, segments_pending = the links left, the capture histogram counted every event delivered and
    the segment histogram every segment consumed past (= links deleted). A commit that sits in the node's active
    segment (no roll yet) makes the lag now - its commit time; once the segment rolls and is delivered, lag is 0."""
    node_dir = tmp_path / "node"
    settings = {"wal_force_archive_timeout_ms": 0, "wal_segment_size_bytes": 1 << 20, "wal_mode": "fsync"}
    make_node(node_dir, segments=3, tx_per_segment=5, **settings)
    expected = len(wal_events(node_dir))
    out = tmp_path / "events.jsonl"
    port = free_port()
    config = write_daemon_config(
        tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), metrics_address=f"127.0.0.1:{port}"
    )
    node = Node.open(node_dir, **settings)  # realtime off: its start record makes the daemon ACTIVE
    proc = start_daemon(config, tmp_path / "run.err")
    try:
        wait_for(lambda: jsonl_lines(out) == expected, 60, "the backlog delivered")
        s = wait_for(
            lambda: (m := try_scrape(port)) and value(m, "cdcd_daemon_links_deleted_total") >= 3 and m, 60, "commits"
        )
        assert value(s, "cdcd_daemon_lag_seconds") == 0
        assert value(s, "cdcd_daemon_segments_pending") == pending_links(node_dir, state_position(config))
        assert value(s, "cdcd_daemon_event_capture_seconds_count") == expected
        assert total(s, "cdcd_daemon_events_total") == expected
        assert value(s, "cdcd_daemon_segment_consuming_seconds_count") == value(s, "cdcd_daemon_links_deleted_total")

        before_ns = time.time_ns()
        with node.transaction() as tx:
            for cache, key, val in tx_writes(1000):
                if val is not None:
                    tx.put(cache, key, val)
        after_ns = time.time_ns()
        wait_for(
            lambda: value(scrape(port, timeout=10), "cdcd_daemon_lag_seconds") > 0, 60, "lag from the active segment"
        )
        t0, s, t1 = timed_scrape(port)
        lag = value(s, "cdcd_daemon_lag_seconds")
        assert t0 - after_ns / 1e9 - 1e-3 <= lag <= t1 - before_ns / 1e9 + 1e-3, (lag, t0 - after_ns / 1e9)
        wait_for(lambda: value(scrape(port, timeout=10), "cdcd_daemon_lag_seconds") > lag, 60, "a growing lag")

        node.force_archive()
        wait_for(lambda: jsonl_lines(out) > expected, 60, "the rolled segment delivered")
        wait_for(lambda: value(scrape(port, timeout=10), "cdcd_daemon_lag_seconds") == 0, 60, "lag back to 0")
    finally:
        node.close()
        assert stop_daemon(proc) == 0
