"""`cdcd top` against a real `cdcd node run` (with load) and a real `cdcd run` daemon (jsonl consumer):
`--once --json` checked against `cdcd control status --json` and `cdcd state show --json` taken around
it, missing sources shown as such, nothing written, and the live view driven in a tmux pane."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.delta_lake import QUICK_START, lake_consumer
from tests.support.lake import write_config
from tests.support.ports import free_port
from tests.support.procs import CDCD, cdcd, child_env, reap, start_daemon, state_show, stop_daemon, wait_for
from tests.support.tmux import Pane
from tests.support.writer import make_node

TOP = [*CDCD, "top"]
DEADLINE_S = 90.0


@dataclass
class Rig:
    node_dir: Path
    node_config: Path
    daemon_config: Path
    node_metrics: str
    daemon_metrics: str
    node: subprocess.Popen[bytes] | None = None
    daemon: subprocess.Popen[bytes] | None = None


def _pos(text: str) -> tuple[int, ...]:
    """``5:40`` or ``79:0#0`` as a comparable tuple."""
    seg, _, rest = text.partition(":")
    off, _, idx = rest.partition("#")
    return (int(seg), int(off), int(idx or 0))


def status(rig: Rig) -> dict[str, Any]:
    res = cdcd("control", "status", "--node-dir", str(rig.node_dir), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def top_once(rig: Rig, *extra: str, interval_ms: int = 500) -> dict[str, Any]:
    args = ["--node-dir", str(rig.node_dir), "--config", str(rig.daemon_config), "--node-metrics", rig.node_metrics]
    res = subprocess.run(
        [*TOP, *args, "--interval-ms", str(interval_ms), "--once", "--json", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    return json.loads(res.stdout)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    node_dir = tmp_path / "node"
    node_metrics, daemon_metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node_config = tmp_path / "node.toml"
    node_config.write_text(
        f'node_dir = "{node_dir}"\nwal_segment_size_bytes = 262144\nwal_force_archive_timeout_ms = 200\n'
        f'metrics_address = "{node_metrics}"\n'
    )
    daemon_config = write_daemon_config(
        tmp_path / "daemon.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"), metrics_address=daemon_metrics
    )
    r = Rig(node_dir, node_config, daemon_config, node_metrics, daemon_metrics)
    try:
        yield r
    finally:
        reap(r.daemon)
        reap(r.node)


def start(rig: Rig, tmp_path: Path) -> None:
    """The node with 2000 entries/s of load, then the daemon once the node dir exists; both running
    and the daemon past its first commit when this returns."""
    with (tmp_path / "node.err").open("ab") as err:
        rig.node = subprocess.Popen(
            [*CDCD, "node", "run", "--config", str(rig.node_config), "--load-rate", "2000", "--log-format", "json"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=child_env(),
        )
    wait_for(lambda: (rig.node_dir / "control.sock").exists() or rig.node.poll() is not None, DEADLINE_S, "node")
    assert rig.node.poll() is None, (tmp_path / "node.err").read_text()[-2000:]
    rig.daemon = start_daemon(rig.daemon_config, tmp_path / "daemon.err")
    wait_for(
        lambda: rig.daemon.poll() is not None or state_show(rig.daemon_config)["position"] is not None,
        DEADLINE_S,
        "the daemon's first commit",
        interval=0.2,
    )
    assert rig.daemon.poll() is None, (tmp_path / "daemon.err").read_text()[-2000:]


def test_once_json_matches_status_and_state(rig: Rig, tmp_path: Path) -> None:
    start(rig, tmp_path)
    assert rig.node is not None and rig.daemon is not None
    before_status, before_state = status(rig), state_show(rig.daemon_config)
    snap = top_once(rig)
    after_status, after_state = status(rig), state_show(rig.daemon_config)

    assert snap["sources"] == dict.fromkeys(("control_socket", "daemon_state", "node_metrics", "daemon_metrics"), "ok")
    node, daemon, rates = snap["node"], snap["daemon"], snap["rates"]
    assert node["node_id"] == after_status["node_id"]
    assert node["writes"] == after_status["writes"] == "ok"
    assert node["cdc"] == after_status["cdc"] == "on"
    assert node["delivering"] == "daemon" and after_status["delivering"] == "daemon"
    assert node["realtime_mode"] == after_status["realtime"]["mode"] == "off"
    assert node["buffer_max_bytes"] == after_status["realtime"]["buffer_max_bytes"]
    # Live figures: between the answers taken just before and just after.
    assert _pos(before_status["wal_position"]) <= _pos(node["wal_position"]) <= _pos(after_status["wal_position"])
    assert (node["wal_segment"], node["wal_offset"]) == _pos(node["wal_position"])[:2]
    assert _pos(before_state["position"]) <= _pos(daemon["position"]) <= _pos(after_state["position"])
    assert daemon["position_parts"] == list(_pos(daemon["position"]))
    assert before_state["commits"] <= daemon["commits"] <= after_state["commits"]
    assert daemon["mode"] == after_state["mode"] == "ACTIVE"
    assert daemon["fresh"] is False and daemon["consumer_kind"] == "jsonl"
    assert daemon["pid"] == rig.daemon.pid
    assert daemon["lag_segments"] == max(0, node["wal_segment"] - daemon["position_parts"][0])
    assert daemon["events_total"] > 0 and daemon["lag_seconds"] is not None
    assert node["wal_bytes_total"] > 0 and node["entries_total"] > 0
    # Under 2000 entries/s both sides move within the half second between top's two reads.
    assert rates["wal_bytes_per_s"] > 0 and rates["node_entries_per_s"] > 0
    assert rates["daemon_events_per_s"] > 0
    keys = {"taken_at", "node_dir", "sources", "node", "daemon", "rates", "lake", "consumer", "consumers", "problems"}
    assert set(snap) == keys | {"source_problems", "read_s"}
    assert snap["consumer"] == {} and snap["lake"] is None  # jsonl has no metrics of its own
    assert snap["problems"] == {} and snap["source_problems"] == []

    # The daemon SIGKILLed, the node stopped: shown as such, still exit 0 and one JSON object.
    rig.daemon.kill()
    rig.daemon.wait()
    rig.node.send_signal(signal.SIGTERM)
    assert rig.node.wait(60) == 0
    gone = top_once(rig)
    assert gone["node"] is None and "node not running" in gone["sources"]["control_socket"]
    assert gone["daemon"]["pid"] is None and gone["daemon"]["position"] == state_show(rig.daemon_config)["position"]
    assert gone["sources"]["daemon_state"] == "ok"
    assert rig.node_metrics in gone["sources"]["node_metrics"]
    assert rig.daemon_metrics in gone["sources"]["daemon_metrics"]
    assert gone["source_problems"] == []  # stopped is not broken


def test_once_json_while_the_node_delivers(rig: Rig, tmp_path: Path) -> None:
    """Realtime on: the node delivers, the daemon follows in PASSIVE; top says so, with the buffer figures."""
    text = rig.node_config.read_text()
    rig.node_config.write_text(text + f'[realtime_consumer]\nkind = "jsonl"\npath = "{tmp_path / "rt.jsonl"}"\n')
    start(rig, tmp_path)
    res = cdcd("control", "realtime", "on", "--node-dir", str(rig.node_dir))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: status(rig)["realtime"]["mode"] == "on", DEADLINE_S, "realtime on", interval=0.2)
    wait_for(lambda: state_show(rig.daemon_config)["mode"] == "PASSIVE", DEADLINE_S, "daemon PASSIVE", interval=0.2)
    snap = top_once(rig)
    after = status(rig)
    node = snap["node"]
    assert node["delivering"] == "node" and after["delivering"] == "node"
    assert node["realtime_mode"] == "on"
    assert node["buffer_max_bytes"] == after["realtime"]["buffer_max_bytes"] > 0
    assert 0 <= node["buffer_used_bytes"] <= node["buffer_max_bytes"]
    assert node["buffer_max_used_bytes"] <= after["realtime"]["buffer_max_used_bytes"]
    assert node["lag_segments"] is not None
    assert snap["daemon"]["mode"] == "PASSIVE"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_missing_sources_and_nothing_written(rig: Rig, tmp_path: Path) -> None:
    # Nothing ever ran: no node dir at all.
    never = top_once(rig)
    assert never["node"] is None and "does not exist" in never["sources"]["control_socket"]
    assert never["daemon"] is None and "does not exist" in never["sources"]["daemon_state"]
    assert never["rates"] == dict.fromkeys(never["rates"], None)
    assert not rig.node_dir.exists()  # top created nothing

    # A node dir and a daemon state, both stopped: top reads them and changes no file. LMDB's reader
    # table (cdcd-state/lock.mdb) is the one exception: every LMDB reader registers there.
    start(rig, tmp_path)
    assert rig.node is not None and rig.daemon is not None
    rig.daemon.send_signal(signal.SIGTERM)
    rig.node.send_signal(signal.SIGTERM)
    assert rig.daemon.wait(60) == 0 and rig.node.wait(60) == 0
    before = _tree(rig.node_dir)
    res = subprocess.run(
        [*TOP, "--node-dir", str(rig.node_dir), "--once"], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert res.returncode == 0, res.stderr
    assert "Node: not answering" in res.stdout and "Daemon" in res.stdout and "not running" in res.stdout
    after = _tree(rig.node_dir)
    before.pop("cdcd-state/lock.mdb"), after.pop("cdcd-state/lock.mdb")
    assert after == before


def test_bad_options_exit_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('node_dir = "x"\nno_such_key = 1\n')
    for args, says in [
        ([], "give --node-dir"),
        (["--node-dir", str(tmp_path), "--json"], "--json needs --once"),
        (["--node-dir", str(tmp_path), "--interval-ms", "5"], "--interval-ms 5"),
        (["--config", str(bad), "--once"], "no_such_key"),
    ]:
        res = subprocess.run([*TOP, *args], capture_output=True, text=True, timeout=60, env=child_env())
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("cdcd: error:") and says in res.stderr, res.stderr


# --- the live view in tmux -------------------------------------------------------------------------
def _wal_position(screen: str) -> str | None:
    for line in screen.splitlines():
        if "WAL position" in line:
            return line.split("WAL position", 1)[1].split()[0]
    return None


@pytest.mark.parametrize(("key", "columns"), [("q", 160), ("C-c", 80)])
def test_live_view_in_tmux(rig: Rig, tmp_path: Path, pane: Pane, key: str, columns: int) -> None:
    """Wide (side by side) and narrow (stacked) layouts; q and Ctrl-C both quit."""
    start(rig, tmp_path)
    # A detached session takes its size from default-size (its -x/-y need an attached client).
    with pane.conf.open("a") as conf:
        conf.write(f"set -g default-size {columns}x45\n")
    argv = [*TOP, "--node-dir", str(rig.node_dir), "--config", str(rig.daemon_config), "--interval-ms", "300"]
    argv += ["--node-metrics", rig.node_metrics]
    # The pane's shell records top's exit code: tmux's own exit status of a pane can lag its death.
    rc_file = tmp_path / "top.rc"
    top_pid = pane.run(argv, rc_file)
    assert pane.info("#{pane_width}") == str(columns)

    def shown() -> str | None:
        screen = pane.capture()
        headings = ("cdcd top", "Node ", "Daemon", "Consumer", "Problems", "delivering", "backlog")
        return screen if all(h in screen for h in headings) and _wal_position(screen) else None

    try:
        first = wait_for(shown, DEADLINE_S, "the view's panels", interval=0.2)
    except AssertionError as exc:
        size = pane.info("#{pane_width}x#{pane_height}")
        raise AssertionError(f"{exc}; the pane ({size}) shows:\n{pane.last}") from None
    assert "control_socket: ok" in first and "daemon_metrics: ok" in first
    assert f"pid {rig.daemon.pid}" in first if rig.daemon else False
    first_pos = _wal_position(first)
    # The load keeps writing: a later refresh shows another WAL position.
    wait_for(lambda: (s := shown()) is not None and _wal_position(s) != first_pos, DEADLINE_S, "a WAL position change")

    pane.tmux("send-keys", "-t", "top", key)
    try:
        wait_for(lambda: rc_file.exists() and rc_file.read_text().strip(), DEADLINE_S, f"top to exit on {key}")
    except AssertionError as exc:
        alive = Path(f"/proc/{top_pid}").exists()
        raise AssertionError(f"{exc}: top alive: {alive}, pane:\n{pane.capture()}") from None
    assert rc_file.read_text().strip() == "0"
    wait_for(lambda: pane.info("#{pane_dead}") == "1", DEADLINE_S, "the pane's shell to end")
    assert "cdcd top" not in pane.capture()  # the alternate screen is gone: the terminal is restored
    wait_for(lambda: not Path(f"/proc/{top_pid}").exists(), DEADLINE_S, "top's process to be gone")


# --- a lake daemon's own figures: the last compaction and its duration ------------------------------------
COMPACTED = re.compile(r"last compaction\s+(\d\d:\d\d:\d\d) UTC, took ([\d.,]+) s")


def _logged_compactions(err: Path) -> list[float]:
    """The durations the daemon logged for its scheduled compactions (``lake_maintenance_compacted``)."""
    lines = [json.loads(line) for line in err.read_text().splitlines() if line.startswith("{")]
    return [float(r["seconds"]) for r in lines if r.get("event") == "lake_maintenance_compacted"]


def test_a_lake_daemon_s_last_compaction_and_its_duration(tmp_path: Path, pane: Pane) -> None:
    """A real `cdcd run` with the lake sink (delta-rs writer; its scheduled compaction on a local Spark): once a
    compaction ran, `--once --json` and the live screen show when it ended and how long it took, the same
    figure the daemon's metric carries and its log line says (the log rounds to milliseconds)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=20)
    address = f"127.0.0.1:{free_port()}"
    consumer = lake_consumer(
        tmp_path / "lake", spark_master="local[1]", spark_conf=QUICK_START, compact_interval_s=3, optimize_interval_s=0
    )
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, metrics_address=address)
    err = tmp_path / "daemon.err"
    started = time.time()
    daemon = start_daemon(config, err)
    try:

        def compacted() -> list[float] | None:
            assert daemon.poll() is None, err.read_text()[-3000:]
            return _logged_compactions(err) or None

        wait_for(compacted, 300, "the daemon's first scheduled compaction", interval=0.5)
        res = subprocess.run(
            [*TOP, "--config", str(config), "--interval-ms", "200", "--once", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        assert res.returncode == 0, res.stderr
        snap, logged = json.loads(res.stdout), _logged_compactions(err)
        lake = snap["lake"]
        assert snap["sources"]["daemon_metrics"] == "ok" and snap["daemon"]["consumer_kind"] == "lake"
        assert started < lake["last_compaction_unix_s"] <= time.time()
        took = lake["last_compaction_seconds"]
        assert took > 0 and any(abs(took - s) < 0.01 for s in logged), (took, logged)
        assert snap["consumer"]['cdcd_lake_last_maintenance_duration_seconds{task="compact"}'] == took
        assert lake["table_version"] >= 0 and lake["rows_written"] > 0
        assert lake["last_optimize_unix_s"] is None and lake["last_optimize_seconds"] is None  # optimize is off
        assert lake["last_vacuum_unix_s"] is None  # the first vacuum runs five minutes after the start

        with pane.conf.open("a") as conf:
            conf.write("set -g default-size 160x45\n")
        top_pid = pane.run([*TOP, "--config", str(config), "--interval-ms", "300"], tmp_path / "top.rc")
        try:
            shown = wait_for(lambda: COMPACTED.search(pane.capture()), DEADLINE_S, "the last compaction on the screen")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane shows:\n{pane.last}") from None
        clock, took_text = shown.group(1), float(shown.group(2).replace(",", ""))
        screen = pane.last
        logged = _logged_compactions(err)
        # the duration as shown (hundredths under 10 s, whole seconds above) of a compaction the daemon logged
        assert any(abs(took_text - s) <= (0.011 if s < 10 else 0.51) for s in logged), (took_text, logged, screen)
        # the clock: the end of that compaction or of a later one (seconds of the day, across midnight too)
        h, m, sec = map(int, clock.split(":"))
        after_s = (h * 3600 + m * 60 + sec - int(lake["last_compaction_unix_s"]) % 86400) % 86400
        assert after_s <= time.time() - lake["last_compaction_unix_s"] + 1, (clock, screen)
        assert "last optimize" in screen and "not yet" in screen
        pane.tmux("send-keys", "-t", "top", "q")
        wait_for(lambda: not Path(f"/proc/{top_pid}").exists(), DEADLINE_S, "top to quit")
    finally:
        if daemon.poll() is None:
            assert stop_daemon(daemon, timeout=120) == 0, err.read_text()[-3000:]
        reap(daemon)


# --- the pure parts ----------------------------------------------------------------------------------
def test_who_delivers_reads_both_vocabularies() -> None:
    from cdcd.top.snapshot import who_delivers

    for raw, who in [("node", "node"), ("daemon", "daemon"), ("NODE_ACTIVE", "node"), ("DAEMON_ACTIVE", "daemon")]:
        assert who_delivers({"delivering": raw}) == who
    assert who_delivers({}) == "unknown" and who_delivers({"delivering": "both"}) == "both"


def test_rates_from_two_snapshots() -> None:
    from cdcd.top.snapshot import build_snapshot, parse_metrics, rates

    status = {"node_id": "n", "wal_position": "10:500", "realtime": {"mode": "off"}, "delivering": "daemon"}
    state = {"mode": "ACTIVE", "position": "8:0#0", "position_parts": [8, 0, 0], "links": 3}
    text = '# TYPE cdcd_daemon_events counter\ncdcd_daemon_events_total{cache="a",op="create"} 100\n'
    text += "# TYPE cdcd_kafka_retries counter\ncdcd_kafka_retries_total 2\n"
    old = build_snapshot(
        100.0, sources={}, status=status, state=state, daemon_pid=None, node_m=None, daemon_m=parse_metrics(text)
    )
    newer = parse_metrics(text.replace(" 100\n", " 400\n"))
    new = build_snapshot(
        102.0,
        sources={},
        status={**status, "wal_position": "14:9"},
        state={**state, "position_parts": [12, 0, 0]},
        daemon_pid=None,
        node_m=None,
        daemon_m=newer,
    )
    r = rates(old, new)
    assert r.daemon_events_per_s == 150.0 and r.daemon_segments_per_s == 2.0 and r.wal_segments_per_s == 2.0
    assert r.wal_bytes_per_s is None  # no node metrics
    assert new.problems == {"cdcd_kafka_retries_total": 2.0} and new.consumer == {"cdcd_kafka_retries_total": 2.0}
    # A restarted daemon's counters start again: a rate of 0, never negative.
    restarted = build_snapshot(
        104.0, sources={}, status=status, state=state, daemon_pid=None, node_m=None, daemon_m=parse_metrics(text)
    )
    assert rates(new, restarted).daemon_events_per_s == 0.0


def test_the_plain_line_and_the_cluster_row_carry_the_same_figures() -> None:
    """`make run` without a terminal and `make run-cluster` show top's figures from one snapshot: the lake's
    version, rows, files per partition and last compaction (a clock, not a number), and any problem."""
    from rich.console import Console

    from cdcd.top.snapshot import build_snapshot, parse_metrics
    from cdcd.top.view import cluster_table, render, status_line

    status = {"node_id": "n", "wal_position": "10:500", "cdc": "on", "realtime": {}, "delivering": "daemon"}
    state = {"mode": "ACTIVE", "position": "8:0#0", "position_parts": [8, 0, 0], "links": 3}
    text = (
        "# TYPE cdcd_lake_table_version gauge\ncdcd_lake_table_version 41\n"
        '# TYPE cdcd_lake_rows_written counter\ncdcd_lake_rows_written_total{cache="a"} 1000\n'
        'cdcd_lake_rows_written_total{cache="b"} 234\n'
        "# TYPE cdcd_lake_files_per_partition_max gauge\ncdcd_lake_files_per_partition_max 7\n"
        "# TYPE cdcd_lake_last_maintenance_timestamp_seconds gauge\n"
        'cdcd_lake_last_maintenance_timestamp_seconds{task="compact"} 1795720000\n'
        'cdcd_lake_last_maintenance_timestamp_seconds{task="vacuum"} 1795721400\n'
        "# TYPE cdcd_lake_last_maintenance_duration_seconds gauge\n"
        'cdcd_lake_last_maintenance_duration_seconds{task="compact"} 3.254\n'
        'cdcd_lake_last_maintenance_duration_seconds{task="vacuum"} 0.41\n'
        "# TYPE cdcd_daemon_dead_letters counter\n"
        'cdcd_daemon_dead_letters_total{cache="a"} 2\n'
    )
    snap = build_snapshot(
        100.0, sources={}, status=status, state=state, daemon_pid=None, node_m=None, daemon_m=parse_metrics(text)
    )
    line = status_line(snap, None)
    for part in (
        "WAL 10:500",
        "delivering daemon",
        "daemon 8:0#0",
        "lag 2 seg",
        "backlog 3 seg",
        "lake v41",
        "rows 1,234",
        "files/part 7",
        "compacted 19:06:40 (3.25 s)",
        "problems daemon_dead_letters_total 2",
    ):
        assert part in line, line
    console = Console(width=250, record=True)
    console.print(cluster_table([("node0", snap, None)]))
    header, row = console.export_text().splitlines()[:2]
    assert header.split()[:3] == ["node", "WAL", "WAL"] and header.rstrip().endswith("problems"), header
    assert row.startswith("node0  10:500") and "v41" in row and "19:06:40 (3.25 s)" in row, row
    # The full screen, 80 columns: the lake's lines lead the Consumer panel, the duration uncut.
    console = Console(width=80, height=60, record=True)
    console.print(render(snap, None, node_dir="/n", since="-", interval_ms=1000))
    screen = console.export_text()
    assert re.search(r"│ lake table version +41 │", screen), screen
    assert re.search(r"│ last compaction +19:06:40 UTC, took 3.25 s │", screen), screen
    assert re.search(r"│ last optimize +not yet │", screen), screen
    assert re.search(r"│ last vacuum +19:30:00 UTC, took 0.41 s │", screen), screen
    assert "cdcd_lake_last_maintenance" not in screen  # shown in words, not again as raw samples
