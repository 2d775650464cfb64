"""``caches`` and ``exclude_caches`` on every consumer (docs/consumers.md, "Choosing caches").

One workload of five caches (one destroyed, one in a transaction with the others) goes through every
consumer kind with include and exclude globs; each test checks the exact events delivered, entry by
entry against the WAL, and that a cache left out is neither counted (``cdcd_daemon_events_total``)
nor announced (``on_cache_change``, ``<lake>/_cdcd_caches.json``, the Kafka metadata topic).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from cdcd.config import CacheFilter, ConfigError
from cdcd.consumer import Consumer
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.sinks import load_consumer
from cdcd.sinks.null import NullConsumer
from tests.support.config import write_daemon_config
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.procs import cdcd, wait_for
from tests.support.wal import read_jsonl, wal_events, whole_jsonl

__all__ = ["kafka_broker"]  # the fixture, used by name

CACHES = ["orders", "orders_eu", "people", "Private", "tmp_1"]

FILTERS = [
    pytest.param({"caches": ["orders*", "people"], "exclude_caches": ["*_eu"]}, ["orders", "people"], id="include"),
    pytest.param({"exclude_caches": ["tmp_?", "[A-Z]*"]}, ["orders", "orders_eu", "people"], id="exclude"),
]


def write_workload(node: Node) -> None:
    """Puts in every cache, a transaction over all of them, removes, and ``tmp_1`` destroyed."""
    for name in CACHES:
        node.cache(name)
    for k in range(4):
        for name in CACHES:
            node.cache(name).put(k, {"cache": name, "k": k})
    with node.transaction() as tx:
        for name in CACHES:
            tx.put(name, 100, "in a transaction")
        tx.remove("orders", 1)
    node.cache("people").remove(2)
    node.cache("tmp_1").remove(3)
    assert node.destroy_cache("tmp_1")


def reference(node_dir: Path, caches: Sequence[str]) -> list[tuple[str, str, Any, tuple[int, int, int]]]:
    return [(e["cache"], e["op"], e["key"], tuple(e["pos"])) for e in wal_events(node_dir) if e["cache"] in caches]


def events_metric(cache: str) -> float:
    return sum(
        REGISTRY.get_sample_value("cdcd_daemon_events_total", {"cache": cache, "op": op}) or 0.0
        for op in ("create", "update", "delete")
    )


def run_daemon(node_dir: Path, table: dict[str, Any], consumer: Consumer | None = None) -> Consumer:
    """The consumer the table describes (or ``consumer``), fed by a daemon over the whole WAL; checks
    that the daemon counted exactly the events it delivered, per cache."""
    built = consumer or load_consumer(table, "consumer").consumer
    before = {name: events_metric(name) for name in CACHES}
    with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer=table), built) as daemon:
        delivered = daemon.sync_once()
    selected = CacheFilter.from_table(table, "consumer")
    counted = {name: events_metric(name) - before[name] for name in CACHES}
    expected = {name: len(reference(node_dir, [name])) if selected(name) else 0 for name in CACHES}
    assert counted == expected
    assert delivered == sum(expected.values())
    return built


@pytest.fixture
def source(tmp_path: Path) -> Path:
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0, partitions=8) as node:
        write_workload(node)
        node.force_archive()
    return node_dir


# --- the filter itself ----------------------------------------------------------------------------------
def test_names_and_globs_match_whole_names_case_sensitively_and_exclusion_wins() -> None:
    f = CacheFilter(["orders", "peo?le", "t[ab]*", "x[!0-9]"], ["*_eu", "tb?"])
    cases = {
        "orders": True,
        "orders2": False,  # a name matches the whole name only
        "Orders": False,  # case-sensitive
        "people": True,
        "peoople": False,
        "ta": True,
        "tab_eu": False,  # excluded
        "tb1": False,
        "tb12": True,
        "xa": True,
        "x1": False,
        "orders_eu": False,
    }
    assert {name: f(name) for name in cases} == cases
    assert CacheFilter().everything and all(CacheFilter()(n) for n in cases)
    only_out = CacheFilter([], ["*"])
    assert not any(only_out(n) for n in cases)


@pytest.mark.parametrize(
    ("table", "error"),
    [
        (
            # a regex globs cannot say exactly (one they can is read with a warning: test_versions_and_config.py)
            {"caches": "people|orders+"},
            """key 'caches': one regular expression ('people|orders+') is the old form, no \
longer read; write a list of names or glob patterns, e.g. caches = ["orders", "people_*"], and exclude_caches = \
[...] for names to leave out""",
        ),
        (
            {"exclude_caches": "tmp_.*"},
            """key 'exclude_caches': one regular expression ('tmp_.*') is the old form, no \
longer read; write a list of names or glob patterns, e.g. exclude_caches = ["tmp_*"]""",
        ),
        ({"caches": "(?!x).*"}, 'e.g. caches = ["orders", "people_*"]'),
        ({"caches": ["ok", "bad[name"]}, "key 'caches': bad pattern 'bad[name': '[' without a closing ']'"),
        ({"exclude_caches": ["[!]"]}, "key 'exclude_caches': bad pattern '[!]': '[' without a closing ']'"),
        ({"exclude_caches": [""]}, "key 'exclude_caches': an empty pattern matches no cache"),
        ({"caches": [1]}, "key 'caches': expected names or glob patterns (strings), got 1"),
        ({"caches": {"a": 1}}, "key 'caches': expected a list of names or glob patterns, got dict"),
    ],
    ids=[
        "old-regex",
        "old-regex-exclude",
        "old-regex-complex",
        "unclosed",
        "unclosed-negated",
        "empty",
        "int",
        "table",
    ],
)
def test_bad_filters_are_one_line_naming_the_key(table: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_consumer({"kind": "null", **table}, "cdcd.toml: consumer")
    message = str(caught.value)
    assert message.startswith("cdcd.toml: consumer: key '") and "\n" not in message
    assert error in message


@pytest.mark.parametrize("key", ["caches", "exclude_caches"])
def test_cli_exits_2_naming_the_key(tmp_path: Path, source: Path, key: str) -> None:
    """``cdcd run``, ``cdcd node run`` (its realtime consumer) and ``cdcd kafka-to-node`` refuse a bad pattern before
    doing anything: exit 2, one line naming the file and the key."""
    config = write_daemon_config(tmp_path / "cdcd.toml", source, {"kind": "null", key: ["ok", "bad["]})
    run = cdcd("run", "--config", str(config))
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith(f"{config}: consumer: key '{key}': bad pattern 'bad[': '[' without a closing ']'")
    )
    assert not (source / "cdcd-state").exists() and not (source / "cdcd.lock").exists()

    node_config = tmp_path / "node.toml"
    node_config.write_text(
        f'node_dir = "{tmp_path / "n2"}"\nmetrics_address = ""\n'
        f'[realtime_consumer]\nkind = "null"\n{key} = "orders|people+"\n'
    )
    node = cdcd("node", "run", "--config", str(node_config))
    assert node.returncode == 2, node.stderr
    (line,) = node.stderr.strip().splitlines()
    assert f"key 'realtime_consumer.{key}': one regular expression ('orders|people+') is the old form" in line
    assert not (tmp_path / "n2").exists()

    k2n_config = tmp_path / "k2n.toml"
    k2n_config.write_text(
        f'bootstrap_servers = "127.0.0.1:9"\ntopic = "t"\ntarget = "127.0.0.1:9"\ntoken_file = "{tmp_path / "tok"}"\n'
        f'{key} = [""]\n'
    )
    k2n = cdcd("kafka-to-node", "--config", str(k2n_config))
    assert k2n.returncode == 2, k2n.stderr
    (line,) = k2n.stderr.strip().splitlines()
    assert line.endswith(f"{k2n_config}: key '{key}': an empty pattern matches no cache")


# --- every consumer kind --------------------------------------------------------------------------------
class Recorder(Consumer):
    """A user class (``kind = "python"``): every event and every announcement, in memory."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any, tuple[int, int, int]]] = []
        self.announced: list[str] = []
        self.destroyed: list[int] = []

    def on_cache_change(self, caches: Sequence[Any]) -> None:
        self.announced.extend(c.name for c in caches)

    def on_cache_destroy(self, cache_ids: Sequence[int]) -> None:
        self.destroyed.extend(cache_ids)

    def on_events(self, batch: Any) -> bool:
        for ev in batch:
            p = ev.position
            self.events.append((ev.cache_name, ev.op_name, ev.key, (p.segment, p.offset, p.entry_index)))
        return True


@pytest.mark.parametrize(("keys", "delivered"), FILTERS)
def test_python_consumer(source: Path, keys: dict[str, Any], delivered: list[str]) -> None:
    table = {"kind": "python", "class": "tests.test_cache_filters:Recorder", **keys}
    consumer = run_daemon(source, table)
    assert isinstance(consumer, Recorder)
    assert consumer.events == reference(source, delivered)
    assert sorted(set(consumer.announced)) == sorted(delivered)
    assert consumer.destroyed == []  # tmp_1 is left out by both filters: never announced, never destroyed


@pytest.mark.parametrize(("keys", "delivered"), FILTERS)
def test_jsonl_consumer(tmp_path: Path, source: Path, keys: dict[str, Any], delivered: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    run_daemon(source, {"kind": "jsonl", "path": str(out), **keys})
    got = [(e["cache"], e["op"], e["key"], tuple(e["pos"])) for e in read_jsonl(out)]
    assert got == reference(source, delivered)


@pytest.mark.parametrize(("keys", "delivered"), FILTERS)
def test_null_consumer(source: Path, keys: dict[str, Any], delivered: list[str]) -> None:
    consumer = run_daemon(source, {"kind": "null", **keys})
    assert isinstance(consumer, NullConsumer)
    assert consumer.events == len(reference(source, delivered))


@pytest.mark.parametrize(("keys", "delivered"), FILTERS)
def test_lake_consumer(tmp_path: Path, source: Path, keys: dict[str, Any], delivered: list[str]) -> None:
    from deltalake import DeltaTable

    lake = tmp_path / "lake"
    table = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", **keys}
    run_daemon(source, {**table, "compact_interval_s": 0, "optimize_interval_s": 0})
    rows = DeltaTable(str(lake / "changes")).to_pyarrow_table().to_pylist()
    got = sorted(
        (
            (r["cache"], r["op"], json.loads(r["key"]), (r["wal_segment"], r["wal_offset"], r["wal_index"]))
            for r in rows
        ),
        key=lambda e: e[3],
    )
    assert got == reference(source, delivered)
    announced = json.loads((lake / "_cdcd_caches.json").read_text())
    assert announced.pop("format") == 1  # the registry's format version (cdcd/formats.py)
    assert sorted(v["name"] for v in announced.values()) == sorted(delivered)


def test_replication_consumer(tmp_path: Path, source: Path) -> None:
    from tests.support.replication import open_target, token_file

    target = open_target(tmp_path)
    try:
        assert target.replication is not None
        table = {
            "kind": "replication",
            "target": f"127.0.0.1:{target.replication.port}",
            "token_file": str(token_file(tmp_path)),
            "caches": ["*e*"],  # orders, orders_eu, people, Private
            "exclude_caches": ["P*", "*_eu"],
        }
        run_daemon(source, table)
        assert sorted(target.caches()) == ["orders", "people"]
        with Node.open(source) as node:
            for name in ("orders", "people"):
                assert dict(target.cache(name).items()) == dict(node.cache(name).items())
    finally:
        target.close()


def test_kafka_sink_and_kafka_to_node(kafka_broker: Broker, tmp_path: Path, source: Path) -> None:
    """The sink sends and announces (metadata topic) only the chosen caches; kafka-to-node, with its own
    filter, applies only its chosen ones of those."""
    from cdcd.kafka.options import KafkaToNodeOptions
    from cdcd.kafka.to_node import KafkaToNode
    from tests.support.replication import open_target, token_file

    topic = "filtered"
    keys = {"caches": ["orders*", "people", "tmp_?"], "exclude_caches": ["tmp_*"]}
    table = {"kind": "kafka", "bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "topic_partitions": 2}
    run_daemon(source, {**table, **keys})
    delivered = ["orders", "orders_eu", "people"]
    data = [json.loads(m.value()) for ms in read_topic(kafka_broker.bootstrap, topic).values() for m in ms if m.value()]
    ops = {"c": "create", "u": "update", "d": "delete"}
    got = sorted(
        (
            v["source"]["cache"],
            ops[v["op"]],
            (v["source"]["segment"], v["source"]["offset"], v["source"]["entry_index"]),
        )
        for v in data
    )
    assert got == sorted((c, op, pos) for c, op, _key, pos in reference(source, delivered))
    meta = [
        json.loads(m.value()) for ms in read_topic(kafka_broker.bootstrap, f"{topic}.metadata").values() for m in ms
    ]
    assert sorted(r["name"] for r in meta if r["op"] == "create") == delivered
    assert [r for r in meta if r["op"] != "create"] == []

    target = open_target(tmp_path)
    try:
        assert target.replication is not None
        opts = KafkaToNodeOptions.load(
            {
                "bootstrap_servers": kafka_broker.bootstrap,
                "topic": topic,
                "target": f"127.0.0.1:{target.replication.port}",
                "token_file": str(token_file(tmp_path)),
                "metrics_address": "",
                "caches": ["orders*"],
                "exclude_caches": ["orders_?u"],
            },
            "k2n.toml",
        )
        app = KafkaToNode(opts, "k2n.toml")
        runner = threading.Thread(target=app.run, daemon=True)
        runner.start()
        with Node.open(source) as node:
            expected = dict(node.cache("orders").items())
        try:
            wait_for(lambda: "orders" in target.caches() and dict(target.cache("orders").items()) == expected, 120,
                     "kafka-to-node to apply orders")  # fmt: skip
        finally:
            app.stop()
            runner.join(60)
        assert sorted(target.caches()) == ["orders"]
    finally:
        target.close()


# --- the node's realtime consumer ------------------------------------------------------------------------
@pytest.mark.parametrize(("keys", "delivered"), FILTERS)
def test_realtime_consumer(tmp_path: Path, keys: dict[str, Any], delivered: list[str]) -> None:
    """The node's realtime worker applies the same filter: the events, and the caches it announces."""
    node_dir, out = tmp_path / "node", tmp_path / "rt.jsonl"
    consumer = {"kind": "python", "class": "tests.test_delivery:Recorder", "options": {"path": str(out)}, **keys}
    with Node.open(
        node_dir,
        realtime_cdc=True,
        realtime_consumer=consumer,
        cdc_enabled=False,
        wal_force_archive_timeout_ms=0,
        realtime_commit_record_interval_ms=0,
        partitions=8,
    ) as node:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        write_workload(node)
        node.cache("people").put(999, "last")  # the last event: every filter delivers it
        node.flush()
        wait_for(lambda: any(e.get("key") == 999 for e in whole_jsonl(out)), 60,
                 "the realtime consumer to get the last event")  # fmt: skip
    lines = read_jsonl(out)
    got = [(e["cache"], e["op"], e["key"], tuple(e["pos"])) for e in lines if "pos" in e]
    assert got == reference(node_dir, delivered)
    assert sorted({c for e in lines for c in e.get("caches", [])}) == sorted(delivered)
    assert [e for e in lines if "destroyed" in e] == []
