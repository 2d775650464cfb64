"""``make run-cluster``: three nodes under a sample load, a `cdcd run` daemon per node, one Delta lake on
MinIO (s3://lake/cluster), a Spark standalone cluster (master + two workers on loopback), live status;
Ctrl-C (or --seconds) stops the load, lets every daemon catch up, runs `cdcd lake compact` on the cluster,
`lake show` and `lake verify` over the three nodes, and stops everything (exit 1 if verification fails)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.lake import caught_up, position, write_config  # noqa: E402
from tests.support.procs import child_env, start_daemon, stop_daemon  # noqa: E402
from tests.support.servers import MINIO_PASSWORD, MINIO_USER, MinioServer, SparkStandalone  # noqa: E402
from tests.support.writer import WRITER_NODE_SETTINGS  # noqa: E402

LAKE = "s3://lake/cluster"
NODES = 3
SPARK_WRITER_CONF = {"spark.cores.max": "2", "spark.executor.cores": "1", "spark.executor.memory": "512m"}


def node_main(node_dir: str, cache: str, rate: int, stop_file: str) -> None:
    """A node under the built-in load into its own cache (disjoint keys, as Ignite nodes own disjoint
    partitions) until ``stop_file`` exists; then every write is archived (visible to CDC)."""
    from cdcd.node.load import LoadGenerator
    from cdcd.node.node import Node

    node = Node.open(node_dir, **WRITER_NODE_SETTINGS)
    load = LoadGenerator(node, rate, cache=cache, keyspace=20_000)
    load.start()
    try:
        while not os.path.exists(stop_file):
            time.sleep(0.2)
    finally:
        load.stop()
        node.force_archive()
        node.close()


def start_node(var: Path, i: int, rate: int) -> subprocess.Popen[bytes]:
    args = [str(var / f"node{i}"), f"load-node{i}", str(rate), str(var / f"node{i}.stop")]
    log = (var / f"node{i}.log").open("wb")
    cmd = [sys.executable, __file__, "--node", *args]
    # Every child runs in a session of its own: the terminal's Ctrl-C reaches only this script, which stops
    # them in order (a node stopped by Ctrl-C mid-load would not archive its last writes).
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True)


class Abort(Exception):
    """A second Ctrl-C (or SIGTERM): stop everything now."""


def on_signals(stop: dict[str, bool]) -> None:
    """The first SIGINT/SIGTERM asks for the orderly stop; a second one aborts it (the ``finally`` of
    ``main`` kills whatever still runs)."""

    def handler(signum: int, _frame: object) -> None:
        if stop["now"]:
            raise Abort(signal.Signals(signum).name)
        stop["now"] = True
        print(f"\n{signal.Signals(signum).name}: stopping in order (again: stop at once)", flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run_step(argv: list[str], env: dict[str, str], running: list[subprocess.Popen[bytes]]) -> int:
    """One `cdcd lake …` command in its own session (its Spark JVM too), killed as a group on abort."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    running.append(proc)
    return proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: at Ctrl-C)")
    ap.add_argument("--var", type=Path, default=ROOT / "var" / "cluster")
    ap.add_argument("--rate", type=int, default=3000, help="entries/s per node")
    ap.add_argument("--node", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node_main(args.node[0], args.node[1], int(args.node[2]), args.node[3])
        return 0
    var: Path = args.var
    shutil.rmtree(var, ignore_errors=True)
    var.mkdir(parents=True)
    env = {**child_env(), "AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD}
    minio = MinioServer(var / "minio" / "data")
    cluster = SparkStandalone(var / "spark", workers=2)
    writers: list[subprocess.Popen[bytes]] = []
    daemons: list[subprocess.Popen[bytes]] = []
    steps: list[subprocess.Popen[bytes]] = []
    stop = {"now": False}
    on_signals(stop)
    try:
        minio.start()
        minio.create_bucket("lake")
        print(f"MinIO at {minio.endpoint}, lake {LAKE}", flush=True)
        cluster.start()
        print(f"Spark standalone at {cluster.master_url} (2 workers; node0's daemon writes through it)", flush=True)
        dirs = [var / f"node{i}" for i in range(NODES)]
        configs, errs = [], []
        storage = {"endpoint": minio.endpoint, "path_style": True}
        for i, d in enumerate(dirs):
            writers.append(start_node(var, i, args.rate))
            consumer = {"kind": "lake", "lake_path": LAKE, "writer": "deltalake", "storage": storage}
            if i == 0:
                # One daemon writes through the cluster (its application takes both workers' cores).
                consumer.update(writer="spark", spark_master=cluster.master_url, spark_conf=SPARK_WRITER_CONF)
            configs.append(write_config(var / f"cdcd{i}.toml", d, consumer, batch_max_events=20000))
            errs.append(var / f"daemon{i}.log")
        while not all((d / "cdc").is_dir() for d in dirs):
            time.sleep(0.1)
        daemons = [start_daemon(c, e, env=env, new_session=True) for c, e in zip(configs, errs, strict=True)]
        t0 = time.monotonic()
        print("running: Ctrl-C stops the load, catches up, compacts on the cluster and verifies", flush=True)
        while not stop["now"] and not (args.seconds and time.monotonic() - t0 > args.seconds):
            time.sleep(2)
            status = "  ".join(f"node{i} landed to {position(c)}" for i, c in enumerate(configs))
            print(f"[{time.monotonic() - t0:5.0f}s] {status}", flush=True)
            for i, p in enumerate(daemons):
                if p.poll() is not None:
                    print(f"daemon {i} exited {p.returncode}: see {errs[i]}", flush=True)
                    return 1
        stopping = time.monotonic()
        print(f"stopping: the load on {NODES} nodes; catching up", flush=True)
        for i in range(NODES):
            (var / f"node{i}.stop").touch()
        for w in writers:
            w.wait(120)
        for i, d in enumerate(dirs):
            until = caught_up(d)
            while position(configs[i]) != until:
                time.sleep(0.25)
        for p in daemons:
            stop_daemon(p, timeout=60)
        t1 = time.monotonic()
        print(f"caught up in {t1 - stopping:.1f} s; compacting on the cluster", flush=True)
        where = ["--lake", LAKE, "--storage-endpoint", minio.endpoint, "--storage-path-style"]
        cdcd = [sys.executable, "-m", "cdcd", "lake"]
        if run_step([*cdcd, "compact", *where, "--spark-master", cluster.master_url], env, steps) != 0:
            print("compaction failed (its error is above)", flush=True)
            return 1
        print(f"compacted in {time.monotonic() - t1:.1f} s; verifying", flush=True)
        run_step([*cdcd, "show", *where], env, steps)
        nodes = [a for d in dirs for a in ("--node-dir", str(d))]
        rc = run_step([*cdcd, "verify", *where, *nodes], env, steps)
        print(
            f"{'OK' if rc == 0 else 'verification FAILED'}; stopped in {time.monotonic() - stopping:.0f} s", flush=True
        )
        return rc
    except Abort as exc:
        print(f"{exc}: stopping at once", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up below is not interrupted
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for p in [*steps, *writers, *daemons]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the process and what it started (a Spark JVM)
                p.wait()
        cluster.stop()
        minio.stop()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
