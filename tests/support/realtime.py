"""The realtime hand-over rig: a node process with its realtime worker, a ``cdcd run`` daemon, and the
reference of who delivered what."""

from __future__ import annotations

import bisect
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cdcd.control import request
from cdcd.logging import configure as configure_logging
from cdcd.node import Node
from cdcd.node.metastorage import Metastorage, RealtimeState
from cdcd.wal import WalPointer
from cdcd.wal.records import (
    RealtimeCdcRecord,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import (
    CDCD,
    ROOT,
    cdcd,
    child_env,
    log_events,
    polled_position,
    reap,
    start_daemon,
    stop_daemon,
    wait_for,
    wait_progress,
)
from tests.support.procs import committed as daemon_committed
from tests.support.wal import archived_segments, wal_events, wal_records
from tests.support.writer import write_tx

Pos = tuple[int, int, int]


NODE_SETTINGS: dict[str, Any] = {
    "wal_mode": "background",
    "wal_segment_size_bytes": 64 * 1024,
    "wal_force_archive_timeout_ms": 150,
    "archive_max_bytes": 0,  # keep every segment: the WAL is the reference
    "checkpoint_interval_ms": 500,
    "realtime_commit_record_interval_ms": 100,
    "cdc_buffer_bytes": 32 << 20,
}


DAEMON_SETTINGS: dict[str, Any] = {"check_interval_ms": 100, "batch_max_delay_ms": 20}


PLUGIN = '''
"""Realtime consumers for the tests: JSON lines that fail on demand, or slowly."""
import threading
import time
from pathlib import Path

from cdcd.sinks.jsonl import JsonlConsumer


def started(path):
    """Say "batch started" in ``<path>.started`` (what the tests wait on), before the batch is worked on."""
    with open(str(path) + ".started", "a") as f:
        f.write("batch started\\n")


class FailOnTrigger(JsonlConsumer):
    """Raises (after ``delay_ms``, before writing anything of the batch) while the trigger file exists."""

    def __init__(self, path, trigger, delay_ms=0):
        super().__init__(path)
        self.trigger = Path(trigger)
        self.delay_s = delay_ms / 1000

    def on_events(self, batch):
        started(self.path)
        time.sleep(self.delay_s)
        if self.trigger.exists():
            raise RuntimeError("injected realtime consumer failure")
        return super().on_events(batch)


class Slow(JsonlConsumer):
    """Sleeps before each batch, so the node's realtime buffer fills up."""

    def __init__(self, path, delay_ms):
        super().__init__(path)
        self.delay_s = delay_ms / 1000

    def on_events(self, batch):
        started(self.path)
        time.sleep(self.delay_s)
        return super().on_events(batch)


class Gated(JsonlConsumer):
    """Holds every batch until the gate file exists (a batch in flight for as long as a test needs)."""

    def __init__(self, path, gate):
        super().__init__(path)
        self.gate = Path(gate)

    def on_events(self, batch):
        started(self.path)
        while not self.gate.exists():
            time.sleep(0.01)
        return super().on_events(batch)


class GatedWatchingStop(Gated):
    """Gated, and says in ``<path>.stopped_in_call`` when stop() comes while a batch is held."""

    def __init__(self, path, gate):
        super().__init__(path, gate)
        self.in_call = False

    def on_events(self, batch):
        self.in_call = True
        try:
            return super().on_events(batch)
        finally:
            self.in_call = False

    def stop(self):
        if self.in_call:
            open(str(self.path) + ".stopped_in_call", "w").close()
        super().stop()


class Busy(JsonlConsumer):
    """Takes ``delay_ms`` per batch; stop() waits for a batch in progress (a thread-safe consumer)."""

    def __init__(self, path, delay_ms):
        super().__init__(path)
        self.delay_s = delay_ms / 1000
        self.lock = threading.Lock()

    def on_events(self, batch):
        with self.lock:
            started(self.path)
            time.sleep(self.delay_s)
            return super().on_events(batch)

    def stop(self):
        with self.lock:
            super().stop()
'''


# --- the node process ----------------------------------------------------------------------------
def node_main() -> None:
    """Child process: ``config ctl_dir first_tx pause_ms every count``.

    Writes ``tx_writes(first_tx ...)`` (``every`` transactions, then ``pause_ms``; no pause while
    ``ctl_dir/burst`` exists) once ``ctl_dir/go`` exists, until ``ctl_dir/stop`` exists or
    ``count`` transactions are written (0: no limit; the node then stays open until ``stop``);
    ``ctl_dir/hold`` ends the writes early too, leaving the node open until ``stop``.
    With ``ctl_dir/warmup``, it first puts one entry into cache ``warmup`` and rolls the segment
    (so the writes' caches are created in a later segment). Then archives the active segment,
    saves its status in ``ctl_dir/status.json``, closes and writes the number of transactions to
    ``ctl_dir/done``.
    """
    config, ctl_s, first_s, pause_ms_s, every_s, count_s = sys.argv[1:7]
    ctl, first, pause_s, count = Path(ctl_s), int(first_s), float(pause_ms_s) / 1000, int(count_s)
    every = int(every_s)
    burst = ctl / "burst"
    configure_logging("json")
    node = Node.from_config_file(config)
    n = first
    try:
        while not (ctl / "go").exists() and not (ctl / "stop").exists():
            time.sleep(0.01)
        if (ctl / "warmup").exists():
            node.cache("warmup").put(0, {"warm": True})
            node.force_archive()
        while not (ctl / "stop").exists() and not (ctl / "hold").exists() and not (count and n - first >= count):
            write_tx(node, n)
            n += 1
            if pause_s and n % every == 0 and not burst.exists():
                time.sleep(pause_s)
        (ctl / "written").write_text(f"{n - first}\n")
        while not (ctl / "stop").exists():
            time.sleep(0.01)
        node.force_archive()  # every data entry into an archived segment, for the daemon
        (ctl / "status.json").write_text(json.dumps(node.status()))
    finally:
        node.close()
    (ctl / "done").write_text(f"{n - first}\n")


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


class Rig:
    """One node dir, its node process (``node_main``) and its daemon process, with their files."""

    def __init__(self, tmp: Path, *, consumer: dict[str, Any] | None = None, **node_settings: Any) -> None:
        self.tmp = tmp
        self.node_dir = tmp / "node"
        self.ctl = tmp / "ctl"
        self.ctl.mkdir()
        self.node_out = tmp / "node.jsonl"
        self.daemon_out = tmp / "daemon.jsonl"
        self.plugins = tmp / "plugins"
        self.plugins.mkdir()
        (self.plugins / "rt_plugins.py").write_text(PLUGIN)
        self.node_config = tmp / "node.toml"
        self.write_node_config(consumer, **node_settings)
        self.daemon_config = write_daemon_config(
            tmp / "cdcd.toml", self.node_dir, jsonl_consumer(self.daemon_out), **DAEMON_SETTINGS
        )
        self.socket = Path(node_settings.get("control_socket") or self.node_dir / "control.sock")
        self.node: subprocess.Popen[bytes] | None = None
        self.daemon: subprocess.Popen[bytes] | None = None
        self.node_runs = 0
        self.daemon_runs = 0
        self.node_cuts: list[int] = []
        """Sizes of ``node_out`` when the node was SIGKILLed (where its runs split)."""
        self.node_resumes: list[Pos | None] = []
        """Per node restart after a kill: the realtime position committed in the metastorage."""
        self.daemon_cuts: list[int] = []
        self.daemon_resumes: list[Pos | None] = []

    def write_node_config(self, consumer: dict[str, Any] | None = None, **node_settings: Any) -> None:
        """The node's TOML: ``NODE_SETTINGS`` and ``node_settings``; ``[realtime_consumer]`` is ``consumer``
        (default: JSON lines into ``node_out``; ``{}``: none)."""
        settings = {"node_dir": str(self.node_dir), **NODE_SETTINGS, **node_settings}
        table = jsonl_consumer(self.node_out) if consumer is None else consumer
        lines = [f"{k} = {_toml(v)}" for k, v in settings.items()]
        if table:
            lines += ["[realtime_consumer]", *(f"{k} = {_toml(v)}" for k, v in table.items())]
        self.node_config.write_text("\n".join(lines) + "\n")

    # --- the node ---
    @property
    def node_log(self) -> Path:
        return self.tmp / f"node-{self.node_runs}.log"

    def start_node(
        self,
        *,
        first_tx: int = 0,
        pause_ms: float = 20,
        every: int = 10,
        count: int = 0,
        go: bool = True,
        failpoints: str = "",
    ) -> None:
        for name in ("stop", "hold", "done", "written", "status.json", "burst"):
            (self.ctl / name).unlink(missing_ok=True)
        if go:
            (self.ctl / "go").touch()
        else:
            (self.ctl / "go").unlink(missing_ok=True)
        self.node_runs += 1
        code = "import tests.support.realtime as t; t.node_main()"
        args = [str(self.node_config), str(self.ctl), str(first_tx), str(pause_ms), str(every), str(count)]
        env = child_env(self.plugins)
        if failpoints:
            env["CDCD_FAILPOINTS"] = failpoints
        with self.node_log.open("wb") as log:
            self.node = subprocess.Popen(
                [sys.executable, "-c", code, *args],
                stdout=log,
                stderr=log,
                env=env,
                cwd=ROOT,
            )
        self._wait_serving()

    def start_node_run(self, load_rate: int) -> None:
        """The node as `cdcd node run --load-rate N` (stopped with SIGTERM by ``stop_node_run``)."""
        self.node_runs += 1
        with self.node_log.open("wb") as log:
            self.node = subprocess.Popen(
                [*CDCD, "node", "run", "--config", str(self.node_config), "--load-rate", str(load_rate)],
                stdout=log,
                stderr=log,
                env=child_env(self.plugins),
            )
        self._wait_serving()

    def _wait_serving(self) -> None:
        """Until the node answers on its control socket (a killed node's socket file may still be there)."""

        def serving() -> bool:
            assert self.node is not None and self.node.poll() is None, self.node_log.read_text()[-3000:]
            try:
                return bool(request(self.socket, {"cmd": "status"}, timeout_s=5)["ok"])
            except (FileNotFoundError, ConnectionRefusedError):
                return False

        wait_for(serving, 30, "the node's control socket")

    def stop_node_run(self) -> None:
        assert self.node is not None
        self.node.send_signal(signal.SIGTERM)
        rc = self.node.wait(60)
        assert rc == 0, self.node_log.read_text()[-3000:]
        self.node = None

    def go(self) -> None:
        (self.ctl / "go").touch()

    def burst(self, on: bool = True) -> None:
        """The node writes at full speed from now on (``on=False``: it pauses again)."""
        if on:
            (self.ctl / "burst").touch()
        else:
            (self.ctl / "burst").unlink(missing_ok=True)

    def stop_node(self, *, drained: bool = False) -> int:
        """Let the node finish (archive, status, close); returns the transactions it wrote.

        ``drained``: first end the writes and wait until the realtime consumer has taken everything buffered, so
        the node's close has at most one batch to finish, not a backlog a loaded machine may not deliver within
        ``realtime_close_timeout_ms`` (a test of a clean stop, not of that timeout)."""
        assert self.node is not None
        if drained:
            (self.ctl / "hold").touch()
            wait_for(lambda: (self.ctl / "written").exists(), 60, "the node's writes to end")
            wait_for(
                lambda: self.status()["realtime"]["buffer_used_bytes"] == 0, 300, "the realtime buffer to drain", 0.2
            )
        (self.ctl / "stop").touch()
        rc = self.node.wait(60)
        assert rc == 0, self.node_log.read_text()[-3000:]
        self.node = None
        return int((self.ctl / "done").read_text())

    def kill_node(self) -> None:
        assert self.node is not None
        self.node.send_signal(signal.SIGKILL)
        self.node_died()

    def node_died(self, timeout: float = 10) -> None:
        """The node was SIGKILLed (by the test or by one of its fail points): record where its runs split."""
        assert self.node is not None
        assert self.node.wait(timeout) == -signal.SIGKILL, self.node_log.read_text()[-3000:]
        self.node = None
        self.node_cuts.append(self.node_out.stat().st_size if self.node_out.exists() else 0)
        state = node_realtime_state(self.node_dir)
        self.node_resumes.append(as_pos(state.position) if state.enabled and state.position else None)

    def node_log_events(self) -> list[dict[str, Any]]:
        out = []
        for i in range(1, self.node_runs + 1):
            out += log_events(self.tmp / f"node-{i}.log")
        return out

    def final_status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.ctl / "status.json").read_text())
        return result

    # --- the daemon ---
    @property
    def daemon_err(self) -> Path:
        return self.tmp / f"daemon-{self.daemon_runs}.err"

    def start_daemon(self, failpoints: str = "") -> None:
        self.daemon_runs += 1
        env = child_env()
        if failpoints:
            env["CDCD_FAILPOINTS"] = failpoints
        self.daemon = start_daemon(self.daemon_config, self.daemon_err, env)
        err = self.daemon_err
        wait_for(lambda: b"daemon_started" in err.read_bytes() or self.daemon.poll() is not None, 30, "daemon start")
        assert self.daemon.poll() is None, err.read_text()[-3000:]

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        rc = stop_daemon(self.daemon)
        assert rc == 0, self.daemon_err.read_text()[-3000:]
        self.daemon = None

    def kill_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon_died()

    def daemon_died(self, timeout: float = 10) -> None:
        """The daemon was SIGKILLed (by the test or by one of its fail points)."""
        assert self.daemon is not None
        assert self.daemon.wait(timeout) == -signal.SIGKILL, self.daemon_err.read_text()[-3000:]
        self.daemon = None
        self.daemon_cuts.append(self.daemon_out.stat().st_size if self.daemon_out.exists() else 0)
        self.daemon_resumes.append(daemon_committed(self.daemon_config))

    def daemon_position(self) -> Pos | str | None:
        return polled_position(self.daemon_config)

    def delivered(self, side: str) -> int:
        """Lines in the output of ``side`` ("node" or "daemon"): one per event, plus cache lines."""
        path = self.node_out if side == "node" else self.daemon_out
        try:
            return path.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def wait_delivered(self, side: str, events: int, timeout: float = 120) -> None:
        """Wait until ``side`` has delivered ``events`` more than now: the load on that side is observed,
        not slept for (and an assertion on a side's share has its events before the next switch)."""
        start = self.delivered(side)
        wait_for(lambda: self.delivered(side) >= start + events, timeout, f"{events} more events from the {side}")

    def batches_started(self) -> int:
        """How many batches the node's test consumer has begun (its ``<node_out>.started`` lines)."""
        try:
            return (self.node_out.parent / (self.node_out.name + ".started")).read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def wait_batch_started(self, after: int, timeout: float = 60) -> None:
        """Wait until the node's test consumer began a batch beyond the first ``after``."""
        wait_for(lambda: self.batches_started() > after, timeout, f"the node's consumer to begin batch {after + 1}")

    def wal_segment(self) -> int:
        """The node's active WAL segment, from its status."""
        return int(str(self.status()["wal_position"]).split(":")[0])

    def wait_written(self, segments: int, timeout: float = 120) -> None:
        """Wait until the node has written ``segments`` more WAL segments than now (its writes, observed)."""
        start = self.wal_segment()
        wait_for(lambda: self.wal_segment() >= start + segments, timeout, f"{segments} more WAL segments")

    def wait_daemon_caught_up(self, timeout: float = 60) -> None:
        """The daemon committed past the last archived segment (everything archived is delivered)."""
        until = (max(archived_segments(self.node_dir)) + 1, 0, 0)
        wait_for(
            lambda: self.daemon is None or self.daemon.poll() is not None or self.daemon_position() == until,
            timeout,
            f"the daemon to commit {until}",
            interval=0.2,
        )
        assert self.daemon is not None and self.daemon.poll() is None, self.daemon_err.read_text()[-3000:]

    # --- control ---
    def status(self) -> dict[str, Any]:
        reply = request(self.socket, {"cmd": "status"})
        assert reply["ok"], reply
        return reply

    def control(self, *args: str) -> str:
        """``cdcd control --node-dir DIR ARGS...`` (``--socket PATH`` if configured); returns its stdout."""
        default = self.socket == self.node_dir / "control.sock"
        where = ["--node-dir", str(self.node_dir)] if default else ["--socket", str(self.socket)]
        res = cdcd("control", *where, *args)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def wait_mode(
        self, node_mode: str, daemon_mode: str | None, timeout: float = 30, stops: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """Wait until the node's realtime mode and the daemon's persisted mode are these (and the node's
        count of realtime stops by reason is ``stops``: it is counted once the Stop record is durable). A hand-over
        waits for the daemon to deliver up to the node's switch point, a backlog on a loaded machine as long as it
        takes: fail once ``timeout`` seconds pass with the modes not there and the daemon's position standing still."""
        seen: dict[str, Any] = {}

        def check() -> bool:
            assert self.node is not None and self.node.poll() is None, self.node_log.read_text()[-3000:]
            if self.daemon is not None:
                assert self.daemon.poll() is None, self.daemon_err.read_text()[-3000:]
            seen.update(self.status())
            daemon = (seen["daemon"] or {}).get("mode")
            return bool(
                seen["realtime"]["mode"] == node_mode
                and (daemon_mode is None or daemon == daemon_mode)
                and (stops is None or seen["realtime"]["stops"] == stops)
            )

        def progress() -> tuple[bool, Any]:
            reached = check()
            return reached, (seen.get("daemon") or {}).get("position")

        try:
            wait_progress(progress, lambda p: p[0], timeout, f"realtime {node_mode}, daemon {daemon_mode}", 0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last status: {seen}") from None
        return seen

    def switch_on(self) -> dict[str, Any]:
        assert self.control("realtime", "on").strip() in ("realtime: try_start", "realtime: on")
        return self.wait_mode("on", "PASSIVE")

    def switch_off(self) -> dict[str, Any]:
        # "stopping": the consumer call in flight (a slow first Kafka transaction, a long lake write)
        # outlasted off's wait; the documented contract is that status then shows when it is off.
        assert self.control("realtime", "off").strip() in ("realtime: off", "realtime: stopping")
        return self.wait_mode("off", "ACTIVE")

    def close(self) -> None:
        for proc in (self.node, self.daemon):
            reap(proc)


def rig_maker(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """The body of the ``rig_factory`` fixtures: make rigs, kill their processes at the end."""
    rigs: list[Rig] = []

    def make(**kw: Any) -> Rig:
        rig = Rig(tmp_path, **kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


# --- the reference ------------------------------------------------------------------------------
def as_pos(p: Any) -> Pos:
    return (p.segment, p.offset, p.entry_index)


def node_realtime_state(node_dir: Path) -> RealtimeState:
    """The realtime state in a (stopped) node's metastorage."""
    meta = Metastorage(node_dir / "db" / "metastorage")
    try:
        return meta.get() or RealtimeState()
    finally:
        meta.close()


def markers(node_dir: Path) -> list[tuple[WalPointer, Any]]:
    """The realtime marker records of the WAL, in order."""
    kinds = (StopRealtimeCdcRecord, TryStartRealtimeCdcRecord, RealtimeCdcRecord)
    return [(ptr, rec) for ptr, rec in wal_records(node_dir) if isinstance(rec, kinds)]


def daemon_intervals(node_dir: Path) -> list[tuple[Pos, Pos | None]]:
    """What the protocol gives the daemon, from the WAL's markers: ``[start, end)`` ranges (end None: open).

    The daemon starts PASSIVE. PASSIVE: ``Stop(last)`` -> ACTIVE from ``last`` (None: from where it
    is), ``RealtimeCdcRecord(last)`` -> its position is ``last``; a marker never moves it behind its
    position (a node killed between a TryStart and persisting it writes an older ``last``). ACTIVE:
    ``TryStart`` at S:o -> it delivered everything before S:o, PASSIVE at S+1:0#0. Other markers are
    ignored in each mode.
    """
    out: list[tuple[Pos, Pos | None]] = []
    active, start = False, None
    position: Pos = (0, 0, 0)
    for ptr, rec in markers(node_dir):
        if not active and isinstance(rec, StopRealtimeCdcRecord):
            start = max(as_pos(rec.last), position) if rec.last is not None else position
            active = True
        elif not active and isinstance(rec, RealtimeCdcRecord):
            position = max(as_pos(rec.last), position)
        elif active and isinstance(rec, TryStartRealtimeCdcRecord):
            assert start is not None
            out.append((start, (ptr.segment, ptr.offset, 0)))
            position = (ptr.segment + 1, 0, 0)
            active = False
    if active:
        assert start is not None
        out.append((start, None))
    return out


def expected_shares(node_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """(the node's share, the daemon's share, the daemon's intervals) of the WAL's data entries."""
    intervals = daemon_intervals(node_dir)
    node: list[dict[str, Any]] = []
    daemon: list[dict[str, Any]] = []
    for ev in wal_events(node_dir):
        p = tuple(ev["pos"])
        if any(a <= p and (b is None or p < b) for a, b in intervals):
            daemon.append(ev)
        else:
            node.append(ev)
    return node, daemon, intervals


def read_runs(path: Path, cuts: list[int]) -> list[list[dict[str, Any]]]:
    """The JSON lines of ``path`` split into runs at ``cuts`` (file sizes at SIGKILLs).

    A killed run may end in a partial line (a batch cut short); only the last run must end cleanly.
    """
    data = path.read_bytes() if path.exists() else b""
    bounds = [0, *cuts, len(data)]
    runs = []
    for i in range(len(bounds) - 1):
        lines = data[bounds[i] : bounds[i + 1]].split(b"\n")
        tail = lines.pop()
        assert not tail or i < len(bounds) - 2, f"{path}: the last run ends in a partial line"
        runs.append([json.loads(line) for line in lines])
    return runs


def check_share(
    name: str,
    runs: list[list[dict[str, Any]]],
    expected: list[dict[str, Any]],
    resumes: list[Pos | None],
    *,
    whole_record: bool = False,
) -> int:
    """Each run of one side is a contiguous stretch of its share, equal entry by entry; a run after a
    kill starts exactly at the position committed before it; together they cover the share.
    ``whole_record``: a run may also start at the first entry of the committed position's record
    (re-delivering the entries of that record already committed). Returns the number of duplicates."""
    positions = [tuple(e["pos"]) for e in expected]
    index = {p: i for i, p in enumerate(positions)}
    frontier = 0
    duplicates = 0
    for r, run in enumerate(runs):
        idxs = []
        for ev in run:
            i = index.get(tuple(ev["pos"]))
            assert i is not None, f"{name} run {r}: {ev['pos']} is not in its share of the WAL"
            assert ev == expected[i], f"{name} run {r}: {ev} != {expected[i]}"
            idxs.append(i)
        if not idxs:
            continue
        assert idxs == list(range(idxs[0], idxs[0] + len(idxs))), f"{name} run {r}: not a contiguous stretch"
        if r == 0:
            assert idxs[0] == 0, f"{name}: the first run begins at {positions[idxs[0]]}, not at its share's start"
        else:
            resume = resumes[r - 1]
            # Not enabled at the kill: its next delivery begins its next stretch (a new try-start).
            want = bisect.bisect_left(positions, resume) if resume is not None else frontier
            assert want <= frontier, f"{name} run {r}: committed {resume} is past what it delivered: lost entries"
            if whole_record and resume is not None:
                lowest = bisect.bisect_left(positions, (resume[0], resume[1], 0))
                want = idxs[0] if lowest <= idxs[0] <= want else want
            assert idxs[0] == want, (
                f"{name} run {r} restarted at {positions[idxs[0]]}, but it had committed {resume}: "
                f"{'re-delivers committed entries' if idxs[0] < want else 'skips entries'}"
            )
        duplicates += max(0, frontier - idxs[0])
        frontier = max(frontier, idxs[-1] + 1)
    assert frontier == len(expected), (
        f"{name}: {len(expected) - frontier} of {len(expected)} entries never delivered "
        f"(first missing: {positions[frontier] if frontier < len(expected) else None})"
    )
    return duplicates


def check_delivery(
    rig: Rig, *, node_whole_record: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """The two files are exactly the node's and the daemon's shares (runs split at kills); together,
    de-duplicated by position, exactly the WAL's data entries."""
    node_exp, daemon_exp, intervals = expected_shares(rig.node_dir)
    node_runs = read_runs(rig.node_out, rig.node_cuts)
    daemon_runs = read_runs(rig.daemon_out, rig.daemon_cuts)
    check_share("node", node_runs, node_exp, rig.node_resumes, whole_record=node_whole_record)
    check_share("daemon", daemon_runs, daemon_exp, rig.daemon_resumes)
    if not rig.node_cuts:
        assert node_runs[0] == node_exp
    if not rig.daemon_cuts:
        assert daemon_runs[0] == daemon_exp
    union = {tuple(e["pos"]): e for run in (*node_runs, *daemon_runs) for e in run}
    assert [union[p] for p in sorted(union)] == wal_events(rig.node_dir)
    return node_exp, daemon_exp, intervals


def entries_in(events: list[dict[str, Any]], a: Pos, b: Pos | None) -> int:
    return sum(1 for e in events if a <= tuple(e["pos"]) and (b is None or tuple(e["pos"]) < b))
