"""The Spark lake sink (DESIGN §7) end to end, with real Spark: ``cdcd run`` processes land the WAL's data entries
in the Parquet change log ``<lake>/changes`` exactly once; ``cdcd lake compact / verify / show``; ``cdcd demo``;
the hand-over between the node's realtime worker and the daemon writing one lake; a Spark standalone cluster.

The reference is the WAL (``WalReader`` over archive and work dir, via ``tests.support.wal.wal_events``).
``check_lake`` compares a lake with it: the commit log's entries cover disjoint position ranges, each entry's
files hold exactly the WAL entries of its range, every Parquet file under ``changes/`` is named by an entry (no
orphan a reader could see), and ``spark.read.parquet(<lake>/changes)`` returns exactly one row per WAL data entry,
equal to it column by column.

The test process reads the lake with one SparkSession per module (``spark`` fixture); daemons, ``cdcd lake
compact`` and the node's realtime worker run as subprocesses with their own Spark. Fault injection (SIGKILL
during commits, an unwritable lake, a full disk) lives in ``test_lake_faults.py``; the helpers here are shared.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node
from tests.support.lake import (
    check_lake,
    error_lines,
    fake_compacted_state,
    spark_consumer,
    wait_caught_up,
    wait_started,
    write_config,
)
from tests.support.procs import CDCD, cdcd, child_env, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import CACHES, expected_final_state, start_writer, writer_count


def state_table(spark: Any, lake: Path, cache: str) -> dict[str, Any]:
    """The compacted current state of ``cache``: key (as ``json.dumps`` text) -> value."""
    rows = spark.read.parquet(str(lake / "state" / f"cache={cache}")).select("key", "value").collect()
    out = {json.dumps(json.loads(r["key"])): json.loads(r["value"]) for r in rows}
    assert len(out) == len(rows), "one state row per key"
    return out


def verify_results(stdout: str) -> dict[str, str]:
    """Cache -> OK/MISMATCH from the table `lake verify` (and `demo`) print (the lines after its header)."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("cache ") and "node rows" in line)
    return {line.split()[0]: line.split()[-1] for line in lines[header + 1 :]}


# --- tests -----------------------------------------------------------------------------------------
def test_daemon_lands_100k_entries_exactly_once_then_compact_and_verify(tmp_path: Path, spark: Any) -> None:
    """A `cdcd run` process with the Spark sink follows a node writing 100k+ creates, updates and deletes into a
    change log holding exactly one row per WAL data entry; `lake show`, `lake compact` and `lake verify` agree."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    n_tx = 2100  # ~51 entries each (40 puts, removes of present keys): > 100k entries
    writer = start_writer(tmp_path, node_dir, count=n_tx, pause_ms=5)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
    config = write_config(tmp_path / "cdcd.toml", node_dir, spark_consumer(lake), batch_max_delay_ms=500)
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
    assert len(expected) >= 100_000
    ops = Counter(e["op"] for e in expected)
    assert ops["create"] and ops["update"] > 10_000 and ops["delete"] > 10_000, ops
    entries = check_lake(spark, lake, node_dir, expected)
    assert len(entries) > 1
    events = [json.loads(line)["event"] for line in err.read_text().splitlines() if line.startswith("{")]
    assert "lake_sink_starting" in events and events[-1] == "daemon_stopped"
    assert "lake_replay_dropped" not in events, "a clean run re-delivers nothing"

    # lake show: rows per cache from the log; no state yet.
    res = cdcd("lake", "show", "--lake", str(lake), "--json")
    assert res.returncode == 0, res.stderr
    per_cache = Counter(e["cache"] for e in expected)
    last = max(tuple(e["pos"]) for e in expected)
    shown = json.loads(res.stdout)
    assert {r["cache"]: r["rows"] for r in shown} == dict(per_cache)
    assert all(r["state_rows"] is None for r in shown)
    assert max(tuple(int(x) for x in r["last_position"].replace("#", ":").split(":")) for r in shown) == last

    res = cdcd("lake", "compact", "--lake", str(lake), "--spark-master", "local[2]", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    final = expected_final_state(n_tx)
    last_seq = {c: max(e.seq for e in entries if c in e.caches) for c in CACHES}
    assert sorted(res.stdout.splitlines()) == sorted(
        f"{c}: state version 1, {len(final[c]):,} rows (log entries up to {last_seq[c]})" for c in CACHES
    )
    for cache in CACHES:
        assert state_table(spark, lake, cache) == final[cache], f"state of {cache} != the writer's final state"
        assert (lake / "state" / f"cache={cache}").is_symlink()

    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    assert verify_results(res.stdout) == {c: "OK" for c in CACHES}

    res = cdcd("lake", "show", "--lake", str(lake), "--json")
    assert {r["cache"]: r["state_rows"] for r in json.loads(res.stdout)} == {c: len(final[c]) for c in CACHES}
    res = cdcd("lake", "compact", "--lake", str(lake), "--spark-master", "local[1]", timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "nothing new to compact", res.stdout + res.stderr

    # verify notices a difference: one more write on the node, not in the lake.
    with Node.open(node_dir) as node:
        node.cache("users").put("user-1", {"changed": True})
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 1
    assert verify_results(res.stdout) == {"events": "OK", "orders": "OK", "users": "MISMATCH"}


def test_demo_runs_end_to_end(tmp_path: Path, spark: Any) -> None:
    """`cdcd demo --seconds 10` runs a node, load, daemon and Spark sink, compacts and verifies (exit 0), and its
    change log is exactly the demo node's WAL."""
    t0 = time.monotonic()
    res = cdcd("demo", "--seconds", "10", "--var", str(tmp_path), timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    results = verify_results(res.stdout)
    assert results == {"load": "OK"}, res.stdout
    check_lake(spark, tmp_path / "demo" / "lake", tmp_path / "demo" / "node")
    print(f"\ndemo: {time.monotonic() - t0:.0f}s")


def test_lake_verify_stdout_is_only_its_table(tmp_path: Path) -> None:
    """`cdcd lake verify` prints only its result table on stdout (log lines belong on stderr)."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    fake_compacted_state(lake, "orders", [("2", '"two"')])
    with Node.open(node_dir) as node:
        node.cache("orders").put(1, "one")
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 1  # the lake's "orders" differs
    assert res.stdout.splitlines()[0].startswith("cache "), res.stdout
    assert len(res.stdout.splitlines()) == 2, res.stdout


# --- hand-over: the node's realtime worker and the daemon, one lake -----------------------------------
# --- scale-out: a Spark standalone cluster on loopback ------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    n_tx = 400
    writer = start_writer(tmp_path, node_dir, count=n_tx, pause_ms=20)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
    spark_conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m",
        "spark.cores.max": "1",
    }
    consumer = spark_consumer(
        lake,
        cluster["url"],
        spark_conf=spark_conf,
        app_name="cdcd-lake-cluster-test",
        partition_by_day=True,
        writer="spark",
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
    assert len(expected) > 15_000
    check_lake(spark, lake, node_dir, expected)
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
    fake_compacted_state(lake, "orders", [("2", '"two"')])
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
    """`cdcd lake show --lake DIR` on a directory without a commit log fails with one error line and creates nothing."""
    res = cdcd("lake", "show", "--lake", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "show created files in a directory it only reads"
    assert res.returncode != 0
    assert len(error_lines(res.stderr)) == 1, res.stderr
