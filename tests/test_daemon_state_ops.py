"""A damaged daemon state and `cdcd state reset` (issue 13.7, 19.11): one line naming the file, exit 7 (not restarted
by the unit), no traceback, no SIGBUS; the reset moves the damaged file aside and delivery resumes exactly at the
chosen point. Real nodes, real `cdcd` processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cdcd.wal import DataRecord, SegmentReader
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import (
    catch_up_and_stop,
    cdcd,
    error_lines,
    log_events,
    polled_position,
    run_daemon_until_exit,
    start_daemon,
    state_position,
    state_show,
    stop_daemon,
    wait_for,
)
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import make_node


def only_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("cdcd: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def damage(data: Path, how: str) -> None:
    raw = data.read_bytes()
    if how == "garbage":
        data.write_bytes(bytes((b * 7 + 13) % 251 for b in range(len(raw))))
    elif how == "garbage-pages":  # meta pages intact, every other page garbage
        data.write_bytes(raw[:8192] + bytes((i * 31 + 7) % 256 for i in range(len(raw) - 8192)))
    elif how == "half":
        os.truncate(data, len(raw) // 2)
    elif how == "short":
        os.truncate(data, 5000)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["garbage", "garbage-pages", "half", "short"])
def test_damaged_state_is_one_line_exit_7_then_reset_resumes_at_the_oldest_link(tmp_path: Path, how: str) -> None:
    """`cdcd run` and `cdcd state show` on a damaged (or truncated: SIGBUS before) data.mdb exit 7 with one line naming
    the file; `state reset --yes` moves it aside, takes the cache registry from the node and the mode from its
    metastorage (realtime off: ACTIVE), and the daemon then delivers exactly the links' entries."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    n = make_node(node_dir, segments=2, tx_per_segment=5)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    catch_up_and_stop(config, tmp_path / "run1.err", (2, 0, 0))
    make_node(node_dir, segments=3, tx_per_segment=5, first_tx=n)  # links 2..4
    data = node_dir / "cdcd-state" / "data.mdb"
    damage(data, how)

    err = tmp_path / "run2.err"
    assert run_daemon_until_exit(config, err) == 7
    line = only_error_line(err.read_text())
    what = {
        "garbage": "not an LMDB file",
        "garbage-pages": "damaged daemon state (mdb_dbi_open: MDB_CORRUPTED",
        "half": "truncated to",
        "short": "truncated to 5000 bytes, shorter than its two meta pages",
    }[how]
    assert line.startswith(f"cdcd: error: {data}: {what}"), line
    assert "damaged daemon state" in line, line
    assert line.endswith("; stop the daemon and run `cdcd state reset` (docs/daemon.md: Operator commands)"), line
    assert [e["event"] for e in log_events(err) if e["level"] == "error"] == ["bad_state"]
    res = cdcd("state", "show", "--config", str(config))
    assert (res.returncode, res.stdout) == (7, "")
    assert only_error_line(res.stderr) == line
    assert sorted(cdc_links(node_dir)) == [2, 3, 4], "nothing deleted"

    res = cdcd("state", "reset", "--config", str(config))
    assert res.returncode == 2 and "refusing without --yes" in res.stderr
    res = cdcd("state", "reset", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert "reset to  ACTIVE at 2:0#0" in res.stdout and "caches    3 from node page store" in res.stdout
    moved = [p for p in data.parent.iterdir() if p.name.startswith("data.mdb.damaged-")]
    assert len(moved) == 1 and f"moved the damaged state to {moved[0]}" in res.stdout
    reset = [json.loads(x) for x in res.stderr.splitlines() if x.startswith("{")]
    assert [(e["event"], e["position"], e["mode"]) for e in reset] == [("state_reset", "2:0#0", "ACTIVE")]
    info = state_show(config)
    assert (info["mode"], info["position"]) == ("ACTIVE", "2:0#0")
    assert sorted(info["caches"].values()) == ["events", "orders", "users"]

    catch_up_and_stop(config, tmp_path / "run3.err", (5, 0, 0))
    assert read_jsonl(out) == wal_events(node_dir), "segments 0-1 before, 2-4 after the reset, each once"


def test_reset_to_a_position_inside_a_record_resumes_exactly_there(tmp_path: Path) -> None:
    """`state reset --to SEG:OFF#IDX` at entry 3 of a DataRecord: the next run delivers from exactly that entry on;
    offsets that are no record start, segments without a link and a too-large entry index are refused (exit 2)."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=4, tx_per_segment=5)
    expected = wal_events(node_dir)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    data = [p for p, r in SegmentReader(archived_segments(node_dir)[2]) if type(r) is DataRecord]
    at = data[2]

    res = cdcd("state", "reset", "--config", str(config), "--to", f"2:{at.offset + 3}", "--yes")
    assert res.returncode == 2
    assert only_error_line(res.stderr).startswith(
        f"cdcd: error: --to 2:{at.offset + 3}#0: {cdc_links(node_dir)[2]} at offset {at.offset + 3}: "
        f"not a record boundary: records start at {at.offset} and "
    )
    res = cdcd("state", "reset", "--config", str(config), "--to", "7:0", "--yes")
    assert res.returncode == 2
    assert (
        only_error_line(res.stderr)
        == f"cdcd: error: --to 7:0#0: segment 7 has no link in {node_dir / 'cdc'} (links 0..3)"
    )
    res = cdcd("state", "reset", "--config", str(config), "--to", f"2:{at.offset}#100000", "--yes")
    assert res.returncode == 2 and "entr(y/ies)" in only_error_line(res.stderr)
    assert not (node_dir / "cdcd-state").exists(), "a refused reset writes nothing"

    res = cdcd("state", "reset", "--config", str(config), "--to", f"2:{at.offset}#3", "--yes")
    assert res.returncode == 0, res.stderr
    assert state_position(config) == (2, at.offset, 3)
    catch_up_and_stop(config, tmp_path / "run.err", (4, 0, 0))
    got = read_jsonl(out)
    assert got == [e for e in expected if tuple(e["pos"]) >= (2, at.offset, 3)]
    assert got[0]["pos"] == [2, at.offset, 3]


def test_reset_refused_while_the_daemon_runs(tmp_path: Path) -> None:
    """`state reset` takes the daemon's lock: with a daemon running it exits 1 naming it, and changes nothing."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=3)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    proc = start_daemon(config, tmp_path / "run.err")
    try:
        wait_for(lambda: polled_position(config) == (2, 0, 0), 60, "the daemon to catch up")
        res = cdcd("state", "reset", "--config", str(config), "--yes")
        assert res.returncode == 1
        assert only_error_line(res.stderr) == (
            f"cdcd: error: the daemon is running ({node_dir / 'cdcd.lock'} is locked by pid {proc.pid}); stop it first"
        )
        assert state_position(config) == (2, 0, 0)
    finally:
        assert stop_daemon(proc) == 0
    assert not error_lines(tmp_path / "run.err")


def test_unit_does_not_restart_a_damaged_state() -> None:
    from cdcd import cli

    unit = (Path(__file__).resolve().parent.parent / "systemd" / "cdcd@.service").read_text()
    codes = next(x for x in unit.splitlines() if x.startswith("RestartPreventExitStatus=")).split("=")[1].split()
    assert str(cli.EXIT_BAD_STATE) in codes


def test_daemon_without_state_asks_the_running_node_and_delivers(tmp_path: Path) -> None:
    """The daemon's state is deleted while a node process (realtime off) keeps writing; its Stop record lies in a
    segment already consumed. The restarted daemon asks the node over its control socket, goes ACTIVE from the oldest
    link and delivers (was: PASSIVE, 0 events, nothing logged above info). Both runs together cover the WAL exactly,
    the second starting at the first link present."""
    import shutil

    from tests.support.writer import start_writer

    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    writer = start_writer(tmp_path, node_dir, pause_ms=50)
    try:
        wait_for(lambda: len(archived_segments(node_dir)) >= 2, 60, "the writer to archive 2 segments")
        config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
        proc = start_daemon(config, tmp_path / "run1.err")
        try:
            wait_for(lambda: (polled_position(config) or (0,))[0] >= 2, 60, "run 1 to pass segment 2")
        finally:
            assert stop_daemon(proc) == 0
        first = read_jsonl(out)
        shutil.rmtree(node_dir / "cdcd-state")
        # Run 1 may have consumed every link there was: the writer archives the next one.
        wait_for(lambda: cdc_links(node_dir), 60, "a link the first run did not consume")
        oldest = min(cdc_links(node_dir))
        err2 = tmp_path / "run2.err"
        proc = start_daemon(config, err2)
        try:
            target = oldest + 3
            wait_for(lambda: (polled_position(config) or (0,))[0] >= target, 60, f"run 2 to pass segment {target}")
        finally:
            (tmp_path / "writer.stop").write_text("")
            assert writer.wait(60) == 0
        end = (max(archived_segments(node_dir)) + 1, 0, 0)
        wait_for(lambda: polled_position(config) == end, 60, f"run 2 to reach {end}")
        assert stop_daemon(proc) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
    decided = [e for e in log_events(err2) if e["event"] == "daemon_state_from_node"]
    assert len(decided) == 1 and decided[0]["mode"] == "ACTIVE", decided
    assert decided[0]["source"] == f"control socket {node_dir / 'control.sock'}"
    expected = wal_events(node_dir)
    got = read_jsonl(out)
    second = got[len(first) :]
    assert got[: len(first)] == first == expected[: len(first)]
    assert second[0]["pos"][:2] == [oldest, expected[[e["pos"][0] for e in expected].index(oldest)]["pos"][1]]
    assert second == [e for e in expected if e["pos"][0] >= oldest], "from the oldest link on, exactly"
