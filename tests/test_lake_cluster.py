"""Many nodes, one Delta lake on an object store: real MinIO on loopback, one `cdcd run` daemon per node
(one with the Spark writer on a Spark standalone cluster), SIGKILLed daemons, a SIGKILLed Spark worker
and a stopped store, then `cdcd lake compact` on the cluster through Spark's s3a and `lake verify`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from cdcd.lake.landing.delta import app_id, decode_version
from cdcd.lake.landing.spark_write import TASK_WRITTEN
from cdcd.lake.spark import S3A_ARTIFACTS, jar_name, jars_dir
from cdcd.lake.storage import LakeLocation, StorageOptions
from cdcd.node.identity import read_node_id
from tests.support.lake import caught_up, position, write_config
from tests.support.procs import cdcd, child_env, log_events, start_daemon, stop_daemon, wait_for
from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer, SparkStandalone
from tests.support.wal import wal_events, wal_records
from tests.support.writer import start_writer, writer_count

pytestmark = pytest.mark.skipif(not MINIO_BIN.exists(), reason="MinIO not built: run make install")

LAKE = "s3://lake/cluster"
NODES = 3
WRITES = 1500
"""Transactions per node (50 entries each), written while the daemons run."""


@pytest.fixture
def minio(tmp_path: Path) -> Iterator[MinioServer]:
    server = MinioServer(tmp_path / "minio" / "data")
    server.start()
    server.create_bucket("lake")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[SparkStandalone]:
    cluster = SparkStandalone(tmp_path / "spark", workers=2, cores_per_worker=1, memory="1g")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def storage_table(server: MinioServer, **over: Any) -> dict[str, Any]:
    return {"endpoint": server.endpoint, "path_style": True, **over}


def creds_env(key_id: str = MINIO_USER, secret: str = MINIO_PASSWORD) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    return {**env, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}


def lake_cli(server: MinioServer, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    where = ["--lake", LAKE, "--storage-endpoint", server.endpoint, "--storage-path-style"]
    return cdcd("lake", args[0], *where, *args[1:], env=creds_env(), timeout=timeout)


def lake_table(server: MinioServer, table: str = "changes") -> DeltaTable:
    loc = LakeLocation(LAKE, StorageOptions(**storage_table(server)), env=creds_env())
    return DeltaTable(loc.uri(table), storage_options=loc.delta_options)


# --- refused at start -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bucket", "secret", "expected"),
    [("missing", MINIO_PASSWORD, "s3://missing at http://127.0.0.1:"), ("lake", "wrong-secret-9f3", "credentials")],
)
def test_a_store_it_cannot_use_stops_the_daemon_with_one_line_and_no_state(
    tmp_path: Path, minio: MinioServer, bucket: str, secret: str, expected: str
) -> None:
    node_dir = tmp_path / "node"
    writer = start_writer(tmp_path, node_dir, count=20)
    assert writer.wait(120) == 0
    consumer = {
        "kind": "lake",
        "lake_path": f"s3://{bucket}/x",
        "storage": storage_table(minio, access_key_id=MINIO_USER, secret_access_key=secret),
    }
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=creds_env("nobody", "nothing"))
    assert proc.wait(120) != 0
    text = err.read_text()
    last = text.strip().splitlines()[-1]
    assert expected in last and "lake storage" in last, text[-2000:]
    assert secret not in text and MINIO_PASSWORD not in text
    assert position(config) is None
    status = cdcd("state", "show", "--config", str(config), "--json", env=creds_env())
    assert secret not in status.stdout + status.stderr


# --- three nodes, one lake --------------------------------------------------------------------------------
def landed(server: MinioServer) -> Any:
    t = lake_table(server).to_pyarrow_table(columns=["source_node", "wal_segment", "wal_offset", "wal_index", "op"])
    return t


@pytest.mark.chaos  # the suite proves its parts faster: test_lake.py's standalone cluster, the outage tests
def test_three_nodes_land_exactly_once_through_kills_and_a_store_outage(
    tmp_path: Path, minio: MinioServer, spark_cluster: SparkStandalone
) -> None:
    """Three nodes under load, each with its own daemon, into one lake on MinIO; daemon 1 writes with Spark
    on a standalone cluster (master + two one-core workers). Daemon 0 is SIGKILLed and restarted once it has
    committed; the Spark worker running daemon 1's first write task is SIGKILLed (with its executor) after
    the task wrote its files and before it returned them, and started again; MinIO is stopped for a while
    and started again (a daemon whose batch failed exits non-zero and is restarted, as systemd would).
    Every entry of every node is in the lake exactly once (per source application transaction), the killed
    task's files are orphans no commit names, and after `lake compact` on the cluster `state` is the union
    of the nodes (`lake verify` with three `--node-dir`).

    Only daemon 1 uses the cluster: its application takes both cores (one executor per worker, so a
    killed worker leaves one to retry on), and `lake compact` runs as the next application once the
    daemons stopped; a second writer application would wait for cores the first holds."""
    t0 = time.monotonic()
    dirs = [tmp_path / f"n{i}" for i in range(NODES)]
    writers = []
    for i, d in enumerate(dirs):
        (tmp_path / f"w{i}").mkdir()
        writers.append(start_writer(tmp_path / f"w{i}", d, count=WRITES, pause_ms=40))
    wait_for(lambda: all((d / "cdc").is_dir() for d in dirs), 120, "the nodes' cdc dirs")
    # Credentials three ways: the [consumer.storage] table, the environment, an AWS credentials file.
    cred_file = tmp_path / "aws-credentials"
    cred_file.write_text(f"[lake]\naws_access_key_id = {MINIO_USER}\naws_secret_access_key = {MINIO_PASSWORD}\n")
    storages = [
        storage_table(minio, access_key_id=MINIO_USER, secret_access_key=MINIO_PASSWORD),
        storage_table(minio),
        storage_table(minio, credentials_file=str(cred_file), profile="lake"),
    ]
    envs = [creds_env("nobody", "nothing"), creds_env(), creds_env("", "")]
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    on_cluster = {
        "writer": "spark",
        "spark_master": spark_cluster.master_url,
        "spark_conf": {
            "spark.cores.max": "2",
            "spark.executor.cores": "1",
            "spark.executor.memory": "512m",
            "spark.executorEnv.CDCD_FAILPOINTS": f"{TASK_WRITTEN}=pause:{pause_dir}",
        },
    }
    configs, errs = [], []
    for i, d in enumerate(dirs):
        consumer = {"kind": "lake", "lake_path": LAKE, "writer": "deltalake", "storage": storages[i]}
        if i == 1:
            consumer.update(on_cluster)
        configs.append(write_config(tmp_path / f"cdcd{i}.toml", d, consumer, batch_max_events=2000))
        errs.append(tmp_path / f"daemon{i}.err")
    daemons = [start_daemon(c, e, env=envs[i]) for i, (c, e) in enumerate(zip(configs, errs, strict=True))]
    restarts = [0] * NODES

    def supervise() -> None:
        for i, p in enumerate(daemons):
            if p.poll() is not None:
                restarts[i] += 1
                assert restarts[i] <= 5, errs[i].read_text()[-3000:]
                daemons[i] = start_daemon(configs[i], errs[i], env=envs[i])

    try:
        # SIGKILL daemon 0 once it has committed something, restart it.
        wait_for(lambda: position(configs[0]) is not None, 180, "daemon 0 to commit")
        daemons[0].send_signal(signal.SIGKILL)
        daemons[0].wait(30)
        daemons[0] = start_daemon(configs[0], errs[0], env=envs[0])
        # SIGKILL the Spark worker (and its executor) whose task wrote daemon 1's files and has not returned.
        paused = pause_dir / TASK_WRITTEN
        wait_for(lambda: paused.is_file() and paused.read_text() != "", 300, "daemon 1's first Spark write task")
        task_pid = int(paused.read_text())
        worker = spark_cluster.worker_running(task_pid)
        assert worker is not None, f"task pid {task_pid} runs under no Spark worker"
        spark_cluster.kill_worker(worker)
        try:
            os.kill(task_pid, signal.SIGKILL)  # in the executor's Python daemon's own process group
        except ProcessLookupError:
            pass
        spark_cluster.start_worker(worker)
        # Stop the store while the nodes keep writing; start it again once each node archived more.
        before = [len(list((d / "cdc").glob("*.wal"))) for d in dirs]
        minio.stop()
        outage = time.monotonic()
        wait_for(
            lambda: (
                time.monotonic() - outage > 3
                and all(
                    len(list((d / "cdc").glob("*.wal"))) > n or w.poll() is not None
                    for d, n, w in zip(dirs, before, writers, strict=True)
                )
            ),
            120,
            "the nodes to archive during the outage",
        )
        minio.start()
        for w in writers:
            assert w.wait(300) == 0
        for i, d in enumerate(dirs):
            until = caught_up(d)

            def done(i: int = i, until: Any = until) -> bool:
                supervise()
                return bool(position(configs[i]) == until)

            wait_for(done, 300, f"daemon {i} to land {until}", 0.25)
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
        rcs = [stop_daemon(p, timeout=60) if p.poll() is None else p.returncode for p in daemons]
    assert rcs == [0] * NODES, [e.read_text()[-2000:] for e in errs]
    land_s = time.monotonic() - t0

    # Exactly once, per source: the lake's rows of each node are its WAL's data entries, once each.
    rows = landed(minio)
    total = 0
    dt = lake_table(minio)
    for d in dirs:
        node = str(read_node_id(d))
        mine = rows.filter(pc.equal(rows.column("source_node"), node))
        got = Counter(
            zip(*(mine.column(c).to_pylist() for c in ("wal_segment", "wal_offset", "wal_index")), strict=True)
        )
        expected = Counter((e["pos"][0], e["pos"][1], e["pos"][2]) for e in wal_events(d))
        assert got == expected, f"node {d.name}: {len(got)} positions landed, {len(expected)} in the WAL"
        assert max(got.values()) == 1
        last_data = max(p for p, rec in wal_records(d) if type(rec).__name__ == "DataRecord")
        mark = dt.transaction_version(app_id(node, 0))
        assert mark is not None and decode_version(mark) == last_data
        total += sum(expected.values())
    assert rows.num_rows == total
    assert all(writer_count(tmp_path / f"w{i}") == WRITES for i in range(NODES))
    killed = [sum(1 for e in log_events(err) if e.get("event") == "daemon_started") for err in errs]
    assert killed[0] >= 2, "daemon 0 ran twice (SIGKILLed, restarted)"
    print(f"\n{total} entries of {NODES} nodes landed in {land_s:.0f}s (restarts {restarts}, starts {killed})")

    # compact through Spark's s3a, then state == the union of the nodes.
    # The killed task's files: on the store, named by no commit (vacuum's to remove).
    in_table = {u.rsplit("/changes/", 1)[1] for u in dt.file_uris()}
    root = LakeLocation(LAKE, StorageOptions(**storage_table(minio)), env=creds_env()).root() / "changes"
    on_store = {p.rel.split("changes/", 1)[1] for p in root.rglob("*.parquet")}
    orphans = {p for p in on_store - in_table if not p.startswith("_delta_log/")}
    assert orphans, "the killed task wrote no file"
    # A full vacuum (Spark's `lake vacuum` lists the directory too) would delete exactly these.
    vacuumed = dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=True, full=True)
    assert orphans <= {v.rsplit("changes/", 1)[-1] for v in vacuumed}, (orphans, vacuumed)
    writers = Counter(json.loads(c["cdcd"])["writer"] for c in dt.history() if "cdcd" in c)
    assert writers["spark"] > 0 and writers["deltalake"] > 0, writers
    assert spark_cluster.alive_workers() == 2

    out = lake_cli(minio, "compact", "--spark-master", spark_cluster.master_url, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    out = lake_cli(minio, "verify", *[a for d in dirs for a in ("--node-dir", str(d))])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "verified:" in out.stdout and "OK" in out.stdout, out.stdout
    show = lake_cli(minio, "show")
    assert show.returncode == 0, show.stderr
    for d in dirs:
        assert f"cdcd:{read_node_id(d)}" in show.stdout
    assert "(current)" in show.stdout
    assert MINIO_PASSWORD not in show.stdout + show.stderr + out.stderr


def test_s3a_jars_are_fetched_by_make_install() -> None:
    for coords in S3A_ARTIFACTS:
        assert (jars_dir() / jar_name(*coords)).is_file(), f"{jar_name(*coords)}: run make install"
    assert os.path.getsize(jars_dir() / jar_name(*S3A_ARTIFACTS[0])) > 100_000


def test_on_an_object_store_the_default_writer_is_deltalake_and_spark_is_accepted() -> None:
    import msgspec

    from cdcd.lake.sink import LakeConsumer, LakeOptions

    assert msgspec.convert({"lake_path": "s3://b/p", "writer": "spark"}, LakeOptions).uses_spark
    with pytest.raises(msgspec.ValidationError, match="unknown scheme 'ftp'"):
        msgspec.convert({"lake_path": "ftp://b/p", "writer": "deltalake"}, LakeOptions)
    sink = LakeConsumer.from_options({"lake_path": "s3://b/p", "storage": {"region": "eu-west-1"}}, "consumer")
    assert sink.options.writer == "deltalake" and str(sink.lake) == "s3://b/p"
