"""The command line, run as real subprocesses: `cdcd wal dump` and `cdcd node run`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from cdcd.node import Node
from cdcd.wal.segment import segment_name
from tests.support.procs import reap

CDCD = [sys.executable, "-m", "cdcd"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CDCD, *args], capture_output=True, text=True, timeout=timeout)


def make_node(node_dir: Path) -> None:
    with Node.open(node_dir, wal_segment_size_bytes=4096, wal_force_archive_timeout_ms=0) as n:
        c = n.cache("orders")
        for i in range(400):
            c.put(i, {"n": i, "pad": "x" * 20})
        c.remove(7)


def test_wal_dump_node_dir_and_from(tmp_path: Path) -> None:
    """`wal dump` of a node's work dir prints every record as JSON with its pointer; --from starts there."""
    make_node(tmp_path)
    res = run("wal", "dump", str(tmp_path / "wal"))
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    data = [e for rec in lines if rec["type"] == "DataRecord" for e in rec["entries"]]
    assert [e["key"] for e in data] == [*range(400), 7]
    assert data[-1]["op"] == "delete" and data[-1]["value"] is None
    assert data[0] == {
        "cache_id": data[0]["cache_id"],
        "op": "create",
        "key": 0,
        "value": {"n": 0, "pad": "x" * 20},
        "partition": data[0]["partition"],
        "version": {
            "order": 1,
            "node_order": 1,
            "cluster_id": 1,
            "topology_version": data[0]["version"]["topology_version"],  # the node's open (milliseconds)
            "other_cluster_version": None,
        },
        "primary": True,
        "expire_time_ms": 0,
    }
    assert data[0]["version"]["topology_version"] > 0
    mid = lines[len(lines) // 2]
    res2 = run("wal", "dump", str(tmp_path / "wal"), "--from", mid["pos"])
    assert [json.loads(x) for x in res2.stdout.splitlines()] == lines[len(lines) // 2 :]


def test_wal_dump_corrupt_segment_names_file_and_offset(tmp_path: Path) -> None:
    """A corrupt record stops `wal dump` with exit 5 (as it stops `cdcd run`) and one line naming file and offset,
    after the good records."""
    make_node(tmp_path)
    seg = tmp_path / "cdc" / segment_name(1)
    good = run("wal", "dump", str(seg))
    recs = [json.loads(x) for x in good.stdout.splitlines()]
    bad_off = recs[3]["offset"]
    data = bytearray(seg.read_bytes())
    data[bad_off + 15] ^= 0xFF
    seg.write_bytes(bytes(data))
    res = run("wal", "dump", str(seg))
    assert res.returncode == 5
    assert len(res.stdout.splitlines()) == 3
    err = res.stderr.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"cdcd: error: {seg} at offset {bad_off}: CRC mismatch in segment 1")


def test_wal_dump_gap_exit_3(tmp_path: Path) -> None:
    """A missing segment in a directory dump exits 3 with `missing segment N`."""
    make_node(tmp_path)
    os.unlink(tmp_path / "cdc" / segment_name(2))
    res = run("wal", "dump", str(tmp_path / "cdc"))
    assert res.returncode == 3
    assert "missing segment 2" in res.stderr


def test_node_run_with_load_and_clean_stop(tmp_path: Path) -> None:
    """`node run --load-rate` writes data, stops cleanly on SIGTERM (exit 0) and the data reopens."""
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'node_dir = "{tmp_path / "n"}"\nwal_force_archive_timeout_ms = 200\n')
    proc = subprocess.Popen(
        [*CDCD, "node", "run", "--config", str(cfg), "--load-rate", "2000", "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
    )
    # Stop once the load has filled two segments (each archived after it held data for 200 ms).
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if sum('"segment_archived"' in seen for seen in lines) >= 2:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = [json.loads(line)["event"] for line in [*lines, *err.splitlines()]]
    # The Stop record written at open can be archived (by the flusher thread) before the opening
    # thread logs node_opened: order only the last line.
    assert "node_opened" in events and events[-1] == "node_closed"
    assert events.count("segment_archived") >= 2
    with Node.open(tmp_path / "n") as n:
        assert len(n.cache("load")) > 0


def test_node_run_bad_config_and_second_instance(tmp_path: Path) -> None:
    """A bad config key exits 2 naming it; a second `node run` on a held dir exits 1 naming the pid."""
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'node_dir = "{tmp_path / "n"}"\nwal_mod = "fsync"\n')
    res = run("node", "run", "--config", str(cfg))
    assert res.returncode == 2
    assert res.stderr.strip() == f"cdcd: error: {cfg}: unknown key 'wal_mod' (did you mean 'wal_mode'?)"
    cfg.write_text(f'node_dir = "{tmp_path / "n"}"\n')
    with Node.open(tmp_path / "n"):
        res = run("node", "run", "--config", str(cfg))
    assert res.returncode == 1
    assert f"locked by pid {os.getpid()}" in res.stderr


STOP_SIGNALS_CHILD = """
import sys, time
from cdcd.cli import on_stop_signals
on_stop_signals(lambda s: print("stop", s.name, flush=True))
print("ready", flush=True)
time.sleep(120)
"""


def test_stop_signals_first_stops_second_leaves_at_once() -> None:
    """The one stop-signal handler of `cdcd run`, `cdcd node run` and `cdcd demo`: the first SIGTERM or SIGINT
    asks to stop, a second one (either) ends the process at once with 128 + its number."""
    for first, second in ((signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)):
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        proc = subprocess.Popen([sys.executable, "-c", STOP_SIGNALS_CHILD], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
            proc.send_signal(first)
            assert proc.stdout.readline() == f"stop {first.name}\n"
            assert proc.poll() is None, "the first signal only asks to stop"
            proc.send_signal(second)
            assert proc.wait(30) == 128 + second
            assert proc.stdout.read() == ""
        finally:
            reap(proc)
