"""``make run-cluster``: three nodes under a sample load, a `cdcd run` daemon per node, one Delta lake on
MinIO (s3://lake/cluster), a Spark standalone cluster (master + two workers on loopback), and `cdcd top`'s
figures for each node; Ctrl-C (or --seconds) stops the load, lets every daemon catch up, compacts on the
cluster, shows the lake and verifies it against the three nodes, and stops everything (exit 1 if
verification fails). docs/cluster.md gives the phases and what each costs."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.live import Live  # noqa: E402

from cdcd.daemon.config import load_daemon_config  # noqa: E402
from cdcd.top.snapshot import Rates, Snapshot, collect, metric, rates  # noqa: E402
from cdcd.top.view import cluster_table, status_line  # noqa: E402
from tests.support.lake import caught_up, position, write_config  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.procs import child_env, start_daemon  # noqa: E402
from tests.support.servers import MINIO_PASSWORD, MINIO_USER, MinioServer, SparkStandalone  # noqa: E402
from tests.support.writer import WRITER_NODE_SETTINGS  # noqa: E402

LAKE = "s3://lake/cluster"
NODES = 3
SPARK_WRITER_CONF = {"spark.cores.max": "2", "spark.executor.cores": "1", "spark.executor.memory": "512m"}
COMPACT_INTERVAL_S = 30
"""node0's daemon compacts on the cluster this often while the load runs: the stop then folds only the
changes of the last interval, not the whole run."""
STATUS_EVERY_S = 2.0
DAEMON_STOP_TIMEOUT_S = 120
"""node0's daemon may be in a scheduled compaction: its Spark jobs are cancelled, but the typed tables' delta-rs
commits finish first."""
CATCH_UP_TIMEOUT_S = 300
CATCH_UP_REPORT_S = 5.0


def node_main(node_dir: str, cache: str, rate: int, stop_file: str, metrics_port: int) -> None:
    """A node under the built-in load into its own cache (disjoint keys, as Ignite nodes own disjoint
    partitions) until ``stop_file`` exists; then every write is archived (visible to CDC). Its metrics
    (WAL bytes, entries) on ``metrics_port``, for the status view."""
    from prometheus_client import start_http_server

    from cdcd.node.load import LoadGenerator
    from cdcd.node.node import Node

    node = Node.open(node_dir, **WRITER_NODE_SETTINGS)
    start_http_server(metrics_port, addr="127.0.0.1")
    load = LoadGenerator(node, rate, cache=cache, keyspace=20_000)
    load.start()
    try:
        while not os.path.exists(stop_file):
            time.sleep(0.2)
    finally:
        load.stop()
        node.force_archive()
        node.close()
        # What this node logged (a fresh node: every entry of its WAL), for the counts at the end.
        Path(f"{node_dir}.logged").write_text(f"{sum(node.stats.entries.values())}\n")


def start_node(var: Path, i: int, rate: int, metrics_port: int) -> subprocess.Popen[bytes]:
    args = [str(var / f"node{i}"), f"load-node{i}", str(rate), str(var / f"node{i}.stop"), str(metrics_port)]
    log = (var / f"node{i}.log").open("wb")
    cmd = [sys.executable, __file__, "--node", *args]
    # Every child runs in a session of its own: the terminal's Ctrl-C reaches only this script, which stops
    # them in order (a node stopped by Ctrl-C mid-load would not archive its last writes).
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True)


def print_counts(var: Path, info: Any, checks: list[Any]) -> None:
    """Per node: the entries it logged beside the change rows of its cache, its keys beside its state rows."""
    from cdcd.demo import counts_line

    per_table = {t.name: t.rows_per_cache for t in info.tables}
    node_keys = {c.cache: c.node_rows for c in checks}
    for i in range(NODES):
        cache = f"load-node{i}"
        logged = int((var / f"node{i}.logged").read_text())
        line = counts_line(
            logged,
            per_table.get("changes", {}).get(cache, 0),
            node_keys.get(cache, 0),
            per_table.get("state", {}).get(cache, 0),
        )
        print(f"node{i} {line}", flush=True)


def show_pos(pos: tuple[int, int, int] | None) -> str:
    return "-" if pos is None else f"{pos[0]}:{pos[1]}#{pos[2]}"


class Abort(Exception):
    """A second Ctrl-C (or SIGTERM): stop everything now."""


def on_signals(stop: threading.Event) -> None:
    """The first SIGINT/SIGTERM asks for the orderly stop; a second one aborts it (the ``finally`` of
    ``main`` kills whatever still runs)."""

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            raise Abort(signal.Signals(signum).name)
        stop.set()
        print(f"\n{signal.Signals(signum).name}: stopping in order (again: stop at once)", flush=True)

    def hang_up(signum: int, _frame: object) -> None:
        # The terminal closed: nobody watches an orderly stop, but nothing may be left running either.
        raise Abort(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, hang_up)


class Watch:
    """`cdcd top`'s snapshot of each node and its daemon (control socket, daemon state, both metrics)."""

    def __init__(self, dirs: list[Path], configs: list[Path], node_metrics: list[str]) -> None:
        loaded = [load_daemon_config(c, environ={}) for c in configs]
        self.sources = list(zip(dirs, loaded, node_metrics, strict=True))
        self.previous: list[Snapshot | None] = [None] * len(dirs)

    def read(self) -> list[tuple[str, Snapshot, Rates | None]]:
        rows = []
        for i, (node_dir, config, node_m) in enumerate(self.sources):
            snap = collect(node_dir, config, node_m)
            old = self.previous[i]
            rows.append((f"node{i}", snap, rates(old, snap) if old is not None else None))
            self.previous[i] = snap
        return rows


def print_lines(rows: list[tuple[str, Snapshot, Rates | None]], elapsed_s: float) -> None:
    for name, snap, r in rows:
        print(f"[{elapsed_s:5.0f}s] {name}  {status_line(snap, r)}", flush=True)


class WarmSpark:
    """The SparkSession (on the cluster) that compacts at the stop, started while the load runs: its JVM and
    s3a start then cost nothing at the stop. It registers once node0's daemon holds the workers' cores, and
    waits for cores (it runs no job) until that daemon stops."""

    def __init__(self, master: str, conf: dict[str, str]) -> None:
        self.master, self.conf = master, conf
        self.session: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._acquire, name="warm-spark", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.session is not None or self.error is not None

    def start(self) -> None:
        self._thread.start()

    def _acquire(self) -> None:
        from cdcd.lake import spark as spark_session

        try:
            self.session = spark_session.acquire(self.master, "cdcd-run-cluster-compact", self.conf)
            self.session.sparkContext.setLogLevel("ERROR")  # Spark's own warnings are not this run's output
        except BaseException as exc:  # reported by get(), in the main thread
            self.error = exc

    def get(self) -> Any:
        if not self.started:
            self.start()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.session


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: at Ctrl-C)")
    ap.add_argument("--var", type=Path, default=ROOT / "var" / "cluster")
    ap.add_argument("--rate", type=int, default=3000, help="entries/s per node")
    ap.add_argument("--node", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node_main(args.node[0], args.node[1], int(args.node[2]), args.node[3], int(args.node[4]))
        return 0
    from cdcd.cli.process import log_to_stderr
    from cdcd.lake.maintenance.compact import compact
    from cdcd.lake.maintenance.ops import show
    from cdcd.lake.reading.report import compact_summary, print_show, print_verify, verify_summary
    from cdcd.lake.reading.verify import verify
    from cdcd.lake.storage import LakeLocation, StorageOptions
    from cdcd.node.snapshot import NodeSnapshot

    log_to_stderr(level="warning")
    var: Path = args.var
    shutil.rmtree(var, ignore_errors=True)
    var.mkdir(parents=True)
    env = {**child_env(), "AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD}
    minio = MinioServer(var / "minio" / "data")
    cluster = SparkStandalone(var / "spark", workers=2)
    writers: list[subprocess.Popen[bytes]] = []
    daemons: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    on_signals(stop)
    tty = sys.stdout.isatty()
    try:
        minio.start()
        minio.create_bucket("lake")
        print(f"MinIO at {minio.endpoint}, lake {LAKE}", flush=True)
        cluster.start()
        print(f"Spark standalone at {cluster.master_url} (2 workers; node0's daemon writes through it)", flush=True)
        dirs = [var / f"node{i}" for i in range(NODES)]
        node_metrics = [f"127.0.0.1:{free_port()}" for _ in dirs]
        configs, errs = [], []
        storage = {"endpoint": minio.endpoint, "path_style": True}
        for i, d in enumerate(dirs):
            writers.append(start_node(var, i, args.rate, int(node_metrics[i].rpartition(":")[2])))
            # The other daemons only land (no maintenance: a Spark session each would not fit the machine).
            consumer: dict[str, Any] = {
                "kind": "lake",
                "lake_path": LAKE,
                "writer": "deltalake",
                "storage": storage,
                "compact_interval_s": 0,
                "optimize_interval_s": 0,
                "vacuum_interval_s": 0,
            }
            if i == 0:
                # One daemon writes through the cluster (its application takes both workers' cores), and
                # maintains the lake there on a schedule.
                consumer.update(
                    writer="spark",
                    spark_master=cluster.master_url,
                    spark_conf=SPARK_WRITER_CONF,
                    compact_interval_s=COMPACT_INTERVAL_S,
                )
            metrics_address = f"127.0.0.1:{free_port()}"
            path = var / f"cdcd{i}.toml"
            configs.append(write_config(path, d, consumer, batch_max_events=20000, metrics_address=metrics_address))
            errs.append(var / f"daemon{i}.log")
        while not all((d / "cdc").is_dir() for d in dirs):
            time.sleep(0.1)
        daemons = [start_daemon(c, e, env=env, new_session=True) for c, e in zip(configs, errs, strict=True)]
        location = LakeLocation(LAKE, StorageOptions(endpoint=minio.endpoint, path_style=True), env=env)
        warm = WarmSpark(cluster.master_url, {**location.spark_conf, **SPARK_WRITER_CONF})
        watch = Watch(dirs, configs, node_metrics)
        t0 = time.monotonic()
        print("running: Ctrl-C stops the load, catches up, compacts on the cluster and verifies", flush=True)
        rows = watch.read()
        with ExitStack() as screen:
            live = screen.enter_context(Live(console=Console(), auto_refresh=False)) if tty else None
            while not stop.wait(STATUS_EVERY_S) and not (args.seconds and time.monotonic() - t0 > args.seconds):
                rows = watch.read()
                if live is not None:
                    live.update(cluster_table(rows), refresh=True)
                else:
                    print_lines(rows, time.monotonic() - t0)
                for i, p in enumerate(daemons):
                    if p.poll() is not None:
                        print(f"daemon {i} exited {p.returncode}: see {errs[i]}", flush=True)
                        return 1
                # Once node0's daemon has landed rows its executors hold the cores; an application registered
                # before would take them (its committed position alone is no sign: a fresh daemon starts at one).
                if not warm.started and metric(rows[0][1].consumer, "cdcd_lake_rows_written_total"):
                    warm.start()
        stopping = time.monotonic()
        if live is not None:
            print_lines(rows, stopping - t0)  # the last figures stay in the terminal's scrollback
        print(f"stopping: the load on {NODES} nodes; catching up", flush=True)
        for i in range(NODES):
            (var / f"node{i}.stop").touch()
        for w in writers:
            w.wait(120)
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        report = time.monotonic() + CATCH_UP_REPORT_S
        while behind := [i for i, (d, c) in enumerate(zip(dirs, configs, strict=True)) if position(c) != caught_up(d)]:
            if time.monotonic() >= report:
                report += CATCH_UP_REPORT_S
                at = {i: (show_pos(position(configs[i])), show_pos(caught_up(dirs[i]))) for i in behind}
                print("catching up: " + ", ".join(f"node{i} at {a} of {b}" for i, (a, b) in at.items()), flush=True)
            if gone := [i for i in behind if daemons[i].poll() is not None]:
                print(f"daemon {gone[0]} exited {daemons[gone[0]].returncode}: see {errs[gone[0]]}", flush=True)
                return 1
            if time.monotonic() > deadline:
                print(f"node(s) {behind} not caught up in {CATCH_UP_TIMEOUT_S} s: see {errs}", flush=True)
                return 1
            time.sleep(0.25)
        t1 = time.monotonic()
        for p in daemons:  # all at once: each finishes its batch in flight and its consumer in parallel
            p.send_signal(signal.SIGTERM)
        try:
            codes = [p.wait(max(0.0, t1 + DAEMON_STOP_TIMEOUT_S - time.monotonic())) for p in daemons]
        except subprocess.TimeoutExpired:
            print(f"a daemon did not stop within {DAEMON_STOP_TIMEOUT_S} s of SIGTERM: see {errs}", flush=True)
            return 1
        t2 = time.monotonic()
        if any(codes):
            print(f"a daemon exited {codes}: see {errs}", flush=True)
            return 1
        print(f"caught up in {t1 - stopping:.1f} s, daemons stopped in {t2 - t1:.1f} s; compacting on the cluster")
        root = location.root()
        result = compact(warm.get(), root)
        t3 = time.monotonic()
        print(f"compacted in {t3 - t2:.1f} s ({compact_summary(result)}); verifying", flush=True)
        info = show(root)
        print_show(info)
        with ExitStack() as stack:
            checks = verify(root, [stack.enter_context(NodeSnapshot(d)) for d in dirs])
        print_verify(checks)
        print_counts(var, info, checks)
        ok = all(c.ok for c in checks)
        print(f"{verify_summary(checks)}; verified in {time.monotonic() - t3:.1f} s", flush=True)
        print(f"{'OK' if ok else 'verification FAILED'}; stopped in {time.monotonic() - stopping:.0f} s", flush=True)
        return 0 if ok else 1
    except Abort as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"{exc}: stopping at once", flush=True)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the clean-up below is not interrupted
        for p in [*writers, *daemons]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the process and what it started (a Spark JVM)
                p.wait()
        cluster.stop()
        minio.stop()


if __name__ == "__main__":
    os.chdir(ROOT)
    code = main()
    # This process's Spark JVM ends with it (its pipe closes); Arrow's and delta-rs' native pools can abort
    # the interpreter's shutdown (see `cdcd lake verify`), so leave without it once the result is printed.
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
