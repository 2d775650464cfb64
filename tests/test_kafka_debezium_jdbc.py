"""Debezium compatibility proven by Debezium's own consumer: its JDBC sink connector
(``io.debezium:debezium-connector-jdbc``), in Kafka Connect standalone, reads the per-cache topics
the kafka sink writes (``topic_prefix``, ``schemas = true``) into PostgreSQL. After inserts,
updates, deletes, multi-cache transactions and a resend (to a target that lost a table's rows),
every PostgreSQL table equals its cache, row for row.

Jars: ``scripts/ensure-kafka-connect.sh`` (``make install``; the fixture runs it too). PostgreSQL:
``scripts/ensure-postgres.sh``'s packages, a private cluster (``tests.support.pg_cluster``)
listening on 127.0.0.1 for the JDBC driver.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from cdcd.kafka.topics import suffix_of
from cdcd.node import Node
from tests.support.kafka import ROOT, Broker, kafka_broker
from tests.support.pg_cluster import PgCluster, PgUnavailable, ensure_postgres
from tests.support.ports import free_port
from tests.support.procs import reap

__all__ = ["kafka_broker"]

CONNECT_LIBS = ROOT / "var" / "kafka" / "connect-libs"
CONNECT_PLUGINS = ROOT / "var" / "kafka" / "connect-plugins"
PREFIX = "dbz"
CACHES = ("orders", "users", "stock", "line items")
"""``stock``: composite map keys and non-record values; ``line items``: a name Kafka refuses."""


def _ensure_connect() -> None:
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ensure-kafka-connect.sh")], capture_output=True, text=True, timeout=1200
    )
    assert res.returncode == 0, f"scripts/ensure-kafka-connect.sh failed: {res.stderr[-3000:]}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[PgCluster]:
    try:
        bin_dir = ensure_postgres(install=True)
    except PgUnavailable as exc:
        pytest.fail(f"PostgreSQL: {exc} (scripts/ensure-postgres.sh installs it)")
    # in the system's temp dir: as root the server runs as "postgres", which cannot enter pytest's
    pg = PgCluster(bin_dir, port=free_port())
    pg.settings["listen_addresses"] = "'127.0.0.1'"  # the JDBC driver speaks TCP only
    with pg:
        yield pg


class Connect:
    """Kafka Connect standalone running Debezium's JDBC sink connector, on 127.0.0.1."""

    def __init__(self, work: Path, broker: Broker, pg: PgCluster) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "connect.log"
        worker = {
            "bootstrap.servers": broker.bootstrap,
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "key.converter.schemas.enable": "true",
            "value.converter.schemas.enable": "true",
            # cdcd.entry is MessagePack: passed through as bytes, not parsed as text
            "header.converter": "org.apache.kafka.connect.converters.ByteArrayConverter",
            "consumer.isolation.level": "read_committed",
            "consumer.auto.offset.reset": "earliest",
            "offset.storage.file.filename": str(work / "offsets"),
            "offset.flush.interval.ms": "1000",
            "plugin.path": str(CONNECT_PLUGINS),
            "listeners": f"http://127.0.0.1:{free_port()}",
        }
        connector = {
            "name": "cdcd-jdbc",
            "connector.class": "io.debezium.connector.jdbc.JdbcSinkConnector",
            "tasks.max": "1",
            # the data topics: not the transaction topic (nor the metadata topic, the bare prefix)
            "topics.regex": rf"{PREFIX}\.(?!transaction$).+",
            "connection.url": f"jdbc:postgresql://127.0.0.1:{pg.port}/{pg.dbname}",
            "connection.username": pg.user,
            "connection.password": "unused",
            "insert.mode": "upsert",
            "delete.enabled": "true",
            "primary.key.mode": "record_key",
            "schema.evolution": "basic",
            # the table of topic dbz.<suffix> is dbz_<suffix> (the default naming puts _ for .)
            "collection.name.format": "${topic}",
            "quote.identifiers": "true",
        }
        (work / "worker.properties").write_text("".join(f"{k}={v}\n" for k, v in worker.items()))
        (work / "connector.properties").write_text("".join(f"{k}={v}\n" for k, v in connector.items()))
        (work / "log4j2.properties").write_text(
            "rootLogger.level=INFO\nrootLogger.appenderRef.file.ref=file\n"
            "appender.file.type=File\nappender.file.name=file\n"
            f"appender.file.fileName={self.log}\n"
            "appender.file.layout.type=PatternLayout\nappender.file.layout.pattern=[%d] %p %m (%c)%n\n"
        )
        self.cmd = [
            "java", "-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={work / 'log4j2.properties'}",
            "-cp", f"{CONNECT_LIBS}/*", "org.apache.kafka.connect.cli.ConnectStandalone",
            str(work / "worker.properties"), str(work / "connector.properties"),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.log.with_suffix(".out"), "wb")  # the child holds it from here
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()

    def tail(self) -> str:
        text = ""
        for path in (self.log, self.log.with_suffix(".out")):
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()
                text += (
                    f"--- {path.name}\n" + "\n".join(ln for ln in lines if "ERROR" in ln or "Exception" in ln)[-4000:]
                )
        return text

    def failed(self) -> bool:
        """The connector's task died (Connect keeps running without it)."""
        return self.log.exists() and "unrecoverable exception" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                reap(self.proc)


def _rows(cache: str, items: list[tuple[Any, Any]]) -> dict[str, dict[str, Any]]:
    """A cache as the envelope's rows (key columns, then the value's), keyed by canonical JSON."""
    out = {}
    for key, value in items:
        row = dict(key) if isinstance(key, dict) else {"key": key}
        for k, v in (value if isinstance(value, dict) else {"value": value}).items():
            row.setdefault(k, v)
        out[json.dumps({k: row[k] for k in (key if isinstance(key, dict) else {"key": key})}, sort_keys=True)] = row
    return out


def table_of(cache: str) -> str:
    """The table Debezium's JDBC sink makes for a cache's topic (``${topic}``, dots as ``_``)."""
    return f"{PREFIX}_{suffix_of(cache)}".replace(".", "_")


def _table(pg: PgCluster, cache: str, key_columns: list[str]) -> dict[str, dict[str, Any]] | None:
    table = table_of(cache)
    exists = pg.sql(f"SELECT to_regclass('public.\"{table}\"') IS NOT NULL").strip()
    if exists != "t":
        return None
    out = {}
    for line in pg.sql(f'SELECT row_to_json(t) FROM "{table}" t').splitlines():
        row = json.loads(line)
        out[json.dumps({k: row[k] for k in key_columns}, sort_keys=True)] = row
    return out


def _key_columns(cache: str) -> list[str]:
    return ["warehouse", "sku"] if cache == "stock" else ["key"]


def _sync(node_dir: Path, options: dict[str, Any]) -> None:
    with Daemon(
        DaemonConfig(node_dir=str(node_dir), metrics_address=""), KafkaSink.from_options(options, "consumer")
    ) as d:
        while d.sync_once():
            pass


def _wait_equal(pg: PgCluster, node_dir: Path, connect: Connect, what: str, timeout_s: float = 300) -> None:
    with Node.open(node_dir) as node:
        want = {c: _rows(c, list(node.cache(c).items())) for c in CACHES}
    deadline = time.monotonic() + timeout_s
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert connect.proc is not None and connect.proc.poll() is None, f"Connect exited\n{connect.tail()}"
        assert not connect.failed(), f"the JDBC sink's task failed\n{connect.tail()}"
        got = {c: _table(pg, c, _key_columns(c)) for c in CACHES}
        if got == want:
            return
        time.sleep(0.5)
    diff = {
        c: {
            "missing": sorted(set(want[c]) - set(got[c] or {}))[:5],
            "extra": sorted(set(got[c] or {}) - set(want[c]))[:5],
            "differ": [k for k in want[c] if got[c] and k in got[c] and got[c][k] != want[c][k]][:5],
        }
        for c in CACHES
    }
    pytest.fail(f"{what}: PostgreSQL differs from the node after {timeout_s:g} s: {diff}\n{connect.tail()}")


@pytest.mark.slow
def test_debezium_jdbc_sink_applies_the_topics(kafka_broker: Broker, postgres: PgCluster, tmp_path: Path) -> None:
    _ensure_connect()
    node_dir = tmp_path / "node"
    options = {
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": PREFIX,
        "topic_partitions": 4,
        "schemas": True,
        "transaction_metadata": True,
    }
    with Node.open(node_dir, wal_force_archive_timeout_ms=0, partitions=16) as node:
        orders, users, stock, lines = (node.cache(c) for c in CACHES)
        orders.put_all({k: {"total": k * 1.5, "item": f"item-{k}", "qty": k, "paid": k % 2 == 0} for k in range(60)})
        users.put_all({f"user-{k}": {"name": f"name {k}", "age": 20 + k} for k in range(30)})
        for w in ("north", "south"):
            for s in range(10):
                stock.put(_wk(w, s), s * 10)
        lines.put_all({k: {"order": k // 3, "sku": f"s{k}"} for k in range(20)})
        for k in range(0, 60, 4):  # updates
            orders.put(k, {"total": 0.25, "item": "changed", "qty": -k, "paid": True})
        for k in range(1, 60, 5):  # deletes
            orders.remove(k)
        with node.transaction() as tx:  # one node transaction over three caches
            tx.put("users", "user-0", {"name": "renamed", "age": 99})
            tx.remove("users", "user-1")
            tx.put("stock", _wk("north", 3), 333)
            tx.remove("line items", 5)
            tx.put("orders", 1000, {"total": 1.0, "item": "new", "qty": 1, "paid": False})
        node.force_archive()

    connect = Connect(tmp_path / "connect", kafka_broker, postgres)
    try:
        _sync(node_dir, options)
        connect.start()
        _wait_equal(postgres, node_dir, connect, "after inserts, updates, deletes")

        # the target loses a table's rows; a resend of the cache rebuilds them (snapshot reads,
        # op "r"), and changes written after it still apply on top
        postgres.sql(f'DELETE FROM "{table_of("users")}"; DELETE FROM "{table_of("line items")}" WHERE "key" < 10')
        with Node.open(node_dir, wal_force_archive_timeout_ms=0, partitions=16) as node:
            assert node.resend("users") == 29
            assert node.resend("line items") == 19
            node.cache("users").put("user-2", {"name": "after resend", "age": 1})
            node.cache("users").remove("user-3")
            node.force_archive()
        _sync(node_dir, options)
        _wait_equal(postgres, node_dir, connect, "after the resend")
    finally:
        connect.stop()
    assert suffix_of("line items") == "line_20items"


def _wk(warehouse: str, sku: int) -> dict[str, Any]:
    return {"warehouse": warehouse, "sku": sku}
