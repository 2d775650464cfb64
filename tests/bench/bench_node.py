"""Node write throughput: ``Cache.put`` / ``Cache.put_all`` of 100-byte values into a fresh node.

Each repetition opens a new node in a fresh temp dir (``$CDCD_BENCH_DIR`` or the system temp
dir, which must be a real disk for the fsync numbers to mean anything), writes fresh keys
(every entry is a CREATE, so each one also costs an LMDB existence lookup), and times from the
first put to the end of a final ``Node.flush()`` (everything durable). Opening and closing the
node are not timed. The node runs with its default settings except ``wal_mode`` and a 64 MiB
segment, so the flusher's 1 s force-archive rolls and the checkpointer run during the measurement,
as they would in production. The background runs write 300k entries so that one checkpoint (at
``checkpoint_dirty_max_entries`` = 200k) falls inside the timed window: the number is a sustained
rate, not a burst into an empty dirty map (``--quick`` writes 30k and so measures the burst).

Besides the rate, each run records (JSON ``runs``): completed checkpoints, WAL fsyncs, entries per
fsync (group commit), archived segments, and CPU microseconds per entry for the whole process and
for the writer thread -- on a busy machine those move far less than the wall-clock rate.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

from prometheus_client import REGISTRY

from cdcd.node.node import Node
from tests.support.bench import VALUE_100B, Bench, Measurement

SEGMENT_BYTES = 64 << 20
BACKGROUND_GOAL = 150_000.0


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


_COUNTERS = {
    "checkpoints": "cdcd_node_checkpoints_total",
    "wal_fsyncs": "cdcd_node_wal_fsyncs_total",
    "segments_archived": "cdcd_node_segments_archived_total",
}


def _writer(node: Node, first_key: int, entries: int, batch: int, deadline: float, out: list[int], idx: int) -> None:
    """Write ``entries`` fresh keys starting at ``first_key`` (``batch`` > 1: via put_all), or stop at ``deadline``."""
    cache = node.cache("bench")
    value = VALUE_100B
    perf = time.perf_counter
    done = 0
    if batch == 1:
        put = cache.put
        for i, key in enumerate(range(first_key, first_key + entries)):
            if not i & 63 and perf() > deadline:
                break
            put(key, value)
            done += 1
    else:
        # The 10-key dict is built inside the timed loop, as a caller would (~1 us per batch).
        put_all = cache.put_all
        for i, start in enumerate(range(first_key, first_key + entries, batch)):
            if not i & 7 and perf() > deadline:
                break
            n = min(batch, first_key + entries - start)
            put_all({k: value for k in range(start, start + n)})
            done += n
    out[idx] = done


def run_node(*, mode: str, entries: int, threads: int = 1, batch: int = 1, time_cap_s: float = 600.0) -> Measurement:
    base = os.environ.get("CDCD_BENCH_DIR") or None
    tmp = tempfile.mkdtemp(prefix="cdcd-bench-node-", dir=base)
    try:
        node = Node.open(tmp, wal_mode=mode, wal_segment_size_bytes=SEGMENT_BYTES)
        try:
            node.cache("bench")
            before = {k: _counter(v) for k, v in _COUNTERS.items()}
            per_thread = entries // threads
            done = [0] * threads
            cpu0, thread_cpu0 = time.process_time(), time.thread_time()
            if threads == 1:
                t0 = time.perf_counter()
                _writer(node, 0, per_thread, batch, t0 + time_cap_s, done, 0)
            else:
                go = threading.Barrier(threads + 1)
                deadline = [0.0]

                def worker(idx: int) -> None:
                    go.wait()
                    _writer(node, idx * per_thread, per_thread, batch, deadline[0], done, idx)

                workers = [threading.Thread(target=worker, args=(i,), name=f"bench-writer-{i}") for i in range(threads)]
                for w in workers:
                    w.start()
                t0 = time.perf_counter()
                deadline[0] = t0 + time_cap_s
                go.wait()
                for w in workers:
                    w.join()
            node.flush()
            seconds = time.perf_counter() - t0
            # CPU time per entry: all threads of the process, and (one writer) the writer thread alone.
            cpu, thread_cpu = time.process_time() - cpu0, time.thread_time() - thread_cpu0
            extra: dict[str, Any] = {k: int(_counter(v) - before[k]) for k, v in _COUNTERS.items()}
            total = sum(done)
            extra["process_cpu_us_per_entry"] = round(cpu / total * 1e6, 2) if total else None
            if threads == 1:
                extra["writer_cpu_us_per_entry"] = round(thread_cpu / total * 1e6, 2) if total else None
            if extra["wal_fsyncs"]:
                extra["entries_per_fsync"] = round(total / extra["wal_fsyncs"], 1)
            extra["capped"] = total < per_thread * threads
        finally:
            node.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Measurement(total, seconds, extra)


def benchmarks(quick: bool) -> list[Bench]:
    bg_entries = 30_000 if quick else 300_000
    fsync1 = 2_000 if quick else 20_000
    fsync8 = 8_000 if quick else 80_000
    cap = 1.0 if quick else 4.0
    specs: list[tuple[str, str, dict[str, Any], float | None]] = [
        (
            "node.fsync.put.1thread",
            "wal_mode=fsync, 1 thread, single puts (one fsync per commit)",
            {"mode": "fsync", "entries": fsync1, "threads": 1, "batch": 1, "time_cap_s": cap},
            None,
        ),
        (
            "node.fsync.put.8threads",
            "wal_mode=fsync, 8 threads, single puts (group commit)",
            {"mode": "fsync", "entries": fsync8, "threads": 8, "batch": 1, "time_cap_s": cap},
            None,
        ),
        (
            "node.background.put",
            "wal_mode=background, 1 thread, single puts",
            {"mode": "background", "entries": bg_entries, "threads": 1, "batch": 1},
            BACKGROUND_GOAL,
        ),
        (
            "node.background.put_all10",
            "wal_mode=background, 1 thread, put_all of 10 entries",
            {"mode": "background", "entries": bg_entries, "threads": 1, "batch": 10},
            BACKGROUND_GOAL,
        ),
    ]
    return [
        Bench(
            name=name,
            description=desc,
            run_once=lambda p=params: run_node(**p),
            goal=goal,
            params={**params, "value_bytes": len(VALUE_100B) + 2, "wal_segment_size_bytes": SEGMENT_BYTES},
        )
        for name, desc, params, goal in specs
    ]
