"""Several consumers of one daemon (issue 45): ``[consumers.<name>]`` tables beside ``[consumer]``.

Each consumer has its own position, bound to its identity (kind and target); one read of the CDC dir
feeds them all; a link goes once every consumer committed past it; a consumer that fails for good
stops alone. Checked with real daemon processes (SIGKILLed), a real node's WAL as the reference, the
deltalake lake writer, jsonl files and a user class that breaks.
"""

from __future__ import annotations

import json
import random
import re
import signal
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.config import ConfigError
from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.daemon.daemon import Daemon
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.wal.pointer import WalPosition
from tests.support.delta_lake import check_lake, lake_consumer
from tests.support.fanout import OUTAGE, fanout_config, newest_commit_ns
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.kafka import positions_of as kafka_positions
from tests.support.procs import (
    cdcd,
    child_env,
    error_lines,
    log_events,
    start_daemon,
    state_show,
    stop_daemon,
    wait_for,
)
from tests.support.realtime import Rig, check_delivery, rig_maker
from tests.support.replication_rig import NodeProc, Procs, procs
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import make_node, start_writer

__all__ = ["kafka_broker", "procs"]  # the fixtures, used by name


def positions_of(config: Path) -> dict[str, tuple[int, int, int] | None]:
    show = state_show(config)
    return {name: tuple(c["position_parts"]) if c["position_parts"] else None for name, c in show["consumers"].items()}


def check_jsonl(out: Path, expected: list[dict[str, Any]]) -> None:
    """Every expected event is in the file, equal to its WAL entry; only re-deliveries repeat (at least once),
    in WAL order within each delivery."""
    lines = whole_lines(out)
    by_pos = {tuple(e["pos"]): e for e in expected}
    got = Counter(tuple(line["pos"]) for line in lines)
    assert set(got) == set(by_pos), (
        f"{out.name}: {len(set(by_pos) - set(got))} missing, {len(set(got) - set(by_pos))} not in the WAL"
    )
    for line in lines:
        assert line == by_pos[tuple(line["pos"])], f"{out.name}: line at {line['pos']}"


def test_lake_kafka_replica_and_two_jsonl_from_one_daemon_exact_through_sigkills(
    tmp_path: Path, kafka_broker: Broker, procs: Procs
) -> None:
    """A lake (deltalake writer), a Kafka topic, a replica node, a jsonl of everything and a jsonl of one cache,
    from one daemon SIGKILLed at random moments while it catches up: the lake and the topic hold every WAL entry
    exactly once, the replica equals the source (`cdcd node diff`), each file every entry of its caches, no other;
    at the end every link is gone. Started together, they share the daemon's reads."""
    rng = random.Random(45)
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=14, tx_per_segment=25)
    lake, everything, people = tmp_path / "lake", tmp_path / "all.jsonl", tmp_path / "people.jsonl"
    replica = NodeProc(procs, tmp_path, "replica", 2)
    replica.start()
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "lake": lake_consumer(lake),
            "all": {"kind": "jsonl", "path": str(everything)},
            "people": {"kind": "jsonl", "path": str(people), "caches": ["user*"]},
            "replica": {"kind": "replication", "target": replica.target, "token_file": str(replica.token)},
            "kafka": {
                "kind": "kafka",
                "bootstrap_servers": kafka_broker.bootstrap,
                "topic": "fanout",
                "topic_partitions": 3,
            },
        },
    )
    # A first run from the oldest link, all three at one position: one read of a chunk serves all three.
    err = tmp_path / "daemon-first.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: any(positions_of(config).values()), 60, "a first commit")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    stopped = [e for e in log_events(err) if e.get("event") == "daemon_stopped"][-1]
    assert stopped["shared_reads"]["hits"] > 0, stopped
    for k in range(4):
        err = tmp_path / f"daemon-{k}.err"
        proc = start_daemon(config, err)
        wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 60, "daemon start")
        assert proc.poll() is None, err.read_text()[-3000:]
        time.sleep(rng.uniform(0.2, 1.5))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    err = tmp_path / "daemon-final.err"
    proc = start_daemon(config, err)
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: set(positions_of(config).values()) == {end}, 120, "every consumer at the end")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    expected = wal_events(node_dir)
    caches = {e["cache"] for e in expected}
    assert len(caches) > 1 and any(c.startswith("user") for c in caches)
    check_lake(lake, node_dir, expected)
    sent = [p for ps in kafka_positions(read_topic(kafka_broker.bootstrap, "fanout")).values() for p in ps]
    assert Counter(sent) == Counter(tuple(e["pos"]) for e in expected), "the topic holds every entry once"
    replica.stop()
    diff = cdcd("node", "diff", str(node_dir), str(replica.dir), "--json", timeout=120)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    check_jsonl(everything, expected)
    check_jsonl(people, [e for e in expected if e["cache"].startswith("user")])
    assert not cdc_links(node_dir), "every consumer passed every segment: no link left"
    # Each consumer's state is its own, bound to its identity.
    show = state_show(config)
    assert show["consumers"]["lake"]["identity"] == f"lake {lake}"
    assert show["consumers"]["all"]["identity"] == f"jsonl {everything}"
    assert show["consumers"]["people"]["state_dir"] == str(node_dir / "cdcd-state" / "consumers" / "people")


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


def test_realtime_hands_over_one_consumer_while_another_reads_the_archive(rig_factory: Any, tmp_path: Path) -> None:
    """A node with realtime on, a daemon of two consumers: `default` is its realtime_consumer (the node's realtime
    jsonl stands in for it), `archive` is always delivered from the archive. Through `realtime off, on, off, on`
    under load, the node's and default's files are exactly their shares of the WAL (nothing twice, nothing lost),
    and archive's file is the whole WAL, once, in order; the node's try-start waits for both to pass it."""
    rig: Rig = rig_factory(realtime_cdc=True)
    archive = tmp_path / "archive.jsonl"
    rig.daemon_config = fanout_config(
        tmp_path / "fanout.toml",
        rig.node_dir,
        {"archive": {"kind": "jsonl", "path": str(archive)}},
        default={"kind": "jsonl", "path": str(rig.daemon_out)},
        realtime_consumer="default",
    )
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    for state in ("off", "on", "off", "on"):
        rig.wait_delivered("node" if state == "off" else "daemon", 600)
        st = rig.switch_off() if state == "off" else rig.switch_on()
        assert st["cdc_mode"] == ("DAEMON_ACTIVE" if state == "off" else "NODE_ACTIVE")
    rig.wait_delivered("node", 600)
    rig.stop_node()
    end = (max(archived_segments(rig.node_dir)) + 1, 0, 0)
    wait_for(lambda: positions_of(rig.daemon_config)["archive"] == end, 60, "archive at the end")
    rig.stop_daemon()
    check_delivery(rig)
    assert read_jsonl(archive) == wal_events(rig.node_dir)
    show = state_show(rig.daemon_config)
    assert show["consumers"]["default"]["realtime"] and not show["consumers"]["archive"]["realtime"]
    assert show["consumers"]["archive"]["mode"] == "ACTIVE"


def test_an_outage_of_one_consumer_does_not_hold_back_the_other(tmp_path: Path) -> None:
    """While one consumer's target is down (RetriableError, retried by its own policy) a live node's writes keep
    reaching the other consumer: entries written well after the outage began are delivered before it ends. Once it
    ends, the first catches up: both files are the whole WAL."""
    (tmp_path / "outagesink.py").write_text(OUTAGE)
    node_dir = tmp_path / "node"
    down = tmp_path / "down"
    live, late = tmp_path / "live.jsonl", tmp_path / "late.jsonl"
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "late": {
                "kind": "python",
                "class": "outagesink:Outage",
                "options": {"path": str(late), "down": str(down)},
                "retry_timeout_s": 600,
            }
        },
        default={"kind": "jsonl", "path": str(live)},
    )
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=50)
    err = tmp_path / "daemon.err"
    proc = None
    lags: list[float] = []
    try:
        wait_for(lambda: (node_dir / "cdc").is_dir() and cdc_links(node_dir), 60, "the node's first link")
        proc = start_daemon(config, err, env=child_env(tmp_path))
        wait_for(lambda: late.exists() and late.stat().st_size > 0, 60, "a first delivery to late")
        down.touch()
        began_ns = time.time_ns()

        def live_past(seconds: float) -> bool:
            newest = newest_commit_ns(live)
            lags.append((time.time_ns() - newest) / 1e9)
            return newest > began_ns + int(seconds * 1e9)

        wait_for(lambda: live_past(3.0), 60, "live to deliver 3 s into the outage")
        assert proc.poll() is None, err.read_text()[-3000:]
        retries = [e for e in log_events(err) if e.get("event") == "consumer_retrying"]
        assert retries, "late is retrying its outage"
        assert newest_commit_ns(late) < began_ns, "late delivered nothing written during its outage"
        down.unlink()
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    assert proc is not None
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: set(positions_of(config).values()) == {end}, 120, "both at the end")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    expected = wal_events(node_dir)
    check_jsonl(live, expected)
    check_jsonl(late, expected)
    print(f"live consumer's lag during the other's outage: max {max(lags):.2f} s over {len(lags)} samples")


BROKEN = textwrap.dedent(
    """
    from cdcd.consumer import Consumer

    class Broken(Consumer):
        def __init__(self, after: int) -> None:
            self.after = after
            self.seen = 0

        def on_events(self, batch):
            self.seen += len(batch)
            if self.seen > self.after:
                raise ValueError("the target refuses everything after event %d" % self.after)
            return True
    """
)


def test_a_consumer_failing_for_good_stops_alone(tmp_path: Path) -> None:
    """A user class that raises stops its consumer only: the jsonl beside it delivers every entry, the daemon
    goes on, `cdcd state show` names the stopped consumer and why, the links from its position on are kept,
    and the daemon's exit at SIGTERM is the consumer's (4) with one line naming it."""
    (tmp_path / "brokensink.py").write_text(BROKEN)
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=6, tx_per_segment=20)
    out = tmp_path / "events.jsonl"
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {"broken": {"kind": "python", "class": "brokensink:Broken", "options": {"after": 300}}},
        default={"kind": "jsonl", "path": str(out)},
    )
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=child_env(tmp_path))
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: positions_of(config)["default"] == end, 60, "the jsonl consumer at the end")
        wait_for(lambda: state_show(config)["consumers"]["broken"]["stopped"] is not None, 30, "broken stopped")
        assert proc.poll() is None, "the daemon goes on with the other consumer"
    finally:
        code = stop_daemon(proc)
    assert code == 4, err.read_text()[-3000:]
    expected = wal_events(node_dir)
    check_jsonl(out, expected)
    show = state_show(config)
    broken = show["consumers"]["broken"]
    assert broken["stopped"]["exit_code"] == 4
    assert "the target refuses everything after event 300" in broken["stopped"]["error"]
    held = tuple(broken["position_parts"]) if broken["position_parts"] else None
    links = sorted(cdc_links(node_dir))
    assert links and (held is None or links[0] == held[0]), (links, held)
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("cdcd: error: consumer broken: "), lines
    events = log_events(err)
    assert any(e.get("event") == "consumer_stopped" and e.get("consumer") == "broken" for e in events)
    text = cdcd("state", "show", "--config", str(config)).stdout
    assert "consumer broken: ACTIVE" in text and "STOPPED (exit 4)" in text, text


def test_state_of_another_consumer_is_refused(tmp_path: Path) -> None:
    """The README trap: two configs of one node share its state_dir. The second consumer is refused with one
    line naming both identities and the way out, exit 7, before it delivers anything; the first goes on."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=3, tx_per_segment=10)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    a = fanout_config(tmp_path / "a.toml", node_dir, {}, default={"kind": "jsonl", "path": str(first)})
    b = fanout_config(tmp_path / "b.toml", node_dir, {}, default={"kind": "jsonl", "path": str(second)})
    err = tmp_path / "a.err"
    proc = start_daemon(a, err)
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: positions_of(a)["default"] == end, 60, "the first consumer at the end")
    finally:
        assert stop_daemon(proc) == 0
    err_b = tmp_path / "b.err"
    proc = start_daemon(b, err_b)
    assert proc.wait(30) == 7
    lines = error_lines(err_b)
    assert len(lines) == 1, lines
    assert f"consumer 'jsonl {first}'" in lines[0] and f"consumer is 'jsonl {second}'" in lines[0], lines
    assert "[consumers.<name>]" in lines[0]
    assert not second.exists()
    # The same two as consumers of one daemon: the second starts from the oldest link.
    both = fanout_config(
        tmp_path / "both.toml",
        node_dir,
        {"second": {"kind": "jsonl", "path": str(second)}},
        default={"kind": "jsonl", "path": str(first)},
    )
    make_node(node_dir, segments=2, tx_per_segment=10, first_tx=30)
    err = tmp_path / "both.err"
    proc = start_daemon(both, err)
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: set(positions_of(both).values()) == {end}, 60, "both at the end")
    finally:
        assert stop_daemon(proc) == 0
    expected = wal_events(node_dir)
    check_jsonl(first, expected)
    # The second was added after the first consumed (and unlinked) the older segments: it starts at the oldest link.
    oldest = min(tuple(e["pos"]) for e in read_jsonl(second))
    check_jsonl(second, [e for e in expected if tuple(e["pos"]) >= oldest])


class Holding(Consumer):
    """Takes everything and confirms nothing until told to (its position stays where it started)."""

    def __init__(self) -> None:
        self.confirm = False
        self.events = 0

    def on_events(self, batch: EventBatch) -> bool:
        self.events += len(batch)
        return self.confirm


class Counting(Consumer):
    def __init__(self) -> None:
        self.events = 0

    def on_events(self, batch: EventBatch) -> bool:
        self.events += len(batch)
        return True


def test_links_go_only_below_every_consumer(tmp_path: Path) -> None:
    """A link is deleted once every consumer committed past it: one consumer holding its position keeps every
    link though the other consumed them all; once it confirms, they go. A state written by a daemon of one
    consumer (no identity yet) is read as consumer default's and bound to it."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=5, tx_per_segment=10)
    segments = sorted(cdc_links(node_dir))
    # A state as a daemon of one consumer wrote it before consumers had names: bound at the first start.
    store = StateStore(node_dir / "cdcd-state")
    store.commit(DaemonState(CdcMode.DAEMON_ACTIVE, WalPosition(segments[1], 0, 0)))
    store.close()
    config = DaemonConfig(
        node_dir=str(node_dir),
        metrics_address="",
        consumer={"kind": "null"},
        consumers={"holding": {"kind": "null"}},
    )
    counting, holding = Counting(), Holding()
    with Daemon(config, {"default": counting, "holding": holding}) as daemon:
        daemon.sync_once()
        assert counting.events and holding.events == len(wal_events(node_dir))
        assert sorted(cdc_links(node_dir)) == segments, "the holding consumer needs every link"
        holding.confirm = True
        daemon.sync_once()
        assert not cdc_links(node_dir)
        assert (
            daemon.lanes["default"].position == daemon.lanes["holding"].position == WalPosition(segments[-1] + 1, 0, 0)
        )
    store = StateStore(node_dir / "cdcd-state", readonly=True)
    assert store.load(CdcMode.DAEMON_ACTIVE).consumer == "null"
    store.close()
    # The default consumer started where the old state was; the new one at the oldest link.
    assert counting.events == len([e for e in wal_events(node_dir) if e["pos"][0] >= segments[1]])


@pytest.mark.parametrize(
    ("top", "tables", "message"),
    [
        ("", '[consumers."a b"]\nkind = "null"\n', "consumer name 'a b'"),
        ("", '[consumers.default]\nkind = "null"\n', "the consumer named default is [consumer]"),
        ("", "[consumers.kafka]\ntopic = 'x'\n", "missing key 'consumers.kafka.kind'"),
        ('realtime_consumer = "nope"\n', '[consumers.x]\nkind = "null"\n', "no consumer named 'nope'"),
    ],
)
def test_config_errors_name_the_consumer_key(tmp_path: Path, top: str, tables: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'node_dir = "{tmp_path}"\n{top}[consumer]\nkind = "null"\n{tables}')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_daemon_config(path, environ={})


def test_a_consumers_own_key_error_names_its_table(tmp_path: Path) -> None:
    """`cdcd run` refuses a named consumer's bad key in one line naming consumers.<name>, exit 2."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=1)
    config = fanout_config(
        tmp_path / "c.toml",
        node_dir,
        {"events": {"kind": "jsonl", "path": str(tmp_path / "e.jsonl"), "fsynk": True}},
        default={"kind": "null"},
    )
    res = cdcd("run", "--config", str(config))
    assert res.returncode == 2, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("cdcd: error:")]
    assert "consumers.events" in line and "fsynk" in line and "fsync" in line, line


def test_a_consumer_past_max_retained_bytes_is_invalidated_alone(tmp_path: Path) -> None:
    """A consumer that holds back more link bytes than its max_retained_bytes is invalidated: one line naming it,
    its position and the way back, the metric, its links released while the other consumer goes on; it stays
    invalidated at the next start, and `state reset --consumer` brings it back from the oldest link."""
    from cdcd.daemon.ops import plan_reset, reset_state
    from cdcd.metrics import DAEMON

    def invalidations() -> float:
        value = DAEMON.get_sample_value("cdcd_daemon_consumer_invalidations_total", {"consumer": "lagging"})
        return value or 0.0

    node_dir = tmp_path / "node"
    make_node(node_dir, segments=4, tx_per_segment=10)
    cap = sum(p.stat().st_size for p in cdc_links(node_dir).values()) // 2
    config = DaemonConfig(
        node_dir=str(node_dir),
        metrics_address="",
        consumer={"kind": "null"},
        consumers={"lagging": {"kind": "null", "max_retained_bytes": cap}},
    )
    before = invalidations()
    counting, lagging = Counting(), Holding()
    with Daemon(config, {"default": counting, "lagging": lagging}) as daemon:
        daemon.sync_once()
        assert counting.events == len(wal_events(node_dir))
        failure = daemon.failures["lagging"]
        assert "consumer lagging invalidated" in str(failure) and f"max_retained_bytes = {cap}" in str(failure)
        assert "cdcd state reset --config F --consumer lagging" in str(failure)
        assert not cdc_links(node_dir), "the invalidated consumer holds no link"
    assert invalidations() == before + 1
    make_node(node_dir, segments=2, tx_per_segment=10, first_tx=40)
    counting, lagging = Counting(), Holding()
    lagging.confirm = True
    with Daemon(config, {"default": counting, "lagging": lagging}) as daemon:
        assert "lagging" in daemon.failures, "still invalidated at the next start"
        daemon.sync_once()
        assert lagging.events == 0 and counting.events > 0 and not cdc_links(node_dir)
    one = config.for_consumer("lagging")
    reset_state(one, plan_reset(one, None))
    make_node(node_dir, segments=1, tx_per_segment=10, first_tx=60)
    counting, lagging = Counting(), Holding()
    lagging.confirm = True
    with Daemon(config, {"default": counting, "lagging": lagging}) as daemon:
        daemon.sync_once()
        assert not daemon.failures and lagging.events == counting.events > 0


def test_start_now_skips_what_was_archived_before(tmp_path: Path) -> None:
    """A consumer added with start = "now" delivers only what is archived after it started; one with the default
    start delivers from the oldest link."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=3, tx_per_segment=10)
    before = len(wal_events(node_dir))
    config = DaemonConfig(
        node_dir=str(node_dir),
        metrics_address="",
        consumer={"kind": "null"},
        consumers={"late": {"kind": "null", "start": "now"}},
    )
    counting, late = Counting(), Counting()
    with Daemon(config, {"default": counting, "late": late}) as daemon:
        daemon.sync_once()
        assert (counting.events, late.events) == (before, 0)
    make_node(node_dir, segments=2, tx_per_segment=10, first_tx=30)
    counting, late = Counting(), Counting()
    with Daemon(config, {"default": counting, "late": late}) as daemon:
        daemon.sync_once()
        assert late.events == counting.events == len(wal_events(node_dir)) - before


def test_the_shipped_fanout_config_runs_the_readme_consumers_from_one_daemon(tmp_path: Path) -> None:
    """config/fanout.toml, its paths moved into a scratch dir (compaction off through the environment, which
    reaches a named consumer's key), delivers node1's WAL to both: the jsonl file and the lake exactly."""
    text = (Path(__file__).parent.parent / "config" / "fanout.toml").read_text()
    node_dir = tmp_path / "var" / "node1"
    make_node(node_dir, segments=3, tx_per_segment=10)
    config = tmp_path / "fanout.toml"
    config.write_text(text.replace("var/", f"{tmp_path}/var/").replace('"127.0.0.1:9469"', '""'))
    env = {**child_env(), "CDCD_CONSUMERS__LAKE__COMPACT_INTERVAL_S": "0"}
    loaded = load_daemon_config(config, environ=env)
    assert loaded.consumers["lake"]["compact_interval_s"] == 0 and loaded.consumers["lake"]["retry_timeout_s"] == 600
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: set(positions_of(config).values()) == {end}, 120, "both consumers at the end")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    expected = wal_events(node_dir)
    assert read_jsonl(tmp_path / "var" / "cdc-events.jsonl") == expected
    check_lake(tmp_path / "var" / "lake", node_dir, expected)
    assert state_show(config)["consumers"]["default"]["state_dir"] == str(node_dir / "cdcd-state")


def test_consumers_listed_and_a_removed_one_dropped(tmp_path: Path) -> None:
    """`cdcd state consumers` lists each consumer with what it holds, and the state of one removed from the config;
    `cdcd state drop-consumer` refuses a configured one (exit 2) and forgets the removed one, deleting the links
    only it held."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=3, tx_per_segment=10)
    links = sorted(cdc_links(node_dir))
    old = DaemonConfig(
        node_dir=str(node_dir),
        metrics_address="",
        consumer={"kind": "null"},
        consumers={"old": {"kind": "null"}},
    )
    with Daemon(old, {"default": Counting(), "old": Holding()}) as daemon:
        daemon.sync_once()
    assert sorted(cdc_links(node_dir)) == links, "old holds every link"
    config = fanout_config(tmp_path / "now.toml", node_dir, {}, default={"kind": "null"})
    res = cdcd("state", "consumers", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    listed = {c["name"]: c for c in json.loads(res.stdout)}
    assert listed["default"]["in_config"] and listed["default"]["holds_bytes"] == 0
    assert not listed["old"]["in_config"] and listed["old"]["holds_bytes"] > 0 and listed["old"]["identity"] == "null"
    text = cdcd("state", "consumers", "--config", str(config)).stdout
    assert "not in config" in text, text
    res = cdcd("state", "drop-consumer", "default", "--config", str(config), "--yes")
    assert res.returncode == 2 and "remove it there first" in res.stderr, res.stderr
    res = cdcd("state", "drop-consumer", "old", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert f"{len(links)} link(s)" in res.stdout
    assert not cdc_links(node_dir) and not (node_dir / "cdcd-state" / "consumers" / "old").exists()


def test_shared_reads_are_bounded_and_a_consumer_behind_reads_on_its_own(tmp_path: Path) -> None:
    """Decoded chunks are kept up to shared_read_bytes, oldest out first: with room for none, every consumer
    reads for itself and all are still exact; with room, the second consumer takes the first one's reads."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=4, tx_per_segment=10)
    expected = len(wal_events(node_dir))
    for room, state in ((0, "s0"), (64 << 20, "s1")):
        config = DaemonConfig(
            node_dir=str(node_dir),
            metrics_address="",
            state_dir=str(tmp_path / state),
            shared_read_bytes=room,
            consumer={"kind": "null"},
            consumers={"b": {"kind": "null"}, "c": {"kind": "null"}},
        )
        a, b, c = Counting(), Counting(), Holding()
        with Daemon(config, {"default": a, "b": b, "c": c}) as daemon:
            daemon.sync_once()
            shared = daemon.shared
            assert shared is not None
            assert a.events == b.events == c.events == expected
            assert shared._bytes <= room
            if room:
                assert shared.hits >= 2 * (shared.misses - 3), (shared.hits, shared.misses)  # 3 caught-up polls
            else:
                assert shared.hits == 0


def test_two_consumers_through_sigkills_while_the_node_writes(tmp_path: Path) -> None:
    """A live node writing and rolling segments while a daemon of two consumers (one filtered, one slower to
    confirm: a smaller batch) is SIGKILLed at random moments: each file holds every WAL entry of its caches, equal
    to it, and each restart resumes each consumer at its own committed position (never past what it wrote)."""
    rng = random.Random(4545)
    node_dir = tmp_path / "node"
    everything, users = tmp_path / "all.jsonl", tmp_path / "users.jsonl"
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {"users": {"kind": "jsonl", "path": str(users), "caches": ["user*"]}},
        default={"kind": "jsonl", "path": str(everything)},
    )
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=50)
    try:
        wait_for(lambda: (node_dir / "cdc").is_dir() and cdc_links(node_dir), 60, "the node's first link")
        for k in range(4):
            err = tmp_path / f"daemon-{k}.err"
            proc = start_daemon(config, err)
            wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 60, "daemon start")
            assert proc.poll() is None, err.read_text()[-3000:]
            time.sleep(rng.uniform(0.1, 1.0))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            # Each consumer's committed position is never past what its file holds whole.
            committed = positions_of(config)
            reached = [p for p in committed.values() if p is not None]
            if not reached:
                continue
            events = wal_events(node_dir, upto=max(p[0] for p in reached) + 1)
            for name, out in (("default", everything), ("users", users)):
                pos = committed[name]
                if pos is None:
                    continue
                written = {tuple(x["pos"]) for x in whole_lines(out)}
                before = {
                    tuple(e["pos"])
                    for e in events
                    if tuple(e["pos"]) < pos and (name == "default" or e["cache"].startswith("user"))
                }
                assert before <= written, f"{name}: committed {pos} past what it wrote"
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    err = tmp_path / "daemon-final.err"
    proc = start_daemon(config, err)
    end = (max(archived_segments(node_dir)) + 1, 0, 0)
    try:
        wait_for(lambda: set(positions_of(config).values()) == {end}, 120, "both at the end")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    expected = wal_events(node_dir)
    check_jsonl(everything, expected)
    check_jsonl(users, [e for e in expected if e["cache"].startswith("user")])
    assert not cdc_links(node_dir)


def whole_lines(path: Path) -> list[dict[str, Any]]:
    """The whole JSON lines of a jsonl file a SIGKILL may have cut (its last line may be partial)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_lost_links_move_every_consumer_past_the_gap(tmp_path: Path) -> None:
    """After a gap in the CDC dir, `cdcd control delete-lost-segment-links` moves every consumer's position to the
    start of the newest run, not only default's: both then deliver exactly the entries after the gap."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=10)
    config = fanout_config(tmp_path / "f.toml", node_dir, {"b": {"kind": "null"}}, default={"kind": "null"})
    loaded = load_daemon_config(config, environ={})
    with Daemon(loaded, {"default": Counting(), "b": Counting()}) as daemon:
        daemon.sync_once()
    make_node(node_dir, segments=3, tx_per_segment=10, first_tx=20)
    links = sorted(cdc_links(node_dir))
    cdc_links(node_dir)[links[0]].unlink()  # the first new segment's link is lost
    res = cdcd("control", "delete-lost-segment-links", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    run_start = links[1]
    assert set(positions_of(config).values()) == {(run_start, 0, 0)}
    a, b = Counting(), Counting()
    with Daemon(loaded, {"default": a, "b": b}) as daemon:
        daemon.sync_once()
    assert a.events == b.events == len([e for e in wal_events(node_dir) if e["pos"][0] >= run_start])


def test_a_consumer_down_past_its_cap_is_invalidated_while_retrying(tmp_path: Path) -> None:
    """A consumer whose target stays down (retried for up to 10 minutes) while a live node writes: once it holds
    back more than max_retained_bytes it is invalidated at once, mid-retry, with one line naming it, its position
    and the way back; the CDC dir stays bounded, the other consumer delivers everything, and the daemon's exit at
    SIGTERM is 7 naming the consumer."""
    (tmp_path / "outagesink.py").write_text(OUTAGE)
    node_dir = tmp_path / "node"
    down = tmp_path / "down"
    down.touch()
    live = tmp_path / "live.jsonl"
    cap = 256 * 1024  # four of the writer's 64 KiB segments
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "late": {
                "kind": "python",
                "class": "outagesink:Outage",
                "options": {"path": str(tmp_path / "late.jsonl"), "down": str(down)},
                "retry_timeout_s": 600,
                "max_retained_bytes": cap,
            }
        },
        default={"kind": "jsonl", "path": str(live)},
    )
    # The daemon first (it waits for its node), so that late falls behind while it retries, not before it starts.
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=child_env(tmp_path))
    wait_for(lambda: b"waiting_for_node" in err.read_bytes(), 60, "the daemon to wait for its node")
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=20)
    try:
        wait_for(lambda: any(e.get("event") == "consumer_retrying" for e in log_events(err)), 120, "late retrying")

        def invalidated() -> bool:
            assert proc is not None and proc.poll() is None, err.read_text()[-3000:]
            return any(e.get("event") == "consumer_invalidated" for e in log_events(err))

        wait_for(invalidated, 120, "late to be invalidated")
        wait_for(lambda: state_show(config)["consumers"]["late"]["stopped"] is not None, 30, "late stopped")
        # From here on only the live consumer holds links: the CDC dir stays small while the node writes on.
        held = sum(p.stat().st_size for p in cdc_links(node_dir).values() if p.exists())
        assert held < 4 * cap, held
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    assert proc is not None
    try:
        wait_for(lambda: positions_of(config)["default"] == (max(archived_segments(node_dir)) + 1, 0, 0), 60, "live")
    finally:
        code = stop_daemon(proc)
    assert code == 7, err.read_text()[-3000:]
    (line,) = error_lines(err)
    assert line.startswith("cdcd: error: consumer late: consumer late invalidated: it holds ")
    assert f"max_retained_bytes = {cap}" in line and "cdcd state reset --config F --consumer late" in line
    check_jsonl(live, wal_events(node_dir))
    assert not cdc_links(node_dir)
    consumers = json.loads(cdcd("state", "consumers", "--config", str(config), "--json").stdout)
    late = next(c for c in consumers if c["name"] == "late")
    assert late["invalidated"] and late["holds_bytes"] == 0
