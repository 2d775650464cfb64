"""Shared pieces of the chaos suite: results, the scenario context, a process rig, delivery accounting.

The reference is always the WAL (``tests.support.wal.wal_events``): every data entry it holds must reach the
consumer (``lost`` counts the ones that did not), every delivered line or row must be equal to its WAL entry, and
``duplicates`` counts deliveries beyond the first (at-least-once for JSON lines across crashes, zero for the lake).
"""

from __future__ import annotations

import bisect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from cdcd.wal import DataRecord, WalReader
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import ROOT, child_env, error_lines, start_daemon, wait_for
from tests.support.procs import committed as daemon_committed
from tests.support.realtime import DAEMON_SETTINGS, Rig, expected_shares, read_runs
from tests.support.wal import wal_events

Pos = tuple[int, int, int]
CHAOS_DIR = Path(__file__).resolve().parents[1] / "chaos"
PLUGINS = CHAOS_DIR / "plugins"
"""``chaos_sinks`` (python consumers); on every child's PYTHONPATH."""
CLOCKPATCH = CHAOS_DIR / "clockpatch"
"""``sitecustomize`` shifting time.time/time_ns; on the PYTHONPATH of the clock scenario's children only."""


class ChaosFailure(AssertionError):
    """A scenario's check failed (the message says what and where)."""


def check(cond: object, message: str) -> None:
    if not cond:
        raise ChaosFailure(message)


# --- results -----------------------------------------------------------------------------------------
@dataclass
class Result:
    """One row of the summary table."""

    name: str
    runs: int = 0
    written: int = 0
    delivered: int = 0
    lost: int = 0
    duplicates: int = 0
    duplicates_must_be_zero: bool = False
    passed: bool = False
    seconds: float = 0.0
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    tmp: str | None = None

    def add(self, d: Delivery) -> None:
        """Add one episode's delivery accounting."""
        self.written += d.written
        self.delivered += d.delivered
        self.lost += d.lost
        self.duplicates += d.duplicates

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Delivery:
    written: int
    """WAL data entries."""
    delivered: int
    """Distinct WAL data entries delivered."""
    lost: int
    duplicates: int
    """Deliveries beyond the first of an entry."""
    foreign: int = 0
    """Delivered positions that are not WAL data entries."""
    mismatched: int = 0
    """Delivered entries that differ from their WAL entry."""

    def check_clean(self, what: str) -> None:
        check(self.foreign == 0, f"{what}: {self.foreign} delivered positions are not WAL data entries")
        check(self.mismatched == 0, f"{what}: {self.mismatched} delivered entries differ from the WAL")
        check(self.lost == 0, f"{what}: {self.lost} of {self.written} WAL entries never delivered")


def jsonl_delivery(expected: list[dict[str, Any]], runs: Sequence[list[dict[str, Any]]]) -> Delivery:
    """Account JSON-lines runs (complete lines only) against the WAL's data entries."""
    index = {tuple(e["pos"]): i for i, e in enumerate(expected)}
    counts: Counter[int] = Counter()
    foreign = mismatched = 0
    for run in runs:
        for ev in run:
            i = index.get(tuple(ev["pos"]))
            if i is None:
                foreign += 1
                continue
            if ev != expected[i]:
                mismatched += 1
            counts[i] += 1
    total = sum(counts.values())
    return Delivery(len(expected), len(counts), len(expected) - len(counts), total - len(counts), foreign, mismatched)


def lake_rows(lake: Path) -> list[dict[str, Any]]:
    """Every row a reader of the Delta table ``<lake>/changes`` sees (its newest snapshot), commit_ts in µs."""
    from deltalake import DeltaTable

    if not (lake / "changes" / "_delta_log").is_dir():
        return []
    table = DeltaTable(str(lake / "changes")).to_pyarrow_table()
    idx = table.schema.get_field_index("commit_ts")
    table = table.set_column(idx, "commit_ts", table.column("commit_ts").cast(pa.int64()))
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def lake_delivery(lake: Path, expected: list[dict[str, Any]]) -> Delivery:
    """Account the lake's change log (read with pyarrow) against the WAL, row by row, column by column."""
    index = {tuple(e["pos"]): i for i, e in enumerate(expected)}
    counts: Counter[int] = Counter()
    foreign = mismatched = 0
    for r in lake_rows(lake):
        i = index.get((r["wal_segment"], r["wal_offset"], r["wal_index"]))
        if i is None:
            foreign += 1
            continue
        ev = expected[i]
        got = (
            r["cache"],
            r["op"],
            json.loads(r["key"]),
            json.loads(r["value"]) if r["value"] is not None else None,
            r["partition"],
            r["primary"],
            r["version_order"],
            r["version_cluster_id"],
            r["commit_ts"],
        )
        want = (
            ev["cache"],
            ev["op"],
            ev["key"],
            ev["value"] if ev["op"] != "delete" else None,
            ev["partition"],
            ev["primary"],
            ev["version"]["order"],
            ev["version"]["cluster_id"],
            ev["commit_ts_ns"] // 1000,
        )
        if got != want:
            mismatched += 1
        counts[i] += 1
    total = sum(counts.values())
    return Delivery(len(expected), len(counts), len(expected) - len(counts), total - len(counts), foreign, mismatched)


def check_lake_clean(lake: Path, expected: list[dict[str, Any]]) -> None:
    """No writer runs: every record a commit added is whole (no transaction split across commits)."""
    from tests.support.delta_lake import check_whole_records, record_sizes
    from tests.support.delta_lake import lake_rows as delta_rows

    if (lake / "changes" / "_delta_log").is_dir():
        check_whole_records(delta_rows(lake), record_sizes(expected), "lake")


def check_exact(r: ChaosRig) -> Delivery:
    """``tests.support.realtime.check_delivery`` for runs with kills anywhere: the node's and the daemon's JSON-lines
    files, split into runs at their SIGKILLs, are exactly their shares of the WAL (from its markers, see
    ``tests.support.realtime.daemon_intervals``); returns the accounting.

    Each run is a contiguous stretch of its side's share, equal to the WAL entry by entry, and begins exactly at the
    position that side had committed before the kill (never later: nothing skipped; earlier only for what was not
    committed: the duplicates). One case ``check_delivery`` does not know: a node killed while its realtime was not on
    has no committed position; its next run must begin where its share goes on (``frontier``: nothing skipped, nothing
    repeated) or, if it never committed in that stretch, at the stretch's first entry."""
    node_exp, daemon_exp, intervals = expected_shares(r.node_dir)
    stretch_starts = {0}
    node_positions = [tuple(e["pos"]) for e in node_exp]
    for _a, b in intervals:
        if b is not None:
            stretch_starts.add(bisect.bisect_left(node_positions, b))
    _check_side("node", read_runs(r.node_out, r.node_cuts), node_exp, r.node_resumes, stretch_starts)
    _check_side("daemon", read_runs(r.daemon_out, r.daemon_cuts), daemon_exp, r.daemon_resumes, None)
    expected = wal_events(r.node_dir)
    runs = r.jsonl_runs()
    d = jsonl_delivery(expected, runs)
    union = {tuple(e["pos"]) for run in runs for e in run}
    check(union == {tuple(e["pos"]) for e in expected}, "node and daemon together did not deliver exactly the WAL")
    return d


def _check_side(
    name: str,
    runs: list[list[dict[str, Any]]],
    expected: list[dict[str, Any]],
    resumes: list[Pos | None],
    stretch_starts: set[int] | None,
) -> None:
    positions = [tuple(e["pos"]) for e in expected]
    index = {p: i for i, p in enumerate(positions)}
    frontier = 0
    for k, run in enumerate(runs):
        idxs = []
        for ev in run:
            i = index.get(tuple(ev["pos"]))
            check(i is not None, f"{name} run {k}: {ev['pos']} is not in its share of the WAL")
            assert i is not None
            check(ev == expected[i], f"{name} run {k}: {ev} != {expected[i]}")
            idxs.append(i)
        if not idxs:
            continue
        check(idxs == list(range(idxs[0], idxs[0] + len(idxs))), f"{name} run {k}: not a contiguous stretch")
        start = idxs[0]
        resume = resumes[k - 1] if k else None
        if k and resume is not None:
            want = bisect.bisect_left(positions, resume)
            check(want <= frontier, f"{name} run {k}: committed {resume} is past what it delivered: lost entries")
            ok = start == want
        elif k and stretch_starts is not None:  # the node, killed without a committed position
            ok = start == frontier or (start in stretch_starts and start <= frontier)
        else:
            ok = start == 0
        check(
            ok,
            f"{name} run {k} began at {positions[start]} (entry {start}); committed before: {resume}, "
            f"delivered up to entry {frontier}: {'re-delivers committed entries' if start < frontier else 'skips'}",
        )
        frontier = max(frontier, idxs[-1] + 1)
    check(
        frontier == len(expected),
        f"{name}: {len(expected) - frontier} of {len(expected)} entries of its share never delivered",
    )


# --- the scenario context ----------------------------------------------------------------------------
@dataclass
class Ctx:
    name: str
    short: bool
    seed: int
    tmp: Path
    rng: random.Random
    log: Callable[[str], None]

    def pick(self, short: Any, full: Any) -> Any:
        return short if self.short else full

    def episode_dir(self, label: str) -> Path:
        path = self.tmp / label
        path.mkdir()
        return path


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_scenario(
    name: str, fn: Callable[[Ctx, Result], None], *, short: bool, seed: int, log: Callable[[str], None] = stderr_log
) -> Result:
    """Run one scenario in a fresh /tmp dir; a failure (any exception) is recorded, never raised. The dir is deleted
    after a pass and kept (its path in ``Result.tmp``) after a failure."""
    res = Result(name)
    tmp = Path(tempfile.mkdtemp(prefix=f"cdcd-chaos-{name}-", dir="/tmp"))
    ctx = Ctx(name, short, seed, tmp, random.Random(f"{seed}:{name}"), lambda m: log(f"[{name}] {m}"))
    t0 = time.monotonic()
    try:
        fn(ctx, res)
        check(res.lost == 0, f"{res.lost} entries lost")
        if res.duplicates_must_be_zero:
            check(res.duplicates == 0, f"{res.duplicates} entries delivered more than once (must be 0)")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        res.error = f"{type(exc).__name__}: {exc}"
        res.details["traceback"] = traceback.format_exc()
    finally:
        res.seconds = round(time.monotonic() - t0, 1)
        kill_leftovers(tmp)
    res.passed = res.error is None
    if res.passed:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        res.tmp = str(tmp)
    return res


_PROCS: list[subprocess.Popen[bytes]] = []
"""Every child this suite started (killed at the end of a scenario if still running)."""


def track(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    _PROCS.append(proc)
    return proc


def kill_leftovers(tmp: Path) -> None:
    """SIGKILL the children started by this suite that still run (by pid, one by one); unmount tmpfs under ``tmp``."""
    for proc in _PROCS:
        if proc.poll() is None:
            if _stopped(proc.pid):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    _PROCS.clear()
    for line in Path("/proc/mounts").read_text().splitlines():
        target = line.split()[1]
        if target.startswith(str(tmp)):
            subprocess.run(["umount", "-l", target], check=False)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


# --- the rig: a node process and a daemon process -------------------------------------------------------
class ChaosRig(Rig):
    """``tests.support.realtime.Rig`` with: the chaos plugins on the children's PYTHONPATH, any daemon consumer and
    settings, extra environment per process, start-without-waiting (to kill during start-up), and kills that notice
    a process which died by itself."""

    def __init__(
        self,
        tmp: Path,
        *,
        consumer: dict[str, Any] | None = None,
        daemon_consumer: dict[str, Any] | None = None,
        daemon_settings: dict[str, Any] | None = None,
        node_env: dict[str, str] | None = None,
        daemon_env: dict[str, str] | None = None,
        extra_path: Sequence[Path] = (),
        **node_settings: Any,
    ) -> None:
        super().__init__(tmp, consumer=consumer, **node_settings)
        self.extra_path = [PLUGINS, *extra_path]
        self.node_env = node_env or {}
        self.daemon_env = daemon_env or {}
        self.write_every = 10
        """The node writes this many 50-entry transactions, then pauses ``pause_ms`` (default for node starts)."""
        self.daemon_config = write_daemon_config(
            tmp / "cdcd.toml",
            self.node_dir,
            daemon_consumer or jsonl_consumer(self.daemon_out),
            **{**DAEMON_SETTINGS, **(daemon_settings or {})},
        )

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = child_env(self.plugins, *self.extra_path)
        env.update(extra)
        return env

    # --- the node ---
    def spawn_node(
        self, *, first_tx: int = 0, pause_ms: float = 20, every: int | None = None, count: int = 0, go: bool = True
    ) -> None:
        """Start the node process (``tests.chaos.procs.node_main``) without waiting for it."""
        every = every or self.write_every
        for name in ("stop", "done", "written", "status.json", "burst"):
            (self.ctl / name).unlink(missing_ok=True)
        if go:
            (self.ctl / "go").touch()
        else:
            (self.ctl / "go").unlink(missing_ok=True)
        self.node_runs += 1
        code = "import tests.chaos.procs as p; p.node_main()"
        args = [str(self.node_config), str(self.ctl), str(first_tx), str(pause_ms), str(every), str(count)]
        with self.node_log.open("wb") as log:
            self.node = track(
                subprocess.Popen(
                    [sys.executable, "-c", code, *args],
                    stdout=log,
                    stderr=log,
                    env=self.env(self.node_env),
                    cwd=ROOT,
                )
            )

    def start_node(
        self, *, first_tx: int = 0, pause_ms: float = 20, every: int | None = None, count: int = 0, go: bool = True
    ) -> None:
        self.spawn_node(first_tx=first_tx, pause_ms=pause_ms, every=every, count=count, go=go)
        self._wait_serving()

    def node_failure(self) -> str | None:
        """The last exception line in the node's log (its WAL flusher or another thread died), if any."""
        for i in range(self.node_runs, 0, -1):
            path = self.tmp / f"node-{i}.log"
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln and not ln.startswith("{")]
            errors = [ln for ln in lines if not ln.startswith((" ", "Traceback"))]
            if errors:
                return errors[-1]
        return None

    def check_node(self) -> None:
        """The node process runs and none of its threads died."""
        check(self.node is not None and self.node.poll() is None, f"the node died: {self.tail(self.node_log)}")
        failure = self.node_failure()
        check(failure is None, f"a thread of the node died: {failure}")

    def control(self, *args: str) -> str:
        """``cdcd control ...`` (its stdout); a failure names the node's own error if it has one."""
        try:
            return super().control(*args)
        except AssertionError as exc:
            raise ChaosFailure(f"cdcd control {' '.join(args)} failed: {str(exc).strip()}") from None

    def kill_node(self) -> None:
        assert self.node is not None
        rc = self.node.poll()
        check(rc is None, f"the node exited by itself (rc {rc}) before its SIGKILL: {self.tail(self.node_log)}")
        super().kill_node()
        self.note_kill("node", self.node_cuts[-1], self.node_resumes[-1])

    # --- the daemon ---
    def spawn_daemon(self) -> None:
        """Start ``cdcd run`` without waiting for it."""
        self.daemon_runs += 1
        self.daemon = track(start_daemon(self.daemon_config, self.daemon_err, env=self.env(self.daemon_env)))

    def start_daemon(self) -> None:
        self.spawn_daemon()
        err = self.daemon_err
        proc = self.daemon
        assert proc is not None
        wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 60, "daemon start")
        check(proc.poll() is None, f"the daemon failed to start (rc {proc.poll()}): {self.tail(err)}")

    def kill_daemon(self) -> None:
        assert self.daemon is not None
        rc = self.daemon.poll()
        check(rc is None, f"the daemon exited by itself (rc {rc}) before its SIGKILL: {self.tail(self.daemon_err)}")
        self.daemon.send_signal(signal.SIGKILL)
        check(self.daemon.wait(10) == -signal.SIGKILL, "the daemon did not die of SIGKILL")
        self.daemon = None
        self.daemon_cuts.append(self.daemon_out.stat().st_size if self.daemon_out.exists() else 0)
        self.daemon_resumes.append(committed_or_none(self.daemon_config))
        self.note_kill("daemon", self.daemon_cuts[-1], self.daemon_resumes[-1])

    def note_kill(self, who: str, cut: int, resume: Pos | None) -> None:
        """Appends the kill to ``kills.jsonl`` (file size at the kill, committed position): for post-mortems."""
        with (self.tmp / "kills.jsonl").open("a") as f:
            f.write(json.dumps({"who": who, "cut": cut, "resume": resume, "t": time.time()}) + "\n")

    def daemon_exit(self, timeout: float) -> int:
        """Wait for the daemon to exit by itself; returns its exit code."""
        assert self.daemon is not None
        try:
            rc = self.daemon.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ChaosFailure(f"the daemon did not exit within {timeout}s: {self.tail(self.daemon_err)}") from None
        self.daemon = None
        return rc

    def error_lines(self) -> list[str]:
        return error_lines(self.daemon_err)

    @staticmethod
    def tail(path: Path, n: int = 1500) -> str:
        return path.read_text(errors="replace")[-n:] if path.exists() else "(no file)"

    # --- delivery ---
    def jsonl_runs(self) -> list[list[dict[str, Any]]]:
        """The node's and the daemon's JSON-lines runs (split at their SIGKILLs)."""
        return [*read_runs(self.node_out, self.node_cuts), *read_runs(self.daemon_out, self.daemon_cuts)]

    def delivery(self) -> Delivery:
        return jsonl_delivery(wal_events(self.node_dir), self.jsonl_runs())


def archived_positions(node_dir: Path) -> list[Pos]:
    """Positions of the data entries in the archived segments (safe while the node runs and archives)."""
    out: list[Pos] = []
    for ptr, rec in WalReader([node_dir / "wal" / "archive"]):
        if type(rec) is DataRecord:
            out += [(ptr.segment, ptr.offset, i) for i in range(len(rec.entries))]
    return out


def committed_or_none(config: Path) -> Pos | None:
    """The stopped daemon's committed position; None also when it died before its state existed."""
    try:
        return daemon_committed(config)
    except lmdb.Error:
        return None


@contextmanager
def rig(tmp: Path, **kw: Any) -> Iterator[ChaosRig]:
    r = ChaosRig(tmp, **kw)
    try:
        yield r
    finally:
        for proc in (r.node, r.daemon):
            if proc is not None and proc.poll() is None:
                if _stopped(proc.pid):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()


# --- file systems, ports, metrics, memory ---------------------------------------------------------------
@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (needs root), unmounted at the end whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    check(res.returncode == 0, f"cannot mount a tmpfs at {path}: {res.stderr.decode().strip()} (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    res = subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True, text=True)
    check(res.returncode == 0, f"remount {path} {options}: {res.stderr.strip()}")


def scrape(port: int, timeout: float = 2) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus endpoint: name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
