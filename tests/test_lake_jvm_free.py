"""`writer = "deltalake"` stays JVM-free (issue 43): its small-file maintenance (the writer's bound on files per
partition and the scheduled optimize lane) and its compaction (the MERGE into `state` and the typed tables,
`compact_engine = "auto"` without a `spark_master`) run on pyarrow and delta-rs, so a daemon that lands and
maintains the lake with the default settings starts no JVM (docs/lake.md, Maintenance)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from cdcd.lake.maintenance.autocompact import files_per_partition
from cdcd.lake.sink import LakeOptions
from cdcd.lake.storage import is_delta
from cdcd.lake.table import CHANGES, PARTITION_BY, STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.delta_lake import lake_rows
from tests.support.lake import process_tree, run_to_end, wait_started, write_config
from tests.support.procs import child_env, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node, start_writer

CDCD = [sys.executable, "-m", "cdcd"]


def _java_in_tree(pid: int) -> list[str]:
    """The command lines of java processes among ``pid``'s descendants (read from /proc)."""
    out = []
    for child in process_tree(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if cmdline and Path(cmdline[0].decode(errors="replace")).name.startswith("java"):
            out.append(b" ".join(cmdline).decode(errors="replace")[:200])
    return out


def test_the_deltalake_writer_bounds_files_optimizes_and_compacts_without_a_jvm(tmp_path: Path) -> None:
    """`cdcd run` with `writer = "deltalake"`, the default bound (20 files per partition), the default
    scheduled optimize (every 10 s, here every 2 s) and the default compaction (on, its engine `auto`), lands 25 s
    of live traffic: a sampler reading /proc every 0.5 s never finds a java process under the daemon (nor a
    `spark-submit`), the optimize lane and compaction run (`state` and the typed tables exist), every partition of
    `changes` stays within 20 files at every sample, and every WAL entry lands once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=1, tx_per_segment=5)
    consumer = {
        "kind": "lake",
        "lake_path": str(lake),
        "writer": "deltalake",
        "compact_interval_s": LakeOptions(lake_path=str(lake)).compact_interval_s,  # the default, on
        "optimize_interval_s": 2.0,
        "max_files_per_partition": 20,
    }
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_delay_ms=100)
    err = tmp_path / "daemon.err"
    with err.open("ab") as f:
        proc = subprocess.Popen(
            [*CDCD, "run", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=f, env=child_env()
        )
    java: list[list[str]] = []
    files: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            java.append(_java_in_tree(proc.pid))
            counts = files_per_partition(lake / CHANGES, PARTITION_BY)
            files.append(max(counts.values(), default=0))

    sampler = threading.Thread(target=sample, daemon=True)
    load = None
    try:
        sampler.start()
        wait_started(proc, err, timeout=120)
        load = start_writer(tmp_path, node_dir, pause_ms=20)
        wait_for(lambda: sum(1 for n in files if n) >= 50 or proc.poll() is not None, 120, "50 samples of traffic")
        (tmp_path / "writer.stop").touch()
        assert load.wait(120) == 0
        wait_for(lambda: b"lake_maintenance_optimized" in err.read_bytes(), 60, "the optimize lane to run")
        wait_for(lambda: b"lake_maintenance_compacted" in err.read_bytes(), 120, "a compaction to run")
    finally:
        stop.set()
        sampler.join(10)
        (tmp_path / "writer.stop").touch()
        if load is not None:
            load.wait(120)
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    assert len(java) >= 50 and not any(java), [j for j in java if j][:3]
    assert b"spark_jvm" not in err.read_bytes()
    assert files and max(files) <= 20, max(files)
    assert is_delta(lake / STATE) and list_tables(lake), "compaction made state and the typed tables"
    run_to_end(config, node_dir, tmp_path / "daemon-final.err")
    rows = lake_rows(lake)
    positions = list(
        zip(*(rows.column(c).to_pylist() for c in ("wal_segment", "wal_offset", "wal_index")), strict=True)
    )
    assert sorted(positions) == sorted(tuple(e["pos"]) for e in wal_events(node_dir))
