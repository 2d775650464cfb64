"""A reader nobody here wrote: Spark Structured Streaming with Spark's own Kafka source reads the
topic the kafka sink wrote (read_committed), parses Debezium's envelope with ``from_json`` and
lands it in a table (parquet) equal, change for change, to the node's WAL."""

from __future__ import annotations

import json
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
bootstrap, jars, tmp, out_json = sys.argv[1:5]
ENVELOPE = sys.argv[5]
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
        .option("subscribe", "spark")
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


@pytest.mark.slow
def test_spark_structured_streaming_reads_the_topic(kafka_broker: Broker, tmp_path: Path) -> None:
    if not SPARK_JARS.is_dir():
        pytest.fail(f"{SPARK_JARS} missing: run `make install` (scripts/ensure-kafka.sh) first")
    node_dir = tmp_path / "node"
    make_node(node_dir, 2, 20)
    sink = KafkaSink.from_options(
        {"bootstrap_servers": kafka_broker.bootstrap, "topic": "spark", "topic_partitions": 4}, "consumer"
    )
    with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), sink) as daemon:
        while daemon.sync_once():
            pass

    # A child process: a JVM an earlier test module of this worker started cannot see data sources
    # added later through spark.jars ("Failed to find data source: kafka").
    out_json = tmp_path / "rows.json"
    jars = ",".join(str(p) for p in sorted(SPARK_JARS.glob("*.jar")))
    res = subprocess.run(
        [sys.executable, "-c", READER, kafka_broker.bootstrap, jars, str(tmp_path), str(out_json), ENVELOPE],
        capture_output=True,
        text=True,
        timeout=900,
        env={**child_env(), "PYSPARK_PYTHON": sys.executable},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out_json.read_text())

    events = wal_events(node_dir)
    ops = {"create": "c", "update": "u", "delete": "d"}
    expected = {
        tuple(e["pos"]): (e["cache"], ops[e["op"]], e["key"], e["value"] if e["op"] != "delete" else None)
        for e in events
    }
    got: dict[tuple[int, int, int], Any] = {}
    for r in rows:
        s = r["source"]
        pos = (s["segment"], s["offset"], s["entry_index"])
        assert pos not in got, f"{pos} twice"
        key = json.loads(r["k"])
        got[pos] = (s["cache"], r["op"], key["key"], None if r["after"] is None else json.loads(r["after"]))
        assert r["before"] is None and s["connector"] == "cdcd" and s["snapshot"] == "false"
    assert len(got) == len(expected) > 1000
    assert got == expected
