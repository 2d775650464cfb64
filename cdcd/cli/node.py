"""``cdcd node``: run the storage node as a process, compare two nodes."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import click
import msgspec

from cdcd.cli.exits import fail, fail_on, line_for
from cdcd.cli.process import Stops, log_to_stderr, on_stop_signals, serve_metrics, stop_timeout_option
from cdcd.faults import ExitCode


@click.group()
def node() -> None:
    """Run the storage node as a process."""


@node.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Node TOML config.")
@click.option("--load-rate", type=int, default=0, show_default=True, help="Built-in load: entries per second.")
@click.option("--load-seconds", type=float, default=0, help="Stop the load after this long; the node keeps running.")
@click.option("--load-keyspace", type=click.IntRange(1), default=100_000, show_default=True, help="Keys 0..N-1.")
@click.option("--load-remove-pct", type=click.IntRange(0, 100), default=20, show_default=True, help="Removes, %.")
@click.option("--load-seed", type=int, default=1, show_default=True, help="Seed of the load's key choice.")
@click.option("--seconds", type=float, default=0, help="Stop after this long (0: until SIGTERM/SIGINT).")
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY.")
@stop_timeout_option
def node_run(
    *,
    config_path: Path,
    load_rate: int,
    load_seconds: float,
    load_keyspace: int,
    load_remove_pct: int,
    load_seed: int,
    seconds: float,
    log_format: str | None,
    stop_timeout: float,
) -> None:
    """Open a node and keep it running (with an optional load generator) until stopped.

    Exit codes: 0 stopped, 1 the node is locked by another process (or an OS error, or its WAL
    flusher, checkpointer or load generator died), 2 bad config (or metrics port in use), 5 corrupt
    WAL, 141 the reader of its log went away (a closed pipe: it stopped as on SIGTERM). It exits
    within --stop-timeout of SIGTERM/SIGINT or a failure, closed or not (then 128 + the signal's
    number, or the failure's code). Under systemd (NOTIFY_SOCKET) it sends READY=1 once open and
    WATCHDOG=1 pings only while the WAL flusher is alive and passing.
    """
    from cdcd.config import load_toml
    from cdcd.daemon.sdnotify import Notifier
    from cdcd.node.config import NodeConfig
    from cdcd.node.load import LoadGenerator
    from cdcd.node.node import Node
    from cdcd.node.run import run_node

    log_to_stderr(log_format)
    stop = threading.Event()
    stops = on_stop_signals(
        lambda _signal: stop.set(),
        bound_s=stop_timeout,
        what=f"the node of {config_path}",
        hint="the next start recovers from the WAL",
        when_log_reader_gone=True,
    )
    try:
        config = load_toml(config_path, NodeConfig)
        the_node = Node(config)
    except Exception as exc:
        fail_on(exc)
    try:
        serve_metrics(config.metrics_address, config_path)
    except Exception as exc:
        the_node.close()
        fail_on(exc)
    load = None
    if load_rate > 0:
        load = LoadGenerator(
            the_node,
            load_rate,
            keyspace=load_keyspace,
            remove_ratio=load_remove_pct / 100,
            seconds=load_seconds,
            seed=load_seed,
        )
    try:
        # The load's progress is its load_progress log line: a "\r" line of its own ran into log lines.
        run_node(
            the_node,
            Notifier(),
            stop,
            seconds=seconds,
            load=load,
            on_closing=lambda failure: closing(stops, failure),
        )
    except Exception as exc:
        fail_on(exc)
    if stops.exit_code:
        sys.exit(stops.exit_code)


def closing(stops: Stops, failure: BaseException | None) -> None:
    """The node begins to close: after a stop request the bound already runs; after a failure or
    the end of ``--seconds`` it starts now."""
    if failure is None:
        stops.start_clock("the end of --seconds", ExitCode.FAILED)
    else:
        code, line = line_for(failure)
        stops.start_clock(f"a failure ({line})", code)


def _node_source(node_dir: Path) -> Any:
    """A read-only snapshot of a stopped node, or the digests of a running one (control socket)."""
    from cdcd.control import request
    from cdcd.node.config import NodeConfig
    from cdcd.node.node import NodeLocked
    from cdcd.node.snapshot import NodeSnapshot

    try:
        return NodeSnapshot(node_dir)
    except NodeLocked:
        pass
    socket_path = NodeConfig(node_dir=str(node_dir)).control_socket_path
    try:
        reply = request(socket_path, {"cmd": "digest"}, timeout_s=600)
    except OSError as exc:
        fail(f"{node_dir}: node is running but its control socket {socket_path} does not answer: {exc}", 1)
    if not reply.get("ok"):
        fail(f"{socket_path}: {reply.get('error')}", 1)
    return reply["caches"]


@node.command("diff")
@click.argument("node_a", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("node_b", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--cache", "only", multiple=True, help="Compare only this cache (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def node_diff(node_a: Path, node_b: Path, only: tuple[str, ...], as_json: bool) -> None:
    """Compare the data of two nodes (a stand-by and its primary): rows and checksums per cache,
    and which keys differ when both are stopped. Exit 0 when equal, 1 when not."""
    from cdcd.node.diff import compare_digests, compare_items, digests

    log_to_stderr(level="warning")
    if node_a.resolve() == node_b.resolve():
        fail(f"{node_a} and {node_b} are the same node", ExitCode.BAD_INPUT)
    a = _node_source(node_a)
    try:
        b = _node_source(node_b)
    except BaseException:
        if not isinstance(a, dict):
            a.close()
        raise
    try:
        if isinstance(a, dict) or isinstance(b, dict):
            da = a if isinstance(a, dict) else digests(a)
            db = b if isinstance(b, dict) else digests(b)
            names = sorted(set(da) | set(db))
            diffs = [compare_digests(c, da.get(c), db.get(c)) for c in names if not only or c in only]
        else:
            names = sorted(set(a.caches()) | set(b.caches()))
            diffs = [compare_items(c, a.raw_items(c), b.raw_items(c)) for c in names if not only or c in only]
    finally:
        for side in (a, b):
            if not isinstance(side, dict):
                side.close()
    if as_json:
        click.echo(msgspec.json.encode([d.__dict__ | {"same": d.same} for d in diffs]).decode())
    else:
        click.echo(f"{'cache':<24} {'rows A':>10} {'rows B':>10}  {'only A':>8} {'only B':>8} {'differ':>8}  result")
        for d in diffs:
            counts = [("-" if n is None else f"{n:,}") for n in (d.only_a, d.only_b, d.different)]
            click.echo(
                f"{d.cache:<24} {d.rows_a:>10,} {d.rows_b:>10,}  {counts[0]:>8} {counts[1]:>8} {counts[2]:>8}  "
                + ("same" if d.same else "DIFFERENT")
            )
            for example in d.examples:
                click.echo(f"    {example}")
    if not all(d.same for d in diffs):
        sys.exit(1)
