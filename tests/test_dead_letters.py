"""Dead letters (issue 31 item 8) through a real `cdcd run` and a `kind = "python"` consumer that refuses every
1000th event with ``cdcd.consumer.RefusedEvent``: with ``dead_letters = "on"`` the refused events land in the
jsonl file ``dead_letters_path`` exactly once (also across a SIGKILL between the dead letter and the commit after
it) and every other event lands exactly once, in order; with the default the daemon exits 4 with one line naming
the position. Kafka's and replication's own refusals are tested in test_kafka_dead_letters.py and
test_replication_dead_letters.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from tests.support.chaos import scrape
from tests.support.config import write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import cdcd, child_env, error_lines, log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node

SINKS = textwrap.dedent(
    '''
    """A test consumer for `kind = "python"`."""
    import json
    import os

    from cdcd.consumer import Consumer, RefusedEvent


    class Picky(Consumer):
        """Appends the position of every event it takes to ``log`` (fsynced), skipping positions it already has
        (so it is exactly once across a crash); refuses the events at the positions in ``refuse``, before writing
        anything of the batch."""

        def __init__(self, log, refuse=(), refuse_keys=()):
            self.log, self.refuse, self.refuse_keys = log, {tuple(p) for p in refuse}, set(refuse_keys)
            self.last = None
            if os.path.exists(log):
                lines = open(log).read().splitlines()
                if lines:
                    self.last = tuple(json.loads(lines[-1]))

        def on_events(self, batch):
            out = []
            for ev in batch:
                p = ev.position
                here = (p.segment, p.offset, p.entry_index)
                if here in self.refuse or (self.refuse_keys and ev.key in self.refuse_keys):
                    raise RefusedEvent(p, f"key {ev.key!r} breaks the rule")
                if self.last is None or here > self.last:
                    out.append(here)
            with open(self.log, "a") as f:
                f.writelines(json.dumps(list(here)) + "\\n" for here in out)
                f.flush()
                os.fsync(f.fileno())
            if out:
                self.last = out[-1]
            return True
    '''
)


def picky(tmp_path: Path, log: Path, refuse: list[list[int]]) -> tuple[dict[str, Any], dict[str, str]]:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "dlq_sinks.py").write_text(SINKS)
    return {"kind": "python", "class": "dlq_sinks:Picky", "options": {"log": str(log), "refuse": refuse}}, child_env(
        mods
    )


def lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def setup(tmp_path: Path) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """A node of about 5,000 events; (its dir, every event as the jsonl sink writes it, every 1000th of them)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=50)
    events = wal_events(node_dir)
    assert len(events) > 4000
    return node_dir, events, events[999::1000]


def check_exactly_once(log: Path, dead: Path, events: list[dict[str, Any]], refused: list[dict[str, Any]]) -> None:
    refused_pos = [e["pos"] for e in refused]
    assert lines(log) == [e["pos"] for e in events if e["pos"] not in refused_pos], "the rest exactly once, in order"
    letters = lines(dead)
    assert [d["pos"] for d in letters] == refused_pos, "the refused events exactly once, in order"
    for d, e in zip(letters, refused, strict=True):
        assert (d["cache"], d["op"], d["key"], d["value"]) == (e["cache"], e["op"], e["key"], e["value"])
        assert d["error"] == f"key {e['key']!r} breaks the rule" and d["commit_ts_ns"] == e["commit_ts_ns"]


def test_refused_events_go_to_the_dead_letter_file_and_the_rest_lands_once(tmp_path: Path) -> None:
    """Every 1000th event refused: each is one dead_letter warning, one line of the file and one count of
    cdcd_daemon_dead_letters_total{cache}; the daemon keeps running and no error line is written."""
    node_dir, events, refused = setup(tmp_path)
    log, dead = tmp_path / "delivered.jsonl", tmp_path / "dead" / "letters.jsonl"
    consumer, env = picky(tmp_path, log, [e["pos"] for e in refused])
    port = free_port()
    config = write_daemon_config(
        tmp_path / "cdcd.toml",
        node_dir,
        {**consumer, "dead_letters": "on", "dead_letters_path": str(dead)},
        batch_max_events=700,
        metrics_address=f"127.0.0.1:{port}",
    )
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or len(lines(log)) + len(lines(dead)) >= len(events), 60, "all")
        assert proc.poll() is None, err.read_text()[-3000:]
        counted = {labels["cache"]: value for labels, value in scrape(port)["cdcd_daemon_dead_letters_total"]}
        top = cdcd(
            "top", "--node-dir", str(node_dir), "--config", str(config), "--interval-ms", "100", "--once", "--json"
        )
        assert top.returncode == 0, top.stderr
        problems = json.loads(top.stdout)["problems"]
    finally:
        rc = stop_daemon(proc)
    assert rc == 0 and error_lines(err) == [], err.read_text()[-3000:]
    check_exactly_once(log, dead, events, refused)
    per_cache: dict[str, int] = {}
    for e in refused:
        per_cache[e["cache"]] = per_cache.get(e["cache"], 0) + 1
    assert counted == per_cache
    shown = {k: v for k, v in problems.items() if k.startswith("cdcd_daemon_dead_letters_total")}
    assert shown == {f'cdcd_daemon_dead_letters_total{{cache="{c}"}}': n for c, n in per_cache.items()}, problems
    warned = [e for e in log_events(err) if e["event"] == "dead_letter"]
    assert [w["position"] for w in warned] == ["{}:{}#{}".format(*e["pos"]) for e in refused]
    assert all(w["level"] == "warning" and w["cache"] for w in warned)


def test_sigkill_between_a_dead_letter_and_its_commit_keeps_it_once(tmp_path: Path) -> None:
    """The daemon SIGKILLs itself right after the 2nd dead letter is durable, before the position moves past it;
    the next run is offered that event again, is refused again, and the file still holds it once."""
    node_dir, events, refused = setup(tmp_path)
    log, dead = tmp_path / "delivered.jsonl", tmp_path / "letters.jsonl"
    consumer, env = picky(tmp_path, log, [e["pos"] for e in refused])
    config = write_daemon_config(
        tmp_path / "cdcd.toml",
        node_dir,
        {**consumer, "dead_letters": "on", "dead_letters_path": str(dead)},
        batch_max_events=700,
    )
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env={**env, "CDCD_FAILPOINTS": "delivery.dead_letter.written@2"})
    assert proc.wait(60) == -9, err.read_text()[-3000:]
    assert len(lines(dead)) == 2 and len(lines(log)) < len(events) - len(refused)
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or len(lines(log)) + len(lines(dead)) >= len(events), 60, "all")
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc)
    assert rc == 0 and error_lines(err) == [], err.read_text()[-3000:]
    check_exactly_once(log, dead, events, refused)


def test_by_default_a_refused_event_stops_the_daemon_naming_its_position(tmp_path: Path) -> None:
    """dead_letters off (the default): exit 4 with one line naming the position, the cache, the reason and the
    option; everything before the refused event was delivered (also the part of its batch before it), nothing
    after it."""
    node_dir, events, refused = setup(tmp_path)
    log = tmp_path / "delivered.jsonl"
    consumer, env = picky(tmp_path, log, [e["pos"] for e in refused])
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=700)
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)
    assert proc.wait(60) == 4, err.read_text()[-3000:]
    first = refused[0]
    position = "{}:{}#{}".format(*first["pos"])
    assert error_lines(err) == [
        f"cdcd: error: consumer refused the event at {position} (cache {first['cache']}): key {first['key']!r} "
        'breaks the rule (set [consumer] dead_letters = "on" to set such events aside)'
    ]
    assert err.read_text().splitlines()[-1].startswith("cdcd: error:")
    assert lines(log) == [e["pos"] for e in events[:999]]


def test_dead_letter_options_are_checked(tmp_path: Path) -> None:
    """Each wrong setting is exit 2 with one line naming the key."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"kind": "null", "dead_letters": "yes"}, "key 'dead_letters': 'yes': must be \"off\" or \"on\""),
        (
            {"kind": "null", "dead_letters": "on"},
            "key 'dead_letters_path': required with dead_letters = \"on\" for kind 'null' (a jsonl file)",
        ),
        ({"kind": "null", "dead_letters_path": "x.jsonl"}, "key 'dead_letters_path': set, but dead_letters is \"off\""),
        (
            {
                "kind": "kafka",
                "bootstrap_servers": "127.0.0.1:1",
                "topic": "t",
                "dead_letters": "on",
                "dead_letters_path": "x.jsonl",
            },
            "key 'dead_letters_path': kind 'kafka' keeps dead letters in <topic>.dlq, in the same transaction as its "
            "batch",
        ),
        (
            {"kind": "lake", "path": str(tmp_path / "lake"), "dead_letters": "on"},
            "key 'dead_letters': kind 'lake' has no dead letters: it refuses no single event",
        ),
    ]
    for i, (table, expected) in enumerate(cases):
        config = write_daemon_config(tmp_path / f"c{i}.toml", node_dir, table)
        res = cdcd("run", "--config", str(config))
        assert res.returncode == 2, (table, res.stderr[-2000:])
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith(f"cdcd: error: {config}: consumer: {expected}"), last


def test_the_realtime_worker_sets_refused_events_aside_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's realtime worker, with the same consumer and options: keys 42, 142 and 242 refused (one in the
    middle of each 50-entry record) land in the dead-letter file once, every other event in the log once, in order,
    and realtime stays on."""
    node_dir, log, dead = tmp_path / "node", tmp_path / "rt.jsonl", tmp_path / "rt-dead.jsonl"
    consumer, _env = picky(tmp_path, log, [])
    consumer["options"]["refuse_keys"] = [42, 142, 242]
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    table = {**consumer, "dead_letters": "on", "dead_letters_path": str(dead)}
    with Node.open(
        node_dir,
        realtime_cdc=True,
        realtime_consumer=table,
        cdc_enabled=False,
        wal_force_archive_timeout_ms=0,
        realtime_commit_record_interval_ms=0,
    ) as node:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        cache = node.cache("c")
        for i in range(0, 300, 50):
            cache.put_all({k: {"k": k} for k in range(i, i + 50)})
        node.flush()
        wait_for(lambda: len(lines(log)) + len(lines(dead)) >= 300, 30, "every event")
        assert node.realtime.mode is RealtimeMode.ON
    events = wal_events(node_dir)
    refused = [e for e in events if e["key"] in (42, 142, 242)]
    assert len(events) == 300 and len(refused) == 3
    assert lines(log) == [e["pos"] for e in events if e not in refused]
    assert [(d["pos"], d["key"], d["value"]) for d in lines(dead)] == [
        (e["pos"], e["key"], e["value"]) for e in refused
    ]


def test_the_dead_letter_file_cuts_a_torn_line_and_skips_what_it_holds(tmp_path: Path) -> None:
    """A real file: two dead letters, then a torn third line (a kill while writing). A new writer (the next run)
    cuts the torn line, skips events at or before the last whole one, and appends the next one after it."""
    from cdcd.consumer import EventBatch, RecordSlice
    from cdcd.dead_letters import DeadLetterFile
    from cdcd.wal.records import CacheRecord, DataRecord
    from tests.support.wal import wal_records

    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=3)
    names: dict[int, str] = {}
    evs = []
    for ptr, rec in wal_records(node_dir):
        if type(rec) is CacheRecord:
            names[rec.cache_id] = rec.name
        elif type(rec) is DataRecord:
            evs.extend(EventBatch("n", [RecordSlice(ptr, rec)], names))
    path = tmp_path / "dead.jsonl"
    first = DeadLetterFile(path)
    assert first.write(evs[3], "too big") and first.write(evs[10], "too big")
    assert not first.write(evs[10], "again")
    whole = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"pos": [1, 2')
    second = DeadLetterFile(path)
    assert not second.write(evs[3], "again") and not second.write(evs[10], "again")
    assert path.read_bytes() == whole, "the torn line is cut, nothing written twice"
    assert second.write(evs[11], "too big")
    got = [(d["pos"], d["error"]) for d in lines(path)]
    want = [([p.segment, p.offset, p.entry_index], "too big") for p in (e.position for e in (evs[3], evs[10], evs[11]))]
    assert got == want
