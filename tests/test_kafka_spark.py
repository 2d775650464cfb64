"""A reader nobody here wrote: Spark Structured Streaming with Spark's own Kafka source reads the
topics the kafka sink wrote (read_committed), parses Debezium's envelope with ``from_json`` and
lands it in a table (parquet) equal, change for change, to the node's WAL: the single topic with
a schema of a few fields, and the per-cache topics (``topic_prefix``) with the schema
docs/kafka.md publishes, taken from that page."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from tests.support.kafka import ROOT, Broker, kafka_broker
from tests.support.procs import child_env
from tests.support.wal import wal_events
from tests.support.writer import make_node

__all__ = ["kafka_broker"]

SPARK_JARS = ROOT / "var" / "kafka" / "spark-jars"
ENVELOPE = (
    "before STRING, after STRING, op STRING, ts_ms BIGINT, "
    "source STRUCT<connector: STRING, node: STRING, cache: STRING, `partition`: INT, segment: BIGINT, "
    "`offset`: BIGINT, entry_index: INT, ts_ms: BIGINT, snapshot: STRING>, "
    "transaction STRUCT<id: STRING, total_order: BIGINT, data_collection_order: BIGINT>"
)


READER = """
import json, sys
from pyspark.sql import SparkSession
from pyspark.sql.functions import col, from_json
bootstrap, jars, tmp, out_json, ENVELOPE, subscribe_option, subscribe = sys.argv[1:8]
spark = (
    SparkSession.builder.master("local[1]")
    .appName("cdcd-kafka-reader")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.jars", jars)
    .config("spark.sql.shuffle.partitions", "2")
    .config("spark.driver.memory", "1g")
    .getOrCreate()
)
try:
    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option(subscribe_option, subscribe)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .load()
        .where(col("value").isNotNull())  # tombstones
        .select(col("key").cast("string").alias("k"), from_json(col("value").cast("string"), ENVELOPE).alias("e"))
        .select("k", "e.*")
    )
    query = (
        stream.writeStream.format("parquet")
        .option("path", tmp + "/table")
        .option("checkpointLocation", tmp + "/checkpoint")
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(600)
    assert query.exception() is None
    rows = [r.asDict(recursive=True) for r in spark.read.parquet(tmp + "/table").collect()]
finally:
    spark.stop()
with open(out_json, "w") as f:
    json.dump(rows, f)
"""


def published_envelope() -> str:
    """The Spark schema docs/kafka.md publishes (its ``ENVELOPE = (...)`` block)."""
    text = (ROOT / "docs" / "kafka.md").read_text()
    m = re.search(r"^ENVELOPE = (\(\n.*?\n\))$", text, re.S | re.M)
    assert m is not None, "docs/kafka.md: no ENVELOPE = (...) block"
    schema = ast.literal_eval(m.group(1))
    assert isinstance(schema, str)
    return schema


def _read_with_spark(bootstrap: str, tmp_path: Path, schema: str, subscribe: tuple[str, str]) -> list[dict[str, Any]]:
    if not SPARK_JARS.is_dir():
        pytest.fail(f"{SPARK_JARS} missing: run `make install` (scripts/ensure-kafka.sh) first")
    # A child process: a JVM an earlier test module of this worker started cannot see data sources
    # added later through spark.jars ("Failed to find data source: kafka").
    out_json = tmp_path / "rows.json"
    jars = ",".join(str(p) for p in sorted(SPARK_JARS.glob("*.jar")))
    res = subprocess.run(
        [sys.executable, "-c", READER, bootstrap, jars, str(tmp_path), str(out_json), schema, *subscribe],
        capture_output=True,
        text=True,
        timeout=900,
        env={**child_env(), "PYSPARK_PYTHON": sys.executable},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows: list[dict[str, Any]] = json.loads(out_json.read_text())
    return rows


def _row(key: Any, value: Any) -> dict[str, Any]:
    """The envelope's row of a key and value (key columns, then the value's)."""
    row = dict(key) if isinstance(key, dict) else {"key": key}
    for k, v in (value if isinstance(value, dict) else {"value": value}).items():
        row.setdefault(k, v)
    return row


def _expected(node_dir: Path) -> dict[tuple[int, int, int], Any]:
    ops = {"create": "c", "update": "u", "delete": "d"}
    return {
        tuple(e["pos"]): (
            e["cache"],
            ops[e["op"]],
            e["key"],
            _row(e["key"], e["value"]) if e["op"] != "delete" else None,
        )
        for e in wal_events(node_dir)
    }


@pytest.mark.chaos  # the per-cache test below reads the same envelope with Spark, through the docs' schema
def test_spark_structured_streaming_reads_the_topic(kafka_broker: Broker, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    make_node(node_dir, 2, 20)
    sink = KafkaSink.from_options(
        {"bootstrap_servers": kafka_broker.bootstrap, "topic": "spark", "topic_partitions": 4}, "consumer"
    )
    with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), sink) as daemon:
        while daemon.sync_once():
            pass
    rows = _read_with_spark(kafka_broker.bootstrap, tmp_path, ENVELOPE, ("subscribe", "spark"))
    expected = _expected(node_dir)
    got: dict[tuple[int, int, int], Any] = {}
    for r in rows:
        s = r["source"]
        pos = (s["segment"], s["offset"], s["entry_index"])
        assert pos not in got, f"{pos} twice"
        key = json.loads(r["k"])
        got[pos] = (s["cache"], r["op"], key["key"], None if r["after"] is None else json.loads(r["after"]))
        assert r["before"] is None or json.loads(r["before"]) == {"key": key["key"]}
        assert s["connector"] == "cdcd" and s["snapshot"] == "false"
    assert len(got) == len(expected) > 1000
    assert got == expected


@pytest.mark.slow
def test_spark_reads_the_per_cache_topics_with_the_published_schema(kafka_broker: Broker, tmp_path: Path) -> None:
    """The per-cache topics (and a transaction topic beside them, left out by the pattern), read
    with docs/kafka.md's schema: every field the docs name is there and right."""
    node_dir = tmp_path / "node"
    make_node(node_dir, 2, 20)
    options = {
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": "sp",
        "topic_partitions": 4,
        "transaction_metadata": True,
        "db": "dc1",
    }
    with Daemon(
        DaemonConfig(node_dir=str(node_dir), metrics_address=""), KafkaSink.from_options(options, "consumer")
    ) as d:
        while d.sync_once():
            pass
    node_id = (node_dir / "node_id").read_text().strip()
    rows = _read_with_spark(
        kafka_broker.bootstrap, tmp_path, published_envelope(), ("subscribePattern", r"sp\.(?!transaction$).+")
    )
    expected = _expected(node_dir)
    got: dict[tuple[int, int, int], Any] = {}
    for r in rows:
        s = r["source"]
        pos = (s["segment"], s["offset"], s["entry_index"])
        assert pos not in got, f"{pos} twice"
        key = json.loads(r["k"])  # the row's key columns
        after = None if r["after"] is None else json.loads(r["after"])
        got[pos] = (s["table"], r["op"], key["key"], after)
        assert (s["name"], s["db"], s["node"], s["connector"], s["cache"]) == ("sp", "dc1", node_id, "cdcd", s["table"])
        assert r["before"] is None if r["op"] != "d" else json.loads(r["before"]) == key
        assert (
            s["ts_us"] // 1000 == s["ts_ms"] and s["ts_ns"] // 1000 == s["ts_us"] and r["ts_ns"] // 1000 == r["ts_us"]
        )
        assert s["primary"] is True and s["cache_version"]["cluster_id"] >= 0 and s["snapshot"] == "false"
        assert r["transaction"]["id"] == f"{node_id}:{s['segment']}:{s['offset']}"
    assert len(got) == len(expected) > 1000
    assert got == expected
