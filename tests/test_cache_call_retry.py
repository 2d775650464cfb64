"""Cache calls ride out transient faults as batches do (issue 29 item 3): a ``kind = "python"`` consumer whose
``on_cache_change`` and ``on_cache_drop`` raise ``RetriableError`` a few times, through a real `cdcd run`. Each
backoff step is one ``consumer_retrying`` line naming the call, ``cdcd_daemon_consumer_retries_total`` counts
them all, the daemon never exits, and every event and the drop land exactly once, in WAL order."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from cdcd.node import Node
from cdcd.wal.records import CacheOp, CacheRecord
from tests.support.chaos import scrape
from tests.support.config import write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import child_env, error_lines, log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events, wal_records

SINKS = textwrap.dedent(
    '''
    """A consumer whose cache calls fail a set number of times with a RetriableError."""
    import json

    from cdcd.consumer import Consumer, RetriableError


    class FlakyCaches(Consumer):
        """Writes every event, cache change and drop it takes to ``log`` (one JSON line each, in call order);
        its first ``change_fails`` on_cache_change calls and ``drop_fails`` on_cache_drop calls raise instead."""

        def __init__(self, log, change_fails, drop_fails):
            self.log, self.left = log, {"change": change_fails, "drop": drop_fails}

        def _fail(self, call):
            if self.left[call]:
                self.left[call] -= 1
                raise RetriableError(f"{call} target busy ({self.left[call]} more)")

        def _write(self, *lines):
            with open(self.log, "a") as f:
                f.writelines(json.dumps(line) + "\\n" for line in lines)

        def on_cache_change(self, caches):
            self._fail("change")
            self._write(*(["created", c.name] for c in caches))

        def on_cache_drop(self, drops):
            self._fail("drop")
            self._write(*(["dropped", d.name, d.position.segment, d.position.offset] for d in drops))

        def on_events(self, batch):
            addresses = ((ev.cache_name, ev.position) for ev in batch)
            self._write(*(["event", name, p.segment, p.offset, p.entry_index] for name, p in addresses))
            return True
    '''
)


def write_history(node_dir: Path) -> tuple[int, int]:
    """Caches ``c`` and ``o`` with a few entries, ``c`` destroyed and created again; the DESTROY's place."""
    with Node.open(node_dir, wal_segment_size_bytes=64 * 1024, wal_force_archive_timeout_ms=0) as node:
        c, o = node.cache("c"), node.cache("o")
        for k in range(4):
            c.put(k, {"v": k})
        o.put("x", 1)
        assert node.destroy_cache("c")
        node.cache("c").put(9, {"v": 9})
        o.put("y", 2)
        node.force_archive()
    records = wal_records(node_dir)
    drops = [(p.segment, p.offset) for p, r in records if type(r) is CacheRecord and r.op == CacheOp.DESTROY]
    assert len(drops) == 1
    return drops[0]


def taken(log: Path) -> list[list[Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_cache_change_and_drop_raising_retriable_error_are_retried_then_land_once(tmp_path: Path) -> None:
    """on_cache_change fails twice, on_cache_drop three times: 5 retry steps (lines and counter), each line naming
    its call; then the creates, every event and the one drop land once, in WAL order, and the daemon runs on."""
    node_dir = tmp_path / "node"
    drop = write_history(node_dir)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "cache_sinks.py").write_text(SINKS)
    log = tmp_path / "taken.jsonl"
    consumer = {
        "kind": "python",
        "class": "cache_sinks:FlakyCaches",
        "options": {"log": str(log), "change_fails": 2, "drop_fails": 3},
        "retry_timeout_s": 120,
    }
    port = free_port()
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, metrics_address=f"127.0.0.1:{port}")
    events = wal_events(node_dir)
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=child_env(mods))
    try:
        want = len(events) + 1
        wait_for(
            lambda: proc.poll() is not None or sum(x[0] != "created" for x in taken(log)) >= want, 60, "all delivered"
        )
        assert proc.poll() is None, err.read_text()[-3000:]
        retries = scrape(port)["cdcd_daemon_consumer_retries_total"][0][1]
    finally:
        rc = stop_daemon(proc)
    assert rc == 0 and error_lines(err) == [], err.read_text()[-3000:]
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert [(e["call"], e["attempt"]) for e in steps] == [
        ("on_cache_change", 1),
        ("on_cache_change", 2),
        ("on_cache_drop", 1),
        ("on_cache_drop", 2),
        ("on_cache_drop", 3),
    ]
    assert retries == 5
    assert all(e["level"] == "warning" and e["retry_timeout_s"] == 120 for e in steps)
    assert steps[2]["error"] == "RetriableError: drop target busy (2 more)"

    got = taken(log)
    data = [x for x in got if x[0] != "created"]
    expected = [["event", e["cache"], *e["pos"]] for e in events]
    # the drop sits between the last event before its DESTROY record and the first after it
    before = [x for x in expected if tuple(x[2:4]) < drop]
    assert data == [*before, ["dropped", "c", *drop], *expected[len(before) :]]
    assert [x for x in got if x[0] == "created"] == [["created", "c"], ["created", "o"], ["created", "c"]], got
