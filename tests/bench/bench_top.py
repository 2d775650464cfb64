"""What ``cdcd top`` costs the daemon: one backlog replayed by ``cdcd run`` (null consumer, metrics
endpoint on) with and without a live ``cdcd top`` (in a pseudo-terminal, 1 s refresh) watching it,
alternating in one run, and how often top refreshed meanwhile.

The backlog is bench_daemon's (fresh int keys, 100-byte values, transactions of 10) in 2 MiB
segments, so the catch-up is timed over many links: from the first link the daemon deletes to the
last (its start-up is not timed). Top's refreshes are counted by its header in the terminal output.

``python -m tests.bench.bench_top [--entries 1000000] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import NamedTuple

from tests.bench import bench_daemon
from tests.bench.bench_daemon import BACKLOG, _start_daemon, _write_daemon_config
from tests.support.bench import _child_env, _links, _stop, _tail
from tests.support.cpu import cpu_s
from tests.support.ports import free_port
from tests.support.procs import reap

SEGMENT_BYTES = 2 << 20
TIMEOUT_S = 600.0


class TopInPty:
    """``python -m cdcd.top`` on a 160x45 pseudo-terminal; counts the screens it draws."""

    def __init__(self, config: Path) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 160, 0, 0))
        env = {k: v for k, v in _child_env().items() if k not in ("COLUMNS", "LINES")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdcd.top", "--config", str(config), "--interval-ms", "1000"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.master = master
        self.screens: list[float] = []
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.screens += [time.monotonic()] * data.count(b"cdcd top")

    def stop(self) -> None:
        os.write(self.master, b"q")
        try:
            self.proc.wait(30)
        finally:
            reap(self.proc)
            os.close(self.master)


class Run(NamedTuple):
    seconds: float
    """From the first link consumed to the last."""
    daemon_cpu_s: float
    top_cpu_s: float
    screens: list[float]
    """When top drew a screen, within the catch-up."""


def replay_once(work: Path, entries: int, with_top: bool) -> Run:
    last = BACKLOG.restore(entries)
    config = work / "daemon.toml"
    _write_daemon_config(config, BACKLOG.node_dir, {"kind": "null"})
    text = config.read_text().replace('metrics_address = ""', f'metrics_address = "127.0.0.1:{free_port()}"')
    config.write_text(text)
    top = TopInPty(config) if with_top else None
    if top is not None:  # watching before the daemon starts, as an operator would
        deadline = time.monotonic() + 60
        while not top.screens and time.monotonic() < deadline:
            time.sleep(0.05)
        assert top.screens, "cdcd top drew nothing in 60 s"
    log = work / "daemon.log"
    proc = _start_daemon(config, log)
    try:
        while len(_links(BACKLOG.cdc_dir)) > last:  # nothing deleted yet (start-up)
            if proc.poll() is not None:
                raise RuntimeError(f"cdcd run exited {proc.returncode}:\n{_tail(log)}")
            time.sleep(0.002)
        t0 = time.monotonic()
        cpu0, top_cpu0 = cpu_s(proc.pid), cpu_s(top.proc.pid) if top else 0.0
        while _links(BACKLOG.cdc_dir):
            if proc.poll() is not None or time.monotonic() - t0 > TIMEOUT_S:
                raise RuntimeError(f"cdcd run did not catch up:\n{_tail(log)}")
            time.sleep(0.002)
        t1 = time.monotonic()
        cpu1, top_cpu1 = cpu_s(proc.pid), cpu_s(top.proc.pid) if top else 0.0
    finally:
        _stop(proc, log)
        if top is not None:
            top.stop()
    screens = [t for t in (top.screens if top else []) if t0 <= t <= t1]
    return Run(t1 - t0, cpu1 - cpu0, top_cpu1 - top_cpu0, screens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    bench_daemon.BACKLOG_NODE_SETTINGS["wal_segment_size_bytes"] = SEGMENT_BYTES
    BACKLOG.ensure(args.entries)
    print(f"backlog: {args.entries:,} entries in {BACKLOG.marks[args.entries] + 1} segments", flush=True)
    runs: dict[bool, list[Run]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="cdcd-bench-top-") as tmp:
        for i in range(args.repeats):
            for with_top in (False, True) if i % 2 == 0 else (True, False):
                run = replay_once(Path(tmp), args.entries, with_top)
                runs[with_top].append(run)
                gaps = [b - a for a, b in itertools.pairwise(run.screens)]
                extra = (
                    f", top {run.top_cpu_s:.2f} s CPU, {len(run.screens)} screens, max gap {max(gaps, default=0):.2f} s"
                )
                print(
                    f"  {'with top   ' if with_top else 'without top'}: {run.seconds:.2f} s, daemon "
                    f"{run.daemon_cpu_s:.2f} s CPU{extra if with_top else ''}",
                    flush=True,
                )
    for label, key in (("catch-up", "seconds"), ("daemon CPU", "daemon_cpu_s")):
        base = statistics.median(getattr(r, key) for r in runs[False])
        watched = statistics.median(getattr(r, key) for r in runs[True])
        print(f"median {label}: without top {base:.2f} s, with top {watched:.2f} s: {100 * (watched / base - 1):+.1f}%")
    top_cpu = sum(r.top_cpu_s for r in runs[True]) / sum(r.seconds for r in runs[True])
    gaps = [b - a for r in runs[True] for a, b in itertools.pairwise(r.screens)]
    print(f"top itself: {100 * top_cpu:.1f}% of one core while the daemon caught up")
    if gaps:
        print(f"top's refresh while catching up: median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s")


if __name__ == "__main__":
    main()
