"""A node or daemon never hangs on its log, a dead thread or a close that does not end (issue 44 s.4).

Before: ``cdcd node run ... 2>&1 | head -3`` never exited after ``head`` did (the WAL flusher died of the
EPIPE of a log line, writers waited in ``wait_durable`` forever, ``node.lock`` stayed held, only SIGKILL
ended it). Now a log line that cannot be written is dropped and counted, a log reader gone stops the
process cleanly (exit 141), a dead flusher ends ``node run`` with one line, and every stop ends within
``--stop-timeout``. Every case is a real process, with a real pipe, ``/dev/full`` or a closed stderr."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

from cdcd.cli.process import STOP_BOUND_S
from cdcd.logging import STUCK_WAIT_S, _Stderr, lines_lost
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import CDCD, child_env, error_lines, log_events, reap, wait_for
from tests.support.writer import make_node

SIGPIPE_EXIT = 128 + signal.SIGPIPE


def node_config(tmp: Path, **settings: Any) -> Path:
    path = tmp / "node.toml"
    lines = [f'node_dir = "{tmp / "node"}"', *(f"{k} = {json.dumps(v)}" for k, v in settings.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_lines(pipe: IO[bytes], count: int, timeout: float) -> list[bytes]:
    """``count`` lines from ``pipe`` (what ``head`` reads), within ``timeout``."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = pipe.fileno()
    while buf.count(b"\n") < count:
        left = deadline - time.monotonic()
        assert left > 0, f"fewer than {count} lines within {timeout}s: {buf[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"the process closed its output after {buf[-2000:]!r}"
            buf += chunk
    return buf.split(b"\n")[:count]


def run_like_head(args: list[str], lines: int = 3) -> tuple[int, float]:
    """``cdcd ARGS 2>&1 | head -LINES``: read that many lines, close the pipe, and time the exit. The
    stop timeout is set far beyond the wait: only a clean stop can exit in time."""
    proc = subprocess.Popen(
        [*CDCD, *args, "--stop-timeout", "600"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env()
    )
    try:
        assert proc.stdout is not None
        read_lines(proc.stdout, lines, 120)
        proc.stdout.close()
        closed = time.monotonic()
        rc = proc.wait(STOP_BOUND_S)
        return rc, time.monotonic() - closed
    finally:
        reap(proc)


def scrape(port: int) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # summed over labels
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_node_piped_into_head_exits_by_itself_and_opens_again(tmp_path: Path) -> None:
    """The issue's reproduction: once ``head`` has its three lines and exits, the node stops as on
    SIGTERM (exit 141, well within the bound), and the next ``node run`` on the same dir starts (no
    stale lock) from a clean close (a checkpoint, not the whole WAL replayed)."""
    config = node_config(tmp_path)
    rc, took = run_like_head(["node", "run", "--config", str(config), "--load-rate", "500", "--log-format", "json"])
    assert rc == SIGPIPE_EXIT, rc
    again = subprocess.run(
        [*CDCD, "node", "run", "--config", str(config), "--seconds", "0.2", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert again.returncode == 0, again.stderr[-2000:]
    opened = next(json.loads(line) for line in again.stderr.splitlines() if '"node_opened"' in line)
    assert opened["checkpoint"] is not None and opened["records_replayed"] <= 2, opened
    print(f"node exited {took:.2f}s after its log reader")


def test_daemon_piped_into_head_exits_by_itself_and_starts_again(tmp_path: Path) -> None:
    """``cdcd run ... 2>&1 | head -3``: the daemon, idle once it delivered the node's segments, stops
    when its log reader goes (exit 141) instead of running unseen forever; the next one gets its lock."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=20)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    rc, took = run_like_head(["run", "--config", str(config), "--log-format", "json"])
    assert rc == SIGPIPE_EXIT, rc
    err = tmp_path / "again.err"
    with err.open("wb") as out:
        again = subprocess.Popen([*CDCD, "run", "--config", str(config)], stderr=out, env=child_env())
    try:
        wait_for(
            lambda: again.poll() is not None or any(e["event"] == "daemon_started" for e in log_events(err)),
            60,
            "the second daemon's start",
        )
        assert again.poll() is None, err.read_text()[-2000:]
        again.send_signal(signal.SIGTERM)
        assert again.wait(STOP_BOUND_S) == 0, err.read_text()[-2000:]
    finally:
        reap(again)
    print(f"daemon exited {took:.2f}s after its log reader")


def test_a_dead_flusher_ends_node_run_with_one_line(tmp_path: Path) -> None:
    """The WAL flusher dies of an exception (fail point ``wal.flush=raise``) under load: writers get an
    error instead of waiting forever, ``node run`` exits 1 with one error line naming the failure, no
    traceback, and the dir opens again."""
    config = node_config(tmp_path)
    err = tmp_path / "node.err"
    env = {**child_env(), "CDCD_FAILPOINTS": "wal.flush@20=raise"}
    args = ["node", "run", "--config", str(config), "--load-rate", "2000", "--log-format", "json"]
    with err.open("wb") as out:
        proc = subprocess.Popen([*CDCD, *args, "--seconds", "120"], stderr=out, env=env)
    try:
        rc = proc.wait(60)
    finally:
        reap(proc)
    text = err.read_text()
    assert rc == 1, text[-2000:]
    assert "Traceback" not in text
    lines = error_lines(err)
    assert lines == [
        f"cdcd: error: {tmp_path / 'node'}: the node refuses writes: FailpointRaised: fail point wal.flush"
    ], text[-2000:]
    events = [e["event"] for e in log_events(err)]
    assert "wal_flusher_failed" in events and events[-1] == "node_closed", events[-5:]  # closed, not cut off
    again = subprocess.run(
        [*CDCD, *args, "--seconds", "0.2"], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert again.returncode == 0, again.stderr[-2000:]


def test_sigterm_with_stderr_on_a_full_disk_stops_and_lost_lines_are_counted(tmp_path: Path) -> None:
    """stderr on ``/dev/full`` (every write ENOSPC): the node goes on writing, counts the lines it could
    not log in ``cdcd_node_log_lines_lost_total``, and SIGTERM stops it cleanly (exit 0)."""
    port = free_port()
    config = node_config(tmp_path, metrics_address=f"127.0.0.1:{port}", wal_force_archive_timeout_ms=100)
    with open("/dev/full", "wb") as full:
        proc = subprocess.Popen(
            [*CDCD, "node", "run", "--config", str(config), "--load-rate", "500", "--log-format", "json"],
            stdout=subprocess.DEVNULL,
            stderr=full,
            env=child_env(),
        )
    try:
        first = wait_for(lambda: (m := scrape(port)) and m["cdcd_node_log_lines_lost_total"] >= 3 and m, 60, "lost")
        wait_for(
            lambda: (
                (m := scrape(port))
                and m["cdcd_node_segments_archived_total"] > first["cdcd_node_segments_archived_total"] + 2
                and m["cdcd_node_log_lines_lost_total"] > first["cdcd_node_log_lines_lost_total"]
            ),
            60,
            "segments archived and their lines lost meanwhile",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0
    finally:
        reap(proc)


def test_daemon_with_stderr_on_a_full_disk_delivers_counts_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The daemon on ``/dev/full``: it delivers every entry, counts its lost lines in
    ``cdcd_daemon_log_lines_lost_total``, and SIGTERM stops it cleanly (exit 0)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=10)
    port = free_port()
    out = tmp_path / "out.jsonl"
    config = write_daemon_config(
        tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), metrics_address=f"127.0.0.1:{port}"
    )
    with open("/dev/full", "wb") as full:
        proc = subprocess.Popen(
            [*CDCD, "run", "--config", str(config), "--log-format", "json"],
            stdout=subprocess.DEVNULL,
            stderr=full,
            env=child_env(),
        )
    try:
        wait_for(
            lambda: (
                (m := scrape(port))
                and m["cdcd_daemon_log_lines_lost_total"] >= 2
                and m.get("cdcd_daemon_events_total", 0) > 0
                and m["cdcd_daemon_segments_pending"] == 0  # after a first commit: every link consumed
            ),
            60,
            "both segments delivered, the lines lost",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0
    finally:
        reap(proc)


def test_a_closed_stderr_never_lands_in_a_node_file(tmp_path: Path) -> None:
    """Started with stderr closed (``2>&-``), the node takes descriptor 2 for /dev/null before it opens
    anything, so no WAL segment or LMDB file gets number 2 and log lines into it: it writes, counts its
    lines lost, stops on SIGTERM, and the next open reads its WAL without a torn tail."""
    port = free_port()
    config = node_config(tmp_path, metrics_address=f"127.0.0.1:{port}", wal_force_archive_timeout_ms=100)
    args = [*CDCD, "node", "run", "--config", str(config), "--load-rate", "500", "--log-format", "json"]
    proc = subprocess.Popen(["sh", "-c", 'exec "$@" 2>&-', "sh", *args], stdout=subprocess.DEVNULL, env=child_env())
    try:
        wait_for(
            lambda: (
                (m := scrape(port))
                and m["cdcd_node_log_lines_lost_total"] >= 5
                and m["cdcd_node_segments_archived_total"] >= 3
            ),
            60,
            "segments archived, their lines lost",
        )
        fd2 = os.readlink(f"/proc/{proc.pid}/fd/2")
        assert fd2 == "/dev/null", fd2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0
    finally:
        reap(proc)
    again = subprocess.run(
        [*args[:-4], "--seconds", "0.2", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "wal_tail_truncated" not in again.stderr, again.stderr[-2000:]


def test_a_close_that_hangs_ends_at_the_stop_timeout_with_one_line(tmp_path: Path) -> None:
    """SIGTERM, then the close hangs (fail point ``node.run.closing=pause``): the process leaves at
    ``--stop-timeout`` with one line and 128 + SIGTERM, and the next open recovers."""
    config = node_config(tmp_path)
    err = tmp_path / "node.err"
    env = {**child_env(), "CDCD_FAILPOINTS": "node.run.closing=pause", "CDCD_FAILPOINTS_DIR": str(tmp_path)}
    args = ["node", "run", "--config", str(config), "--load-rate", "500", "--log-format", "json"]
    with err.open("wb") as out:
        proc = subprocess.Popen([*CDCD, *args, "--stop-timeout", "1"], stderr=out, env=env)
    try:
        wait_for(lambda: any(e["event"] == "segment_archived" for e in log_events(err)), 60, "the node's first segment")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: (tmp_path / "node.run.closing").exists(), 30, "the close held at its fail point")
        rc = proc.wait(30)  # the pause alone would hold it for ten minutes
    finally:
        reap(proc)
    assert rc == 128 + signal.SIGTERM, err.read_text()[-2000:]
    lines = error_lines(err)
    assert lines == [
        f"cdcd: error: the node of {config} did not stop within 1 s of SIGTERM: left without closing "
        "(the next start recovers from the WAL)"
    ], err.read_text()[-2000:]
    # Each thread's stack comes before that line: the main thread's names the fail point it waits in.
    text = err.read_text().splitlines()
    stacks = {
        line.split(" at the stop bound: ")[0]: line.split(" at the stop bound: ")[1]
        for line in text
        if line.startswith("cdcd: thread ")
    }
    assert max(i for i, line in enumerate(text) if line.startswith("cdcd: thread ")) < text.index(lines[0])
    frames = [re.sub(r":\d+ ", " ", frame) for frame in stacks["cdcd: thread MainThread"].split(" < ")]
    assert frames[frames.index("cdcd/failpoints.py hit") + 1] == "cdcd/node/run.py run_node", frames
    again = subprocess.run(
        [*CDCD, *args, "--seconds", "0.2"], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_log_write_to_a_reader_that_stopped_reading_gives_up_and_counts() -> None:
    """A pipe nobody reads, filled up: a line waits at most ``STUCK_WAIT_S`` (the flusher that logs must
    not wait for the reader), is counted lost, and the lines after it are dropped at once until the
    reader reads again; a reader gone is seen and counted too."""
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(write_fd, False)
        while True:  # fill the pipe
            try:
                os.write(write_fd, b"x" * 65536)
            except BlockingIOError:
                break
        os.set_blocking(write_fd, True)
        out = _Stderr(write_fd, usable=True)
        before = lines_lost()
        started = time.monotonic()
        done = threading.Event()

        def write_two() -> None:
            out.write(b"one\n")
            out.write(b"two\n")
            done.set()

        threading.Thread(target=write_two, daemon=True).start()
        assert done.wait(STUCK_WAIT_S * 10), "a log write waited for a reader that does not read"
        took = time.monotonic() - started
        assert took < STUCK_WAIT_S * 5, took
        assert lines_lost() - before == 2
        while select.select([read_fd], [], [], 0)[0]:  # the reader reads again
            os.read(read_fd, 65536)
        assert out.write(b"three\n") == 6 and lines_lost() - before == 2
        assert b"three\n" in os.read(read_fd, 65536)
        os.close(read_fd)
        read_fd = -1
        out.write(b"four\n")
        assert out.gone.is_set() and lines_lost() - before == 3
    finally:
        os.close(write_fd)
        if read_fd >= 0:
            os.close(read_fd)
