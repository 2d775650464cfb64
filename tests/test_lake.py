"""The lake sink on Delta (docs/lake.md) end to end, with real Spark: ``cdcd run`` processes land the WAL's
data entries in ``<lake>/changes`` exactly once; ``cdcd lake compact / verify / show``; ``cdcd demo``; a Spark
standalone cluster on loopback.

The reference is the WAL (``tests.support.wal.wal_events``); ``tests.support.delta_lake.check_lake`` compares
the Delta table with it. Kills and faults are in ``test_lake_faults.py``, the writer's own properties in
``test_lake_delta.py``, compaction in ``test_lake_compact.py``, the other lake commands in ``test_lake_ops.py``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node
from tests.support.delta_lake import check_lake, lake_consumer
from tests.support.delta_tables import change, compacted_lake
from tests.support.lake import error_lines, wait_caught_up, wait_started, write_config
from tests.support.ports import free_port
from tests.support.procs import CDCD, cdcd, child_env, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import CACHES, expected_final_state, start_writer, writer_count


def state_table(spark: Any, lake: Path, cache: str) -> dict[str, Any]:
    """The compacted current state of ``cache`` as Spark reads the Delta table: key (``json.dumps`` text) -> value."""
    df = spark.read.format("delta").load(str(lake / "state"))
    rows = df.where(df["cache"] == cache).select("key", "value").collect()
    out = {json.dumps(json.loads(r["key"])): json.loads(r["value"]) for r in rows}
    assert len(out) == len(rows), "one state row per key"
    return out


def verify_results(stdout: str) -> dict[str, str]:
    """Cache -> OK/MISMATCH from the table `lake verify` (and `demo`) print (the lines after its header)."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("cache ") and "node rows" in line)
    return {line.split()[0]: line.split()[-1] for line in lines[header + 1 :] if not line.startswith("verified:")}


# --- tests -----------------------------------------------------------------------------------------
# ~43 entries a transaction (40 puts, removes of present keys): 10k entries in make test (enough transactions
# to update and delete keys often, not only create them), 30k+ in make chaos (the
# same claim at a size where commits, batches and the compaction's MERGE span many more files).
@pytest.mark.parametrize("n_tx", [250, pytest.param(700, marks=pytest.mark.chaos)])
def test_daemon_lands_every_entry_exactly_once_then_compact_and_verify(tmp_path: Path, spark: Any, n_tx: int) -> None:
    """A `cdcd run` process with the lake sink (Spark writer) follows a node writing creates, updates and deletes
    into a Delta change table holding exactly one row per WAL data entry; `lake show`, `lake compact` and
    `lake verify` agree, and verify notices a node write the lake does not have. (Volume is the benchmarks' job:
    `make bench` lands millions.)"""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    writer = start_writer(tmp_path, node_dir, count=n_tx, pause_ms=5)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake, "spark"), batch_max_delay_ms=500)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_started(proc, err)
        assert writer.wait(180) == 0, (tmp_path / "writer.log").read_text()[-3000:]
        assert writer_count(tmp_path) == n_tx
        wait_caught_up(proc, config, node_dir, err, 400)
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]

    expected = wal_events(node_dir)
    assert len(expected) >= 40 * n_tx
    ops = Counter(e["op"] for e in expected)
    assert ops["create"] and ops["update"] > n_tx and ops["delete"] > n_tx, ops
    commits = check_lake(lake, node_dir, expected)
    assert len(commits) > 1
    events = [json.loads(line)["event"] for line in err.read_text().splitlines() if line.startswith("{")]
    assert events[-1] == "daemon_stopped"
    assert "lake_replay_dropped" not in events, "a clean run re-delivers nothing"

    # lake show: rows per cache from the Delta log; no state yet.
    res = cdcd("lake", "show", "--lake", str(lake), "--json")
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert shown["tables"][0]["rows_per_cache"] == dict(Counter(e["cache"] for e in expected))
    assert shown["state_behind"] is True

    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 2 and "compact first" in res.stderr, res.stdout + res.stderr

    res = cdcd("lake", "compact", "--lake", str(lake), "--spark-master", "local[2]", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("state version "), res.stdout
    final = expected_final_state(n_tx)
    for cache in CACHES:
        assert state_table(spark, lake, cache) == final[cache], f"state of {cache} != the writer's final state"

    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    assert verify_results(res.stdout) == {c: "OK" for c in CACHES}
    keys = sum(len(final[c]) for c in CACHES)
    assert res.stdout.splitlines()[-1] == f"verified: {keys:,} keys, OK"

    # verify notices a difference: one more write on the node, not in the lake.
    with Node.open(node_dir) as node:
        node.cache("users").put("user-1", {"changed": True})
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 1
    assert verify_results(res.stdout) == {"events": "OK", "orders": "OK", "users": "MISMATCH"}


def test_lake_verify_stdout_is_only_its_table(tmp_path: Path) -> None:
    """`cdcd lake verify` prints only its result table and summary line on stdout (log lines belong on stderr)."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    compacted_lake(lake, [change("orders", "2", '"two"', 1)])
    with Node.open(node_dir) as node:
        node.cache("orders").put(1, "one")
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 1  # the lake's "orders" differs
    lines = res.stdout.splitlines()
    assert lines[0].startswith("cache "), res.stdout
    assert len(lines) == 3 and lines[2].startswith("verified: "), res.stdout


# --- hand-over: the node's realtime worker and the daemon, one lake -----------------------------------
# --- scale-out: a Spark standalone cluster on loopback ------------------------------------------------


def master_json(ui_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def alive_workers(ui_port: int) -> int:
    try:
        return int(master_json(ui_port)["aliveworkers"])
    except OSError:  # the master's web UI is not up yet
        return -1


@pytest.fixture
def standalone_cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A Spark master and one worker (1 core, 1 GiB), started with pyspark's own ``bin/spark-class`` on loopback."""
    import pyspark

    spark_home = Path(pyspark.__file__).resolve().parent
    spark_class = spark_home / "bin" / "spark-class"
    work = tmp_path / "spark-cluster"
    work.mkdir()
    env = child_env()
    env.update(
        SPARK_HOME=str(spark_home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_DIRS=str(work / "local"),
        SPARK_WORKER_DIR=str(work / "worker"),
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",  # no fixed REST port 6066
    )
    port, ui_port, worker_ui = free_port(), free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    def launch(name: str, *args: str) -> None:
        with (work / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen([str(spark_class), *args], stdout=log, stderr=log, env=env))

    try:
        launch(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port)),
        )
        wait_for(lambda: _connects(port) or procs[0].poll() is not None, 90, "the Spark master")
        assert procs[0].poll() is None, (work / "master.log").read_text()[-3000:]
        launch(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            url,
            *("--host", "127.0.0.1", "--webui-port", str(worker_ui), "--cores", "1", "--memory", "1g"),
            *("--work-dir", str(work / "worker")),
        )
        wait_for(lambda: procs[1].poll() is not None or alive_workers(ui_port) == 1, 90, "the Spark worker", 0.5)
        assert procs[1].poll() is None, (work / "worker.log").read_text()[-3000:]
        yield {"url": url, "ui_port": ui_port, "env": env, "work": work}
    finally:
        for proc in reversed(procs):  # worker first (it stops its executors), then the master
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_standalone_cluster_lands_exactly_once(tmp_path: Path, spark: Any, standalone_cluster: dict[str, Any]) -> None:
    """With `spark_master = "spark://127.0.0.1:<port>"` the daemon's batches and `lake compact` run as applications
    on a real standalone master and worker, and the lake is still exactly the WAL and verifies."""
    cluster = standalone_cluster
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    n_tx = 120  # several batches; the 30k-entry case is the local-master test above
    writer = start_writer(tmp_path, node_dir, count=n_tx, pause_ms=20)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
    spark_conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m",
        "spark.cores.max": "1",
    }
    consumer = lake_consumer(
        lake,
        "spark",
        spark_master=cluster["url"],
        spark_conf=spark_conf,
        app_name="cdcd-lake-cluster-test",
        partition_by_day=True,
    )
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=5000, batch_max_delay_ms=500)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_started(proc, err)
        apps = master_json(cluster["ui_port"])["activeapps"]
        assert [a["name"] for a in apps] == ["cdcd-lake-cluster-test"], apps
        assert writer.wait(120) == 0, (tmp_path / "writer.log").read_text()[-3000:]
        wait_caught_up(proc, config, node_dir, err, 300)
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    status = master_json(cluster["ui_port"])
    assert "cdcd-lake-cluster-test" in [a["name"] for a in status["completedapps"]]
    # The executor ran on the worker: its work dir holds the application's executor directory.
    assert list((cluster["work"] / "worker").glob("app-*/*/stderr")), "no executor ran on the worker"

    expected = wal_events(node_dir)
    assert len(expected) > 4_000
    check_lake(lake, node_dir, expected)
    res = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(lake), "--spark-master", cluster["url"]],
        capture_output=True,
        text=True,
        timeout=300,
        env=cluster["env"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "cdcd-lake-compact" in [a["name"] for a in master_json(cluster["ui_port"])["completedapps"]]
    final = expected_final_state(n_tx)
    for cache in CACHES:
        assert state_table(spark, lake, cache) == final[cache]
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    assert verify_results(res.stdout) == {c: "OK" for c in CACHES}


def test_lake_verify_leaves_the_node_alone(tmp_path: Path) -> None:
    """`cdcd lake verify` does not change the node it checks: its realtime state and WAL markers stay as they were."""
    from cdcd.daemon.config import DaemonConfig
    from cdcd.daemon.daemon import Daemon
    from cdcd.sinks.null import NullConsumer
    from tests.support.realtime import markers, node_realtime_state

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    compacted_lake(lake, [change("orders", "2", '"two"', 1)])
    settings = {
        "wal_segment_size_bytes": 64 * 1024,
        "wal_force_archive_timeout_ms": 0,
        "realtime_cdc": True,
        "realtime_consumer": {"kind": "jsonl", "path": str(tmp_path / "rt.jsonl")},
    }
    with Node.open(node_dir, **settings) as node:
        node.cache("orders").put(1, "one")
        with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), NullConsumer()) as daemon:
            wait_for(lambda: daemon.sync_once() >= 0 and node.realtime.mode.value == "on", 30, "realtime on")
        node.cache("orders").put(2, "two")
    assert node_realtime_state(node_dir).enabled
    before = markers(node_dir)
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 1, res.stdout + res.stderr  # the lake's "orders" differs
    assert node_realtime_state(node_dir).enabled, "verify switched the node's realtime CDC off"
    assert markers(node_dir) == before, "verify wrote marker records into the node's WAL"


def test_lake_show_refuses_a_directory_that_is_not_a_lake(tmp_path: Path) -> None:
    """`cdcd lake show --lake DIR` on a directory without a Delta table: one error line, nothing created."""
    res = cdcd("lake", "show", "--lake", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "show created files in a directory it only reads"
    assert res.returncode != 0
    assert len(error_lines(res.stderr)) == 1, res.stderr
