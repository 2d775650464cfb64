"""A node that cannot write says so and stops (issue 29 item 2): a checkpoint failure that does not
clear by itself (here LMDB's map full, a real fault of a real store) shows in ``control status``,
refuses writes with the cause, and makes ``cdcd node run`` exit 1 with one line (no more watchdog
pings). Before, ``node run`` logged ``checkpoint_failed`` once and kept running, exit 0 on SIGTERM."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cdcd.node import Node
from tests.support.procs import cdcd


def test_a_failed_checkpoint_shows_in_status_and_refuses_writes(tmp_path: Path) -> None:
    node = Node.open(tmp_path / "node", lmdb_map_size_bytes=256 * 1024, checkpoint_interval_ms=3_600_000)
    try:
        cache = node.cache("c")
        cache.put_all({i: "x" * 200 for i in range(5000)})
        with pytest.raises(OSError, match="MDB_MAP_FULL"):
            node.checkpoint()
        deadline = time.monotonic() + 60
        while node.failure is None:  # the checkpointer's own run reports it to the node
            node._checkpoint_wake.set()
            assert time.monotonic() < deadline, "the checkpointer never reported the failure"
            time.sleep(0.05)
        assert node.status()["writes"].startswith("failed: OSError: ")
        with pytest.raises(RuntimeError, match=r"failed: .*MDB_MAP_FULL"):
            cache.put("more", 1)
    finally:
        node.close()


def test_node_run_exits_1_with_one_line_when_the_node_refuses_writes(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(f'node_dir = "{tmp_path / "node"}"\nlmdb_map_size_bytes = 262144\ncheckpoint_interval_ms = 50\n')
    proc = cdcd("node", "run", "--config", str(config), "--load-rate", "20000", "--seconds", "120", timeout=180)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("cdcd: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "the node refuses writes: OSError:" in errors[0] and "MDB_MAP_FULL" in errors[0]
