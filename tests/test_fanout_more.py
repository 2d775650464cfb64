"""Several consumers of one daemon (issue 45), the rest of the issue's tests: consumers added to and removed from a
running deployment, and realtime for the lake consumer beside Kafka from the archive.

Real processes throughout: a writer node (or the realtime rig's node), ``cdcd run`` daemons stopped and started
with a changed config, ``cdcd state drop-consumer``, the deltalake lake writer and a real Kafka broker. Every
consumer's output is compared with the node's WAL as an exact list (jsonl, in order) or an exact multiset (lake
rows, Kafka messages).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.delta_lake import check_lake, lake_consumer
from tests.support.fanout import OUTAGE, fanout_config
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.kafka import positions_of as kafka_positions
from tests.support.procs import cdcd, child_env, log_events, start_daemon, state_show, stop_daemon, wait_for
from tests.support.realtime import Rig, rig_maker
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import start_writer

__all__ = ["kafka_broker"]  # the fixture, used by name

Pos = tuple[int, int, int]


def positions_of(config: Path) -> dict[str, Pos | None]:
    out: dict[str, Pos | None] = {}
    for name, c in state_show(config)["consumers"].items():
        parts = c["position_parts"]
        out[name] = (parts[0], parts[1], parts[2]) if parts else None
    return out


def lines_of(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def pos(event: dict[str, Any]) -> Pos:
    p = event["pos"]
    return (p[0], p[1], p[2])


def test_consumers_added_in_both_start_modes_and_one_removed_while_another_delivers(tmp_path: Path) -> None:
    """A live node; a daemon of `keep` (jsonl) and `gone` (jsonl whose target goes down after its first delivery:
    it holds links back). The daemon is stopped; `gone`, out of the config, is forgotten with `cdcd state
    drop-consumer` (the links only it held go); the daemon starts again with `oldest` (default start) and `now`
    (start = "now") added. At the
    end, each file is exactly its stretch of the WAL, once and in order: `keep` all of it, `gone` up to its
    committed position, `oldest` from the oldest link left when it was added, `now` from the position it logged
    as its start (past every segment archived before it started)."""
    (tmp_path / "outagesink.py").write_text(OUTAGE)
    node_dir = tmp_path / "node"
    down = tmp_path / "down"
    keep, gone, oldest, now = (tmp_path / f"{n}.jsonl" for n in ("keep", "gone", "oldest", "now"))
    first = fanout_config(
        tmp_path / "first.toml",
        node_dir,
        {
            "gone": {
                "kind": "python",
                "class": "outagesink:Outage",
                "options": {"path": str(gone), "down": str(down)},
                "retry_timeout_s": 600,
            }
        },
        default={"kind": "jsonl", "path": str(keep)},
    )
    second = fanout_config(
        tmp_path / "second.toml",
        node_dir,
        {"oldest": {"kind": "jsonl", "path": str(oldest)}, "now": {"kind": "jsonl", "path": str(now), "start": "now"}},
        default={"kind": "jsonl", "path": str(keep)},
    )
    env = child_env(tmp_path)
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=50)
    try:
        wait_for(lambda: (node_dir / "cdc").is_dir() and cdc_links(node_dir), 60, "the node's first link")
        err = tmp_path / "daemon-1.err"
        proc = start_daemon(first, err, env=env)
        try:
            wait_for(lambda: lines_of(gone) > 0, 60, "a first delivery to gone")
            down.touch()
            # keep goes on while gone retries: two more segments delivered to keep past where gone stands
            wait_for(lambda: any(e.get("event") == "consumer_retrying" for e in log_events(err)), 60, "gone retrying")
            mark = max(archived_segments(node_dir))
            wait_for(lambda: (positions_of(first)["default"] or (0, 0, 0)) > (mark + 2, 0, 0), 60, "keep past it")
        finally:
            assert stop_daemon(proc) == 0, err.read_text()[-3000:]
        held = positions_of(first)
        gone_at, keep_at = held["gone"], held["default"]
        assert gone_at is not None and keep_at is not None and gone_at < keep_at, held
        assert min(cdc_links(node_dir)) <= gone_at[0], "gone holds the links from its position"
        # gone out of the config, then forgotten; oldest and now come in a later change (configured and never
        # started, they would keep every link for themselves).
        alone = fanout_config(tmp_path / "alone.toml", node_dir, {}, default={"kind": "jsonl", "path": str(keep)})
        res = cdcd("state", "drop-consumer", "gone", "--config", str(alone), "--yes")
        assert res.returncode == 0, res.stderr
        assert not (node_dir / "cdcd-state" / "consumers" / "gone").exists()
        # What only gone held is gone; the oldest link left is keep's (the writer only adds links meanwhile).
        start = min(cdc_links(node_dir))
        assert start >= keep_at[0], (start, keep_at)
        err = tmp_path / "daemon-2.err"
        proc = start_daemon(second, err, env=env)
        try:
            wait_for(lambda: any(e.get("event") == "consumer_starts_now" for e in log_events(err)), 60, "now's start")
            (began,) = [e["position"] for e in log_events(err) if e.get("event") == "consumer_starts_now"]
            wait_for(lambda: lines_of(now) > 0 and lines_of(oldest) > 0, 60, "now and oldest delivering")
        finally:
            (tmp_path / "writer.stop").touch()
            assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
        end = (max(archived_segments(node_dir)) + 1, 0, 0)
        try:
            wait_for(lambda: set(positions_of(second).values()) == {end}, 120, "every consumer at the end")
        finally:
            assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    finally:
        if writer.poll() is None:
            (tmp_path / "writer.stop").touch()
            writer.wait(60)
    expected = wal_events(node_dir)
    began_at = tuple(int(x) for x in began.replace("#", ":").split(":"))
    assert began_at[1:] == (0, 0) and began_at[0] > start, (began, start)
    assert read_jsonl(keep) == expected
    assert read_jsonl(gone) == [e for e in expected if pos(e) < gone_at]
    assert read_jsonl(oldest) == [e for e in expected if pos(e)[0] >= start]
    assert read_jsonl(now) == [e for e in expected if pos(e) >= began_at]
    assert read_jsonl(now), "now delivered what was archived after it started"
    assert not cdc_links(node_dir), "every consumer passed every link"
    assert set(state_show(second)["consumers"]) == {"default", "oldest", "now"}


def wait_handed_over(rig: Rig, state: str) -> None:
    """Until the node's realtime mode is ``state`` and the daemon's lake consumer has followed it (PASSIVE while the
    node delivers it, ACTIVE once the daemon does), read from the daemon's state: the node's status describes the
    hand-over of the consumer named default only (its deprecated ``daemon`` is None for a named one)."""
    lane = "PASSIVE" if state == "on" else "ACTIVE"

    def there() -> bool:
        assert rig.node is not None and rig.node.poll() is None, rig.node_log.read_text()[-3000:]
        assert rig.daemon is not None and rig.daemon.poll() is None, rig.daemon_err.read_text()[-3000:]
        status = rig.status()
        who = status["consumers"]["lake"]["delivered_by"]
        mode = state_show(rig.daemon_config)["consumers"]["lake"]["mode"]
        seen.update(realtime=status["realtime"], consumers=status["consumers"], lane=mode)
        return bool(
            status["realtime"]["mode"] == state and who == ("realtime" if state == "on" else "daemon") and mode == lane
        )

    seen: dict[str, Any] = {}
    try:
        wait_for(there, 180, f"realtime {state}, the daemon's lake consumer {lane}", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


def test_realtime_lake_consumer_beside_kafka_from_the_archive_through_switches(
    rig_factory: Any, tmp_path: Path, kafka_broker: Broker
) -> None:
    """A node with realtime on whose [realtime_consumer] is the lake (deltalake writer), and a daemon of two
    consumers: `lake`, its realtime_consumer (the same lake), and `kafka`, always delivered from the archive.
    Through `realtime off, on, off, on` while the node writes, the lake holds every WAL entry exactly once, whole
    records per Delta commit (landed by the node's worker and by the daemon in turn), and the topic every entry
    exactly once."""
    lake = tmp_path / "lake"
    table = lake_consumer(lake)
    rig: Rig = rig_factory(consumer={**table, "name": "lake"}, realtime_cdc=True)
    topic = "fanout-realtime"
    rig.daemon_config = fanout_config(
        tmp_path / "fanout.toml",
        rig.node_dir,
        {
            "lake": table,
            "kafka": {
                "kind": "kafka",
                "bootstrap_servers": kafka_broker.bootstrap,
                "topic": topic,
                "topic_partitions": 3,
                "retry_timeout_s": 120,
            },
        },
        realtime_consumer="lake",
    )
    rig.start_node(pause_ms=200)  # a rate the lake keeps up with on a loaded machine: a switch waits for no backlog
    rig.start_daemon()
    wait_handed_over(rig, "on")
    for state in ("off", "on", "off", "on"):
        rig.wait_written(1)  # the side delivering now has entries of its own before the switch
        said = rig.control("realtime", state).strip()
        assert said in (
            ("realtime: off", "realtime: stopping") if state == "off" else ("realtime: try_start", "realtime: on")
        )
        wait_handed_over(rig, state)
    rig.wait_written(1)
    rig.stop_node(drained=True)
    end = (max(archived_segments(rig.node_dir)) + 1, 0, 0)
    wait_for(lambda: positions_of(rig.daemon_config)["kafka"] == end, 120, "kafka at the end")
    rig.stop_daemon()
    expected = wal_events(rig.node_dir)
    commits = check_lake(lake, rig.node_dir, expected)
    assert len(commits) > 4, "the lake was landed in several commits"
    sent = [p for ps in kafka_positions(read_topic(kafka_broker.bootstrap, topic)).values() for p in ps]
    assert Counter(sent) == Counter(pos(e) for e in expected), "the topic holds every entry once"
    show = state_show(rig.daemon_config)
    assert show["consumers"]["lake"]["realtime"] and not show["consumers"]["kafka"]["realtime"]
