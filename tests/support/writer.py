"""The deterministic node writer: transactions ``tx_writes(n)`` over three caches, in-process or as a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cdcd.node import Node

CACHES = ("orders", "users", "events")


KEYSPACE = 5003


PUTS_PER_TX = 40


REMOVES_PER_TX = 10


WRITER_NODE_SETTINGS: dict[str, Any] = {
    "wal_mode": "background",
    "wal_segment_size_bytes": 64 * 1024,
    "wal_force_archive_timeout_ms": 100,
    "archive_max_bytes": 0,
    "checkpoint_interval_ms": 500,
}


# --- the deterministic writer ---------------------------------------------------------------------
def _key(cache: str, k: int) -> Any:
    if cache == "orders":
        return k
    if cache == "users":
        return f"user-{k}"
    return [k // 100, k % 100]  # a composite key (a MessagePack array, a JSON list)


def tx_writes(n: int, key_base: int = 0) -> list[tuple[str, Any, Any]]:
    """Writes of transaction ``n`` as (cache, key, value); value None is a remove.

    Puts go to one cache, removes to another, so one DataRecord spans two caches; removes reach
    keys written by earlier transactions (and write nothing when the key is absent). ``key_base``
    shifts the keys (``KEYSPACE`` apart: writers that must not share keys, as a cluster's nodes
    each own theirs).
    """
    put_cache, del_cache = CACHES[n % 3], CACHES[(n + 1) % 3]
    writes: list[tuple[str, Any, Any]] = []
    for i in range(PUTS_PER_TX):
        k = key_base + (n * 37 + i * 101) % KEYSPACE
        writes.append((put_cache, _key(put_cache, k), {"n": n, "i": i, "pad": "x" * (n % 13)}))
    for i in range(REMOVES_PER_TX):
        k = key_base + (n * 53 + i * 211) % KEYSPACE
        writes.append((del_cache, _key(del_cache, k), None))
    return writes


def write_tx(node: Node, n: int, key_base: int = 0) -> None:
    """Commit transaction ``n`` (``tx_writes(n, key_base)``) on ``node``."""
    with node.transaction() as tx:
        for cache, key, value in tx_writes(n, key_base):
            if value is None:
                tx.remove(cache, key)
            else:
                tx.put(cache, key, value)


def expected_final_state(n_tx: int) -> dict[str, dict[str, Any]]:
    """Cache contents after transactions 0..n_tx-1 (keys as their JSON text)."""
    state: dict[str, dict[str, Any]] = {c: {} for c in CACHES}
    for n in range(n_tx):
        for cache, key, value in tx_writes(n):
            k = json.dumps(key)
            if value is None:
                state[cache].pop(k, None)
            else:
                state[cache][k] = value
    return state


def writer_main() -> None:
    """Child process: ``node_dir count stop_file pause_ms done_file [key_base]`` (count 0: until stop_file exists)."""
    node_dir, count_s, stop_file, pause_ms_s, done_file = sys.argv[1:6]
    count, pause_s = int(count_s), float(pause_ms_s) / 1000
    key_base = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    node = Node.open(node_dir, **WRITER_NODE_SETTINGS)
    progress = Path(done_file).with_suffix(".progress")
    n = 0
    try:
        while (n < count) if count else not os.path.exists(stop_file):
            write_tx(node, n, key_base)
            n += 1
            if n % 500 == 0:  # committed transactions so far, for a test that waits for a volume
                progress.with_suffix(".tmp").write_text(f"{n}\n")
                os.replace(progress.with_suffix(".tmp"), progress)
            if pause_s and n % 10 == 0:
                time.sleep(pause_s)
        node.force_archive()  # close() leaves the active segment unarchived: make every write visible to CDC
    finally:
        node.close()
    Path(done_file).write_text(f"{n}\n")


def start_writer(
    tmp: Path, node_dir: Path, *, count: int = 0, pause_ms: float = 0, key_base: int = 0
) -> subprocess.Popen[bytes]:
    # Imported here, in the test's process: tests.support.procs brings the whole daemon (numpy among it), a large
    # part of the start of the writer process, which needs none of it.
    from tests.support.procs import ROOT, child_env

    code = "import tests.support.writer as t; t.writer_main()"
    args = [str(node_dir), str(count), str(tmp / "writer.stop"), str(pause_ms), str(tmp / "writer.done"), str(key_base)]
    log = (tmp / "writer.log").open("wb")
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=log, stderr=log, env=child_env(), cwd=ROOT)


def writer_count(tmp: Path) -> int:
    return int((tmp / "writer.done").read_text())


def writer_progress(tmp: Path) -> int:
    """Transactions the running writer has committed, in steps of 500 (0 before the first 500)."""
    try:
        return int((tmp / "writer.progress").read_text())
    except FileNotFoundError:
        return 0


def make_node(node_dir: Path, segments: int, tx_per_segment: int, *, first_tx: int = 0, **settings: Any) -> int:
    """Write ``segments`` archived segments of ``tx_writes`` transactions in-process; returns the next tx."""
    opts = {**WRITER_NODE_SETTINGS, "wal_force_archive_timeout_ms": 0, "wal_segment_size_bytes": 1 << 20, **settings}
    n = first_tx
    with Node.open(node_dir, **opts) as node:
        for _ in range(segments):
            for _ in range(tx_per_segment):
                write_tx(node, n)
                n += 1
            node.force_archive()
    return n
