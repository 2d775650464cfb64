"""Many nodes, one Delta lake on an object store: real MinIO on loopback, one `cdcd run` daemon per node,
SIGKILLed daemons and a stopped store, then `cdcd lake compact` through Spark's s3a and `lake verify`."""

from __future__ import annotations

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

from cdcd.lake.delta import app_id, decode_version
from cdcd.lake.spark import S3A_ARTIFACTS, jar_name, jars_dir
from cdcd.lake.storage import LakeLocation, StorageOptions
from cdcd.node.identity import read_node_id
from tests.support.lake import caught_up, position, write_config
from tests.support.procs import cdcd, child_env, log_events, start_daemon, stop_daemon, wait_for
from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer
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


def test_three_nodes_land_exactly_once_through_kills_and_a_store_outage(tmp_path: Path, minio: MinioServer) -> None:
    """Three nodes under load, each with its own daemon, into one lake on MinIO. Daemon 0 is SIGKILLed and
    restarted once it has committed; MinIO is stopped for a while and started again (a daemon whose batch
    failed exits non-zero and is restarted, as systemd would). Every entry of every node is in the lake
    exactly once (per source application transaction), and after `lake compact` `state` is the union of
    the nodes (`lake verify` with three `--node-dir`)."""
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
    configs, errs = [], []
    for i, d in enumerate(dirs):
        consumer = {"kind": "lake", "lake_path": LAKE, "writer": "deltalake", "storage": storages[i]}
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
        # Stop the store while the nodes keep writing; start it again once each node archived more.
        before = [len(list((d / "cdc").glob("*.wal"))) for d in dirs]
        minio.stop()
        outage = time.monotonic()
        wait_for(
            lambda: time.monotonic() - outage > 3
            and all(
                len(list((d / "cdc").glob("*.wal"))) > n or w.poll() is not None
                for d, n, w in zip(dirs, before, writers, strict=True)
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
    out = lake_cli(minio, "compact", "--spark-master", "local[1]", timeout=600)
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


def test_on_an_object_store_the_writer_is_deltalake() -> None:
    import msgspec

    from cdcd.sinks.lake import LakeConsumer, LakeOptions

    with pytest.raises(msgspec.ValidationError, match=r"writer = \"deltalake\".*\$\.writer"):
        msgspec.convert({"lake_path": "s3://b/p", "writer": "spark"}, LakeOptions)
    with pytest.raises(msgspec.ValidationError, match="unknown scheme 'ftp'"):
        msgspec.convert({"lake_path": "ftp://b/p", "writer": "deltalake"}, LakeOptions)
    sink = LakeConsumer.from_options({"lake_path": "s3://b/p", "storage": {"region": "eu-west-1"}}, "consumer")
    assert sink.options.writer == "deltalake" and str(sink.lake) == "s3://b/p"
