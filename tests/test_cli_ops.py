"""Everyday commands (issue 13.10): `wal dump` on a live node, `--from` checks, help everywhere, option placement,
log format, clear errors for a busy metrics port, a missing node dir and lake misuse."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import click

from cdcd.cli import main
from cdcd.node import Node
from cdcd.wal import SegmentReader, WalPointer, WalReader
from cdcd.wal.dump import open_records
from cdcd.wal.segment import list_segments
from tests.support.procs import CDCD, cdcd, child_env, reap, wait_for

SETTINGS: dict[str, Any] = {"wal_force_archive_timeout_ms": 0, "wal_segment_size_bytes": 1 << 20, "wal_mode": "fsync"}


def write(node: Node, n: int, first: int = 0) -> None:
    c = node.cache("orders")
    for i in range(first, first + n):
        c.put(i, {"n": i})


def reference(node_dir: Path, upto: int) -> list[tuple[WalPointer, str]]:
    wal = node_dir / "wal"
    work, _ = list_segments(wal)
    return [
        (p, type(r).__name__)
        for p, r in WalReader([wal / "archive", wal], active_segment=max(work))
        if p.segment <= upto
    ]


def test_dump_of_a_work_dir_rolled_between_listing_and_reading(tmp_path: Path) -> None:
    """The node rolls after `wal dump` listed its work dir: the segment it took as active is complete and in the
    archive, the new one is the active one. Every record is read once, in order (was: TruncatedSegment)."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, **SETTINGS) as node:
        write(node, 50)
        node.force_archive()
        write(node, 50, 50)
        records = open_records(node_dir / "wal", None)  # lists the work dir: segment 1 is the active one
        node.force_archive()
        write(node, 5, 100)
        got = [(p, type(r).__name__) for p, r in records]
        assert got == reference(node_dir, 2)
        assert [p.segment for p, t in got if t == "SegmentEnd"] == [0, 1]


def test_dump_follows_a_segment_archived_while_it_reads(tmp_path: Path) -> None:
    """The node archives the active segment while `wal dump` reads an older one: the segment is opened in the archive
    (was: FileNotFoundError traceback), every record once, in order."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, **SETTINGS) as node:
        for i in range(3):
            write(node, 30, 30 * i)
            node.force_archive()
        write(node, 30, 90)
        it = iter(open_records(node_dir / "wal", None))
        first = next(it)  # segment 0 open; segment 3 listed in the work dir
        for i in range(2):
            node.force_archive()
            write(node, 3, 200 + i)
        got = [(first[0], type(first[1]).__name__)] + [(p, type(r).__name__) for p, r in it]
        assert got == reference(node_dir, 3)
        assert got[-1][1] == "SegmentEnd" and got[-1][0].segment == 3


def test_dump_from_a_pointer_that_is_no_record_start_says_so(tmp_path: Path) -> None:
    """`--from SEG:OFF` inside a record: exit 2, one line naming the file, the offset and the record starts around it
    (was: a CRC error about a record that does not exist); a record start works, on a file and on a work dir."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, **SETTINGS) as node:
        write(node, 20)
        node.force_archive()
    seg = node_dir / "wal" / "archive" / "0000000000000000.wal"
    starts = [p.offset for p, r in SegmentReader(seg)]
    a, b = starts[3], starts[4]
    for target in (str(seg), str(node_dir / "wal")):
        res = cdcd("wal", "dump", target, "--from", f"0:{a + 5}")
        assert (res.returncode, res.stdout) == (2, ""), res.stderr
        assert res.stderr.splitlines() == [
            f"cdcd: error: {seg} at offset {a + 5}: not a record boundary: records start at {a} and {b}"
        ]
        res = cdcd("wal", "dump", target, "--from", f"0:{b}")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.splitlines()[0])["pos"] == f"0:{b}"


def test_dump_of_a_live_node_never_fails(tmp_path: Path) -> None:
    """`wal dump` of the work dir of a `cdcd node run` process that writes 3000 entries/s for 20 s and rolls 64 KiB
    segments (and every 50 ms): 12 runs, each exit 0, no traceback, each a gap-free run of records in order from 0:40,
    every segment but the last closed by its SegmentEnd. The load is bounded because each dump reads the whole WAL:
    on a loaded machine an endless load grew the WAL faster than the dumps read it."""
    node_dir = tmp_path / "node"
    config = tmp_path / "node.toml"
    config.write_text(
        f'node_dir = "{node_dir}"\nwal_segment_size_bytes = 65536\nwal_force_archive_timeout_ms = 50\n'
        'metrics_address = ""\nwal_mode = "background"\n'
    )
    log = (tmp_path / "node.log").open("wb")
    node = subprocess.Popen(
        [
            *CDCD,
            "node",
            "run",
            "--config",
            str(config),
            "--load-rate",
            "3000",
            "--load-seconds",
            "20",
            "--load-keyspace",
            "1000",
        ],
        stdout=log,
        stderr=log,
        env=child_env(),
    )
    try:
        wait_for(lambda: len(list_segments(node_dir / "wal" / "archive")[0]) >= 3, 60, "the node to roll")
        for _ in range(12):
            res = subprocess.run([*CDCD, "wal", "dump", str(node_dir / "wal")], capture_output=True, timeout=120)
            assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr[-2000:]
            recs = [json.loads(line) for line in res.stdout.splitlines()]
            assert recs[0]["pos"] == "0:40"
            segs = sorted({r["segment"] for r in recs})
            assert segs == list(range(segs[-1] + 1)), "no segment skipped"
            ends = [r["segment"] for r in recs if r["type"] == "SegmentEnd"]
            assert ends in (segs[:-1], segs), "a SegmentEnd closes every segment but the active one"
            pointers = [(r["segment"], r["offset"]) for r in recs]
            assert pointers == sorted(set(pointers)), "in order, once"
    finally:
        node.terminate()
        node.wait(60)
    assert node.returncode == 0


def test_lake_verify_before_any_compaction_says_to_compact_first(tmp_path: Path) -> None:
    """`lake verify` on a lake with changes but no compacted state: exit 2, one line saying to compact first,
    and the node is not touched (no lock taken, nothing written)."""
    from tests.support.delta_tables import append_changes, change

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    append_changes(lake, [change("orders", "1", '"one"', 1)])
    with Node.open(node_dir) as node:
        node.cache("orders").put(1, "one")
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [
        f"cdcd: error: {lake}: state is behind changes (never compacted, changes at version 0): "
        f"compact first (`cdcd lake compact --lake {lake}`)"
    ]
    res = cdcd("lake", "verify", "--lake", str(tmp_path), "--node-dir", str(node_dir))
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"cdcd: error: {tmp_path}: not a cdcd lake (no changes/ table) (the lake is {lake}: pass --lake {lake})"
    ]


def test_lake_path_of_an_unknown_scheme_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    """A daemon whose lake sink has `lake_path = "ftp://…"` (not a directory, not an object store cdcd
    reaches) exits 2 naming the key, and no `./ftp:` dir appears (s3://, abfss://, gs://: docs/cluster.md)."""
    from tests.support.config import write_daemon_config

    node_dir = tmp_path / "node"
    with Node.open(node_dir) as node:
        node.cache("orders").put(1, "one")
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, {"kind": "lake", "lake_path": "ftp://bucket/lake"})
    work = tmp_path / "cwd"
    work.mkdir()
    res = subprocess.run(
        [*CDCD, "run", "--config", str(config)], capture_output=True, text=True, cwd=work, env=child_env(), timeout=120
    )
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"cdcd: error: {config}: consumer: lake_path 'ftp://bucket/lake': unknown scheme 'ftp' "
        "(known: abfs, abfss, az, gs, s3, s3a, or a directory)"
    ]
    assert list(work.iterdir()) == []
    assert not (node_dir / "cdcd.lock").exists() and not (node_dir / "cdcd-state").exists()


def all_commands() -> list[tuple[list[str], click.Command]]:
    out: list[tuple[list[str], click.Command]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, [*path, name])

    walk(main, [])
    return out


def test_every_command_takes_h_and_every_option_has_help() -> None:
    """`-h` prints the help of every command and group (exit 0); every option says what it does."""
    from click.testing import CliRunner

    runner = CliRunner()
    commands = all_commands()
    assert len(commands) > 15
    for path, cmd in commands:
        res = runner.invoke(main, [*path, "-h"])
        assert res.exit_code == 0 and "Usage: " in res.output, (path, res.output)
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert p.help, f"cdcd {' '.join(path)} {p.opts[0]} has no help text"


def test_control_takes_node_dir_after_the_subcommand(tmp_path: Path) -> None:
    """`cdcd control status --node-dir D` works like `cdcd control --node-dir D status`; without either: exit 2."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir) as node:
        after = cdcd("control", "status", "--node-dir", str(node_dir), "--json")
        before = cdcd("control", "--node-dir", str(node_dir), "status", "--json")
        sock = cdcd("control", "status", "--socket", str(node_dir / "control.sock"), "--json")
        for res in (after, before, sock):
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["node_id"] == str(node.node_id)
        res = cdcd("control", "status")
        assert res.returncode == 2 and res.stderr.splitlines() == [
            "cdcd: error: give --node-dir DIR (or --socket PATH)"
        ]


def test_run_log_format_missing_node_dir_and_busy_metrics_port(tmp_path: Path) -> None:
    """`cdcd run` logs JSON lines when not on a terminal and console lines with `--log-format console`; a missing
    node_dir is waited for (`waiting_for_node`, the first line) and SIGTERM then exits 0, leaving nothing behind; a
    busy metrics port names `metrics_address`, exit 2."""
    import socket

    from tests.support.config import jsonl_consumer, write_daemon_config

    missing = tmp_path / "no-such-node"
    config = write_daemon_config(tmp_path / "cdcd.toml", missing, jsonl_consumer(tmp_path / "out.jsonl"))
    for fmt in ([], ["--log-format", "console"]):
        err = tmp_path / f"run{len(fmt)}.err"
        with err.open("wb") as f:
            proc = subprocess.Popen([*CDCD, "run", "--config", str(config), *fmt], stderr=f, env=child_env())
        try:
            wait_for(lambda: b"waiting_for_node" in err.read_bytes() or proc.poll() is not None, 60, "the wait")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, err.read_text()
        finally:
            reap(proc)
        lines = err.read_text().splitlines()
        assert "Traceback" not in err.read_text()
        if fmt:
            assert not lines[0].startswith("{") and "waiting_for_node" in lines[0]
        else:
            assert json.loads(lines[0])["event"] == "waiting_for_node"
    assert not missing.exists() and not (tmp_path / "out.jsonl").exists()

    node_dir = tmp_path / "node"
    with Node.open(node_dir) as node:
        node.cache("orders").put(1, "one")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        config = write_daemon_config(
            tmp_path / "metrics.toml", node_dir, jsonl_consumer(tmp_path / "m.jsonl"), metrics_address=address
        )
        res = subprocess.run(
            [*CDCD, "run", "--config", str(config)], capture_output=True, text=True, env=child_env(), timeout=60
        )
    assert res.returncode == 2  # a config problem: the unit does not restart-loop on it
    last = res.stderr.splitlines()[-1]
    assert last.startswith(f"cdcd: error: {config}: key 'metrics_address': cannot listen on {address}: "), last
    assert "Address already in use" in last and "Traceback" not in res.stderr


def test_control_cdc_realtime_is_control_realtime(tmp_path: Path) -> None:
    """IEP-104's spelling `cdcd control cdc realtime on|off` is `cdcd control realtime on|off`: the same answers, errors
    and exit codes, with --node-dir before or after; `cdc on|off` stays the CDC-links switch."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir):
        for state in ("off", "on", "maybe"):
            plain = cdcd("control", "realtime", state, "--node-dir", str(node_dir))
            for spelled in (
                cdcd("control", "cdc", "realtime", state, "--node-dir", str(node_dir)),
                cdcd("control", "--node-dir", str(node_dir), "cdc", "realtime", state),
            ):
                assert (spelled.returncode, spelled.stdout, spelled.stderr) == (
                    plain.returncode,
                    plain.stdout,
                    plain.stderr,
                )
            assert plain.returncode == {"off": 0, "on": 1, "maybe": 2}[state], plain.stderr
        assert plain.returncode == 2 and "'maybe' is not one of 'on', 'off'" in plain.stderr
        off = cdcd("control", "cdc", "realtime", "off", "--node-dir", str(node_dir))
        assert off.stdout == "realtime: off\n"
        links = cdcd("control", "cdc", "off", "--node-dir", str(node_dir))
        assert links.returncode == 0 and links.stdout.startswith("cdc: off (from WAL position "), links.stderr
    help_text = cdcd("control", "cdc", "realtime", "-h")
    assert help_text.returncode == 0 and "Switch realtime CDC" in help_text.stdout


def test_storage_config_is_read_by_the_daemon_config_loader(tmp_path: Path) -> None:
    """`cdcd lake … --storage-config cdcd.toml` reads `[consumer.storage]` as `cdcd run` does: an unknown key there is
    one line naming it (exit 2), a `CDCD_CONSUMER__STORAGE__*` variable overrides the file, and the store the
    settings name is the one tried (an endpoint nothing listens on: exit 2 naming it)."""

    from tests.support.config import write_daemon_config
    from tests.support.ports import free_port

    port_file, port_env = free_port(), free_port()  # reserved: nothing listens on them
    storage = {"endpoint": f"http://127.0.0.1:{port_file}", "path_style": True, "access_key_id": "k"}
    consumer = {"kind": "lake", "lake_path": "s3://bucket/lake", "storage": {**storage, "secret_access_key": "s"}}
    config = write_daemon_config(tmp_path / "cdcd.toml", tmp_path / "node", consumer)
    lake = ["lake", "show", "--lake", "s3://bucket/lake", "--storage-config", str(config)]
    res = cdcd(*lake)
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"cdcd: error: --lake s3://bucket/lake ({config} [consumer.storage]): lake storage: s3://bucket at "
        f"http://127.0.0.1:{port_file}: endpoint unreachable (connection refused)"
    ]
    res = cdcd(*lake, env={**child_env(), "CDCD_CONSUMER__STORAGE__ENDPOINT": f"http://127.0.0.1:{port_env}"})
    assert res.returncode == 2 and f"at http://127.0.0.1:{port_env}: endpoint unreachable" in res.stderr, res.stderr
    bad = write_daemon_config(
        tmp_path / "bad.toml", tmp_path / "node", {**consumer, "storage": {"endpont": "http://127.0.0.1:1"}}
    )
    res = cdcd("lake", "show", "--lake", "s3://bucket/lake", "--storage-config", str(bad))
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"cdcd: error: {bad}: consumer.storage: unknown key 'endpont' (did you mean 'endpoint'?)"
    ]


def test_one_mapping_from_fault_to_exit_code_and_line(tmp_path: Path) -> None:
    """`cdcd.cli.exits.exit_for` is the one place a command's exception becomes its exit code: a fault carries its
    code and hint wherever it is raised; an OS error is 1 naming the file; anything else is 1, "unexpected"."""
    from cdcd.cli.exits import exit_for, line_for
    from cdcd.config import ConfigError
    from cdcd.daemon.committer import ConsumerFailed
    from cdcd.daemon.daemon import PipelineStalled
    from cdcd.daemon_state import ForeignState
    from cdcd.faults import ExitCode
    from cdcd.lock import LockHeld
    from cdcd.wal.errors import CorruptRecord, ForeignSegment, MissingSegment, NotARecordStart, TruncatedSegment

    seg = tmp_path / "0000000000000003.wal"
    cases = {
        CorruptRecord(seg, 40, "CRC mismatch"): ExitCode.BAD_WAL,
        TruncatedSegment(seg, 80, "ends before its SegmentEnd"): ExitCode.BAD_WAL,
        ForeignSegment(seg, 0, "node a, not b"): ExitCode.BAD_WAL,
        MissingSegment(tmp_path, 3): ExitCode.MISSING_SEGMENT,
        NotARecordStart(seg, 41, "not a record boundary"): ExitCode.BAD_INPUT,
        ConfigError("cdcd.toml: unknown key 'x'"): ExitCode.BAD_INPUT,
        LockHeld(tmp_path / "cdcd.lock", 42): ExitCode.FAILED,
        ConsumerFailed("consumer on_events() raised RuntimeError: x"): ExitCode.CONSUMER_FAILED,
        PipelineStalled("consumer call running for 301 s"): ExitCode.STALLED,
        ForeignState("state of node a, node dir of b"): ExitCode.BAD_STATE,
    }
    for exc, code in cases.items():
        assert exit_for(exc)[:2] == (code, str(exc)), exc
    assert line_for(MissingSegment(tmp_path, 3)) == (
        3,
        f"{tmp_path}: missing segment 3 (links were lost; run `cdcd control relink-lost-segments`, "
        "or `cdcd control delete-lost-segment-links` and resend)",
    )
    assert line_for(LockHeld(tmp_path / "l", 7), "the daemon is running", hint="stop it first") == (
        1,
        f"the daemon is running: {tmp_path / 'l'} is locked by pid 7 (stop it first)",
    )
    missing = FileNotFoundError(2, "No such file or directory", str(seg))
    assert exit_for(missing) == (1, f"{seg}: No such file or directory", "")
    assert exit_for(KeyError("x")) == (1, "unexpected KeyError: 'x'", "")
