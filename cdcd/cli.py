"""The ``cdcd`` command line."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
import msgspec
import structlog

from cdcd import __version__
from cdcd.config import ConfigError, split_host_port
from cdcd.logging import configure as configure_logging
from cdcd.secrets import mask_value
from cdcd.wal.errors import MissingSegment, WalError
from cdcd.wal.pointer import WalPointer

EXIT_LOCKED = 1
EXIT_BAD_INPUT = 2
EXIT_MISSING_SEGMENT = 3
EXIT_CONSUMER_FAILED = 4
EXIT_BAD_WAL = 5
EXIT_STALLED = 6
EXIT_BAD_STATE = 7
"""The daemon's state is damaged or belongs to another node: `cdcd state reset` (not restarted by the unit)."""


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"cdcd: error: {mask_value(message)}", err=True)
    sys.exit(code)


def on_stop_signals(stop: Callable[[signal.Signals], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (from the signal handler: it must be signal-safe); a second
    one leaves at once with exit code 128 + its number, as a shell reports a process it killed."""
    received: list[signal.Signals] = []

    def on_signal(signum: int, _frame: object) -> None:
        if received:
            os._exit(128 + signum)
        received.append(signal.Signals(signum))
        stop(signal.Signals(signum))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cdcd")
def main() -> None:
    """cdcd: change-data-capture for the cdcd storage node."""


# --- wal ------------------------------------------------------------------------------------------
@main.group()
def wal() -> None:
    """Inspect WAL segments."""


@wal.command("dump")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--from", "start", metavar="SEG:OFF", help="Start at this pointer (e.g. 42:1048576): a record start.")
@click.option("--active", is_flag=True, help="PATH is an active segment: a short tail is the end, not an error.")
def wal_dump(path: Path, start: str | None, active: bool) -> None:
    """Print the records of a segment file or a directory of segments as JSON lines.

    A node's work dir (one holding archive/) is read with its archive, its newest segment as active;
    segments the running node archives meanwhile are followed into the archive.
    """
    from cdcd.wal.dump import open_records, record_to_dict

    try:
        pointer = WalPointer.parse(start) if start else None
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        records = open_records(path, pointer, active=active)
        for ptr, record in records:
            out.write(encoder.encode(record_to_dict(ptr, record)))
            out.write(b"\n")
        out.flush()
    except MissingSegment as exc:
        out.flush()
        fail(str(exc), EXIT_MISSING_SEGMENT)
    except WalError as exc:
        out.flush()
        fail(str(exc), EXIT_BAD_INPUT)
    except BrokenPipeError:
        os._exit(0)  # `cdcd wal dump | head`
    except OSError as exc:
        out.flush()
        fail(f"{exc.filename or path}: {exc.strerror or exc}", 1)


# --- node -----------------------------------------------------------------------------------------
@main.group()
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
) -> None:
    """Open a node and keep it running (with an optional load generator) until stopped.

    Exit codes: 0 stopped, 1 the node is locked by another process (or an OS error, or its WAL
    flusher died), 2 bad config or unreadable WAL. Under systemd (NOTIFY_SOCKET) it sends READY=1
    once open and WATCHDOG=1 pings only while the WAL flusher is alive and passing.
    """
    from cdcd.config import load_toml
    from cdcd.daemon.sdnotify import Notifier
    from cdcd.node.config import NodeConfig
    from cdcd.node.load import LoadGenerator
    from cdcd.node.node import Node, NodeLocked

    configure_logging(log_format or ("console" if sys.stderr.isatty() else "json"))  # type: ignore[arg-type]
    try:
        config = load_toml(config_path, NodeConfig)
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    try:
        the_node = Node(config)
    except NodeLocked as exc:
        fail(str(exc), 1)
    except (WalError, ConfigError) as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:
        fail(str(exc), 1)
    stop = threading.Event()
    on_stop_signals(lambda _signal: stop.set())
    if config.metrics_address:
        from prometheus_client import start_http_server

        host, port = split_host_port(config.metrics_address, min_port=0)
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            the_node.close()
            fail(
                f"{config_path}: key 'metrics_address': cannot listen on {config.metrics_address}: {exc}",
                EXIT_BAD_INPUT,
            )
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
    if load:
        load.start()
    started = time.monotonic()
    interactive = sys.stdout.isatty()
    notifier = Notifier()
    notifier.ready(f"node {config.node_dir} open")
    next_ping = 0.0
    try:
        while not stop.wait(1.0 if interactive else 0.2):
            now = time.monotonic()
            if seconds and now - started >= seconds:
                break
            failure = the_node.failure
            if failure is not None:
                # No more watchdog pings, and exit 1: a node that refuses writes for good says so.
                what = f"{type(failure).__name__}: {failure}".splitlines()[0]
                structlog.get_logger("cdcd.node").error("node_failed", error=what)
                fail(f"{config.node_dir}: the node refuses writes: {what}", 1)
            interval = notifier.watchdog_interval_s
            # A flusher that has not woken up for a ping interval is stuck (fsync hung): no ping, and
            # systemd's watchdog ends the process.
            if interval is not None and now >= next_ping and now - the_node.wal.flusher_pass_monotonic < interval:
                notifier.watchdog()
                next_ping = now + interval
            if interactive and load:
                click.echo(
                    f"\rwritten {load.written:>10,} entries   WAL at {the_node.wal_position}   "
                    f"archived up to segment {the_node.wal.last_archived}",
                    nl=False,
                )
    finally:
        notifier.stopping()
        if load:
            load.stop()
        the_node.close()
    if interactive:
        click.echo()


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

    configure_logging("console" if sys.stderr.isatty() else "json", level="warning")
    if node_a.resolve() == node_b.resolve():
        fail(f"{node_a} and {node_b} are the same node", EXIT_BAD_INPUT)
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


# --- daemon ---------------------------------------------------------------------------------------
_IGNORED_ENV: list[str] = []
"""``CDCD_*`` names that are no config key, warned about once logging is set up."""


def _load_daemon_config(path: Path) -> Any:
    from cdcd.daemon.config import load_daemon_config

    try:
        return load_daemon_config(path, ignored=_IGNORED_ENV)
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


@main.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option(
    "--log-format",
    type=click.Choice(["json", "console"]),
    default=None,
    help="Overrides the config's log_format. Default: console on a terminal, else JSON lines.",
)
def daemon_run(config_path: Path, log_format: str | None) -> None:
    """Run the CDC daemon: follow the node's CDC dir and deliver to the consumer until SIGTERM/SIGINT.

    Exit codes: 0 stopped cleanly, 1 another daemon holds the node, 2 bad config,
    3 missing segment, 4 consumer failed, 5 corrupt, truncated or foreign segment, 6 pipeline
    stalled (a consumer call ran past consumer_stall_timeout_ms), 7 damaged daemon state or a state
    of another node (see `cdcd state reset`).
    """
    import asyncio

    from prometheus_client import start_http_server

    from cdcd.daemon.committer import ConsumerFailed
    from cdcd.daemon.daemon import Daemon, PipelineStalled, fix_mmap_threshold
    from cdcd.daemon_state import StateRefused
    from cdcd.lock import LockHeld
    from cdcd.node.identity import BadNodeIdFile
    from cdcd.sinks import load_consumer

    config = _load_daemon_config(config_path)
    fmt = log_format or config.log_format or ("console" if sys.stderr.isatty() else "json")
    configure_logging(fmt)  # type: ignore[arg-type]
    log = structlog.get_logger("cdcd.daemon")
    for name in _IGNORED_ENV:
        log.warning("environment_variable_ignored", name=name, reason="not a cdcd config key")
    fix_mmap_threshold()
    try:
        consumer = load_consumer(config.consumer, f"{config_path}: consumer")
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    daemon = Daemon(config, consumer, show_progress=sys.stdout.isatty())

    def fatal(event: str, message: str, code: int) -> None:
        log.error(event, error=message)
        daemon.close()  # its log lines first: the error stays the last line on stderr
        fail(message, code)

    def on_stop(signum: signal.Signals) -> None:
        log.info("daemon_stopping", signal=signum.name)
        daemon.stop()  # thread- and signal-safe; also before run() starts (run() then returns at once)

    # Installed before anything else, so a SIGTERM during start-up is a clean stop, not a kill.
    on_stop_signals(on_stop)

    async def main_async() -> None:
        try:
            await daemon.run()
        except PipelineStalled as exc:
            # The stuck call holds a worker thread that asyncio.run would wait for: leave now.
            log.error("pipeline_stalled", error=str(exc))
            click.echo(f"cdcd: error: {mask_value(str(exc))}", err=True)
            sys.stderr.flush()
            os._exit(EXIT_STALLED)

    try:
        daemon.start()
        if config.metrics_address:
            host, port = split_host_port(config.metrics_address, min_port=0)
            try:
                start_http_server(port, addr=host)
            except OSError as exc:
                fatal(
                    "daemon_failed",
                    f"{config_path}: key 'metrics_address': cannot listen on {config.metrics_address}: {exc}",
                    EXIT_BAD_INPUT,
                )
        asyncio.run(main_async())
    except LockHeld as exc:
        fatal("daemon_locked", f"another cdcd daemon runs for this node: {exc}", EXIT_LOCKED)
    except MissingSegment as exc:
        fatal(
            "missing_segment",
            f"{exc} (links were lost; run `cdcd control relink-lost-segments`, "
            "or `cdcd control delete-lost-segment-links` and resend)",
            EXIT_MISSING_SEGMENT,
        )
    except WalError as exc:
        fatal("bad_segment", str(exc), EXIT_BAD_WAL)
    except StateRefused as exc:
        fatal("bad_state", str(exc), EXIT_BAD_STATE)
    except BadNodeIdFile as exc:
        fatal("bad_node_dir", str(exc), EXIT_BAD_STATE)
    except ConsumerFailed as exc:
        fatal("consumer_failed", str(exc), EXIT_CONSUMER_FAILED)
    except (OSError, ConfigError) as exc:
        fatal("daemon_failed", f"{type(exc).__name__}: {exc}", 1)
    except Exception as exc:  # anything unexpected: one line, non-zero, systemd restarts us
        fatal("daemon_failed", f"unexpected {type(exc).__name__}: {exc}", 1)
    finally:
        daemon.close()


@main.group()
def state() -> None:
    """Inspect the daemon's state."""


@state.command("show")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def state_show(config_path: Path, as_json: bool) -> None:
    """Print the daemon's committed position, mode, caches and the CDC dir's links."""
    from cdcd.daemon.ops import show_state
    from cdcd.daemon_state import StateRefused

    try:
        info = show_state(_load_daemon_config(config_path))
    except StateRefused as exc:
        fail(str(exc), EXIT_BAD_STATE)
    if as_json:
        click.echo(msgspec.json.encode(info).decode())
        return
    keys = ("mode", "position", "updated", "commits", "node_id", "state_dir", "cdc_dir", "links", "first_link")
    for key in (*keys, "last_link"):
        click.echo(f"{key:<12} {info[key] if info[key] is not None else '-'}")
    caches = ", ".join(f"{name} ({cid})" for cid, name in info["caches"].items()) or "-"
    click.echo(f"{'caches':<12} {caches}")
    if info["ignored_files"]:
        click.echo(f"{'ignored':<12} {', '.join(info['ignored_files'])}")
    click.echo(f"{'consumer':<12} {msgspec.json.encode(info['consumer']).decode()}")


@state.command("reset")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option(
    "--to",
    "to",
    metavar="SEG:OFF[#IDX]",
    default=None,
    help="Deliver from this position (a record start in a linked segment); default: the oldest link.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def state_reset(config_path: Path, to: str | None, yes: bool) -> None:
    """Replace the daemon's state (damaged, of another node, or at a wrong position) with one at the
    oldest link or at --to. The daemon must be stopped. A damaged state file is moved aside, not deleted;
    the mode is what the node says (its realtime worker delivers: PASSIVE), the cache registry is kept
    or read from the node."""
    from cdcd.daemon.ops import ResetRefused, plan_reset, reset_state
    from cdcd.lock import LockHeld
    from cdcd.wal.pointer import WalPosition

    configure_logging("console" if sys.stderr.isatty() else "json")
    config = _load_daemon_config(config_path)
    try:
        position = WalPosition.parse(to) if to else None
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if not Path(config.node_dir).is_dir():
        fail(f"{config_path}: key 'node_dir': {config.node_dir} does not exist", EXIT_BAD_INPUT)
    try:
        plan = plan_reset(config, position)
    except ResetRefused as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    old = plan.old
    was = "damaged" if plan.damaged else (f"{old.mode.value} at {old.position or '-'}" if old else "none")
    new = plan.new
    click.echo(f"state     {config.state_path} (now: {was})")
    click.echo(f"reset to  {new.mode.value} at {new.position or 'the oldest link'} (mode from {plan.mode_from})")
    click.echo(f"caches    {len(plan.caches)} from {plan.caches_from}")
    if old is not None and old.position is not None and new.position is not None and new.position > old.position:
        click.echo(f"warning   entries from {old.position} to {new.position} will not be delivered")
    _confirm(yes)
    try:
        state, moved = reset_state(config, plan)
    except LockHeld as exc:
        fail(f"the daemon is running ({exc}); stop it first", EXIT_LOCKED)
    if moved is not None:
        click.echo(f"moved the damaged state to {moved}")
    click.echo(f"state reset: {state.mode.value} at {state.position or 'the oldest link'}; start the daemon")


@main.group()
@click.option(
    "--node-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The node to talk to (its control socket is <node-dir>/control.sock).",
)
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None, help="Control socket path.")
@click.pass_context
def control(ctx: click.Context, node_dir: Path | None, socket_path: Path | None) -> None:
    """Operator commands (realtime, status, resend talk to a running node)."""
    ctx.obj = socket_path or (node_dir / "control.sock" if node_dir else None)


def _set_target(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.meta[f"cdcd.{param.name}"] = value


def node_target(f: Any) -> Any:
    """``--node-dir``/``--socket`` also after a ``control`` subcommand (``cdcd control status --node-dir D``)."""
    f = click.option(
        "--socket",
        "socket_path",
        type=click.Path(path_type=Path),
        expose_value=False,
        callback=_set_target,
        help="Control socket path (wins over --node-dir).",
    )(f)
    return click.option(
        "--node-dir",
        "node_dir",
        type=click.Path(path_type=Path),
        expose_value=False,
        callback=_set_target,
        help="The node to talk to (its control socket is <node-dir>/control.sock).",
    )(f)


def _node_request(ctx: click.Context, message: dict[str, Any]) -> dict[str, Any]:
    from cdcd.control import request

    node_dir = ctx.meta.get("cdcd.node_dir")
    path = ctx.meta.get("cdcd.socket_path") or (node_dir / "control.sock" if node_dir else ctx.obj)
    if path is None:
        fail("give --node-dir DIR (or --socket PATH)", EXIT_BAD_INPUT)
    try:
        reply = request(path, message)
    except FileNotFoundError:
        fail(f"{path}: no control socket (is the node running?)", 1)
    except OSError as exc:
        fail(f"{path}: {exc}", 1)
    if not reply.get("ok"):
        fail(f"{path}: {reply.get('error')}", 1)
    return reply


@control.command("realtime")
@node_target
@click.argument("state", type=click.Choice(["on", "off"]))
@click.pass_context
def control_realtime(ctx: click.Context, state: str) -> None:
    """Switch realtime CDC: `on` tries to start it (hand-over from the daemon), `off` stops it."""
    reply = _node_request(ctx, {"cmd": "realtime", "state": state})
    click.echo(f"realtime: {reply['realtime']}")


@control.command("cdc")
@node_target
@click.argument("state", type=click.Choice(["on", "off"]))
@click.pass_context
def control_cdc(ctx: click.Context, state: str) -> None:
    """Switch CDC links (Ignite's cdc.disabled, the brake for a CDC dir filling the disk): `off` stops
    linking archived segments into the CDC dir, `on` resumes; persisted across restarts. The segments
    archived while off are a gap the daemon reports as `missing segment N`."""
    reply = _node_request(ctx, {"cmd": "cdc", "state": state})
    click.echo(f"cdc: {reply['cdc']} (from WAL position {reply['wal_position']})")


@control.command("status")
@node_target
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def control_status(ctx: click.Context, as_json: bool) -> None:
    """Realtime mode, buffer use, committed positions of node and daemon, lag."""
    reply = _node_request(ctx, {"cmd": "status"})
    reply.pop("ok", None)
    if as_json:
        click.echo(msgspec.json.encode(reply).decode())
        return
    rt, daemon = reply["realtime"], reply["daemon"] or {}
    used, cap = rt["buffer_used_bytes"], rt["buffer_max_bytes"]
    rows = [
        ("node", f"{reply['node_dir']} ({reply['node_id']})"),
        ("wal position", reply["wal_position"]),
        ("delivering", reply["delivering"]),
        ("cdc links", f"{reply['cdc']} ({reply['cdc_links_skipped']} segment(s) not linked since open)"),
        ("realtime", rt["mode"] + (f" (try-start at {rt['try_start']})" if rt["try_start"] else "")),
        ("buffer", f"{used:,} / {cap:,} bytes (max used {rt['buffer_max_used_bytes']:,})"),
        ("node committed", rt["committed"] or "-"),
        ("daemon mode", daemon.get("mode", "-")),
        ("daemon committed", daemon.get("position") or "-"),
        ("lag", f"{reply['lag_segments']} segment(s)" if reply["lag_segments"] is not None else "-"),
        ("lag ms", f"{reply['lag_ms']:.1f}" if reply["lag_ms"] is not None else "-"),
        ("realtime stops", ", ".join(f"{k}={v}" for k, v in rt["stops"].items()) or "-"),
        ("consumer", msgspec.json.encode(reply.get("realtime_consumer") or {}).decode()),
        ("cluster id", reply.get("cluster_id", "-")),
    ]
    repl = reply.get("replication")
    if repl:
        tls = "TLS + client certificates" if repl["client_certificates"] else "TLS" if repl["tls"] else "no TLS"
        rows.append(("replication", f"listening on {repl['listen']} ({tls}), {repl['connections']} connection(s)"))
    else:
        rows.append(("replication", "endpoint off"))
    for name, value in rows:
        click.echo(f"{name:<17} {value}")


@control.command("resend")
@node_target
@click.option("--cache", required=True, help="Cache whose current entries are written again as CREATE events.")
@click.pass_context
def control_resend(ctx: click.Context, cache: str) -> None:
    """Write every current entry of a cache into the WAL as CREATE events (seed a consumer, refill lost links)."""
    reply = _node_request(ctx, {"cmd": "resend", "cache": cache})
    click.echo(f"resent {reply['resent']} entries of cache {cache}")


def _confirm(yes: bool) -> None:
    """Ask before changing the daemon's links or state; without a terminal only --yes proceeds."""
    if yes:
        return
    if not sys.stdin.isatty():
        fail("refusing without --yes (not a terminal)", EXIT_BAD_INPUT)
    click.confirm("Proceed?", abort=True)


@control.command("relink-lost-segments")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option(
    "--archive",
    "archive_path",
    type=click.Path(path_type=Path),
    default=None,
    help="The node's archive dir (default <node_dir>/wal/archive).",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def relink_lost(config_path: Path, archive_path: Path | None, yes: bool) -> None:
    """After a gap in the CDC dir: hard-link the missing segments back from the node's archive where it
    still has them (nothing is lost, no resend needed). Run before delete-lost-segment-links."""
    from cdcd.daemon.ops import plan_relink, relink_lost_segments
    from cdcd.lock import LockHeld
    from cdcd.node.archiver import dir_bytes

    config = _load_daemon_config(config_path)
    archive = archive_path or Path(config.node_dir) / "wal" / "archive"
    plan = plan_relink(config, archive)
    if not plan.relink and not plan.gone:
        click.echo("no missing links: nothing to do")
        return
    if plan.relink:
        click.echo(f"will re-link {len(plan.relink)} segment(s) ({plan.relink[0]}..{plan.relink[-1]}) from {archive}")
        _confirm(yes)
        try:
            done = relink_lost_segments(config, archive, plan)
        except LockHeld as exc:
            fail(f"the daemon is running ({exc}); stop it first", EXIT_LOCKED)
        linked_mib = dir_bytes(config.cdc_path) / (1 << 20)
        click.echo(
            f"re-linked {len(done)} segment(s); start the daemon: it delivers them in order. The CDC dir now holds "
            f"{linked_mib:.1f} MiB: a node whose cdc_dir_max_bytes is below that skips links of new segments until "
            "the daemon has worked through them; if the daemon stops at another gap, run this again"
        )
    if plan.gone:
        click.echo(
            f"{len(plan.gone)} segment(s) ({plan.gone[0]}..{plan.gone[-1]}) are gone from the archive too: "
            "run `cdcd control delete-lost-segment-links`, then resend"
        )


@control.command("delete-lost-segment-links")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def delete_lost_links(config_path: Path, yes: bool) -> None:
    """After a gap in the CDC dir: keep the newest contiguous run of links, delete the links before
    the gap and move the daemon's position to the start of that run (then `resend` what was lost)."""
    from cdcd.daemon.ops import delete_lost_segment_links, plan_lost_links, plan_needs_work
    from cdcd.lock import LockHeld

    config = _load_daemon_config(config_path)
    plan = plan_lost_links(config)
    if plan.run_start is None:
        click.echo("no links in the CDC dir: nothing to do")
        return
    if not plan_needs_work(plan):
        click.echo(f"no gap: links {plan.run_start}..{plan.run_end} are contiguous from the position; nothing to do")
        return
    deleting = (
        f"delete {len(plan.to_delete)} link(s) ({plan.to_delete[0]}..{plan.to_delete[-1]})"
        if plan.to_delete
        else ("delete no link")
    )
    click.echo(
        f"gap before segment {plan.run_start} (position {plan.old_position or '-'}): will {deleting} "
        f"and move the position to {plan.run_start}:0#0"
    )
    _confirm(yes)
    try:
        new = delete_lost_segment_links(config, plan)
    except LockHeld as exc:
        fail(f"the daemon is running ({exc}); stop it first", EXIT_LOCKED)
    click.echo(
        f"deleted {len(plan.to_delete)} link(s); position {plan.old_position or '-'} -> {new.position}; "
        "resend lost data with `cdcd control resend`"
    )


# --- lake ---------------------------------------------------------------------------------------
@main.group()
def lake() -> None:
    """The Delta lake: <lake>/changes (every change) and <lake>/state (latest per key)."""


def _spark(master: str, app: str, lake_root: Any = None) -> Any:
    from cdcd.lake import spark as spark_session
    from cdcd.lake.storage import ObjectPath

    configure_logging("console" if sys.stderr.isatty() else "json")
    conf = lake_root.location.spark_conf if isinstance(lake_root, ObjectPath) else {}
    try:
        return spark_session.acquire(master, app, conf)
    except spark_session.DeltaJarsMissing as exc:
        fail(str(exc), EXIT_BAD_INPUT)


_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _lake_root(ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    """``--lake`` (a directory or an object-store URL) with the ``--storage-*`` settings: the lake's root."""
    from cdcd.lake.storage import LakeLocation, LakeStorageError, StorageOptions

    settings: dict[str, Any] = {}
    config = ctx.meta.get("cdcd_storage_config")
    if config is not None:
        import tomllib

        try:
            settings.update(tomllib.loads(Path(config).read_text()).get("consumer", {}).get("storage", {}))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            fail(f"{config}: cannot read [consumer.storage]: {exc}", EXIT_BAD_INPUT)
    settings.update({k: v for k, v in ctx.meta.get("cdcd_storage", {}).items() if v})
    try:
        location = LakeLocation(value, msgspec.convert(settings, StorageOptions))
        if location.is_local:
            if not Path(value.removeprefix("file://")).exists():
                raise click.BadParameter(f"directory {value!r} does not exist")
        else:
            location.check()
    except (LakeStorageError, msgspec.ValidationError) as exc:
        where = f" ({config} [consumer.storage])" if config is not None else ""
        fail(f"--lake {value}{where}: {exc}", EXIT_BAD_INPUT)
    return location.root()


def _storage_meta(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if name == "config":
            ctx.meta["cdcd_storage_config"] = value
        else:
            ctx.meta.setdefault("cdcd_storage", {})[name] = value

    return store


def _lake_option() -> _Decorator:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option(
            "--lake",
            "lake_path",
            required=True,
            callback=_lake_root,
            help="The lake: a directory, or s3://bucket/prefix (also abfss://, gs://).",
        )(f)
        extra = [
            ("--storage-config", "config", "A daemon config file whose [consumer.storage] reaches the store."),
            ("--storage-endpoint", "endpoint", "S3 compatibles: the endpoint URL (else AWS_ENDPOINT_URL)."),
            ("--storage-region", "region", "The store's region (else AWS_REGION)."),
        ]
        for flag, name, text in extra:
            f = click.option(flag, is_eager=True, expose_value=False, callback=_storage_meta(name), help=text)(f)
        return click.option(
            "--storage-path-style",
            is_flag=True,
            is_eager=True,
            expose_value=False,
            callback=_storage_meta("path_style"),
            help="Address buckets as endpoint/bucket (MinIO and most S3 compatibles).",
        )(f)

    return wrap


def _master_option() -> _Decorator:
    return click.option("--spark-master", default="local[*]", show_default=True, help="Spark master URL.")


def _require_changes(lake_path: Path) -> None:
    from cdcd.lake.compact import table_version
    from cdcd.lake.table import CHANGES

    if table_version(lake_path / CHANGES) is None:
        fail(f"{lake_path / CHANGES}: not a Delta table (no _delta_log/): not a cdcd lake", EXIT_BAD_INPUT)


@lake.command("compact")
@_lake_option()
@_master_option()
def lake_compact(lake_path: Path, spark_master: str) -> None:
    """MERGE the changes committed since the last compaction into <lake>/state (one Spark job for all
    caches; latest per key by version, then WAL position; deletes applied; idempotent)."""
    from cdcd.lake import spark as spark_session
    from cdcd.lake.compact import compact

    _require_changes(lake_path)
    spark = _spark(spark_master, "cdcd-lake-compact", lake_path)
    try:
        result = compact(spark, lake_path)
    finally:
        spark_session.release()
    if not result.did_work:
        click.echo(f"nothing new to compact: state reflects changes version {result.to_version}")
    else:
        click.echo(
            f"state version {result.state_version}: changes versions {result.from_version}..{result.to_version}, "
            f"{result.keys:,} keys merged"
        )


@lake.command("optimize")
@_lake_option()
@_master_option()
def lake_optimize(lake_path: Path, spark_master: str) -> None:
    """Bin-pack small files of both tables (Delta OPTIMIZE; no data changes)."""
    from cdcd.lake import spark as spark_session
    from cdcd.lake.ops import optimize

    _require_changes(lake_path)
    spark = _spark(spark_master, "cdcd-lake-optimize", lake_path)
    try:
        done = optimize(spark, lake_path)
    finally:
        spark_session.release()
    for name, m in done.items():
        click.echo(f"{name}: {m['numFilesRemoved']} files -> {m['numFilesAdded']}")


@lake.command("vacuum")
@_lake_option()
@click.option(
    "--retain-hours",
    type=click.FloatRange(min=0),
    default=168.0,
    show_default=True,
    help="Keep files any snapshot of the last N hours needs (time travel and readers in flight).",
)
@_master_option()
def lake_vacuum(lake_path: Path, retain_hours: float, spark_master: str) -> None:
    """Delete data files no longer needed: replaced by OPTIMIZE or compaction longer ago than
    --retain-hours, and orphans of writes that never committed. Refused while older changes wait
    for compaction."""
    from cdcd.lake import spark as spark_session
    from cdcd.lake.ops import VacuumRefused, check_vacuum, vacuum

    _require_changes(lake_path)
    try:
        check_vacuum(lake_path, retain_hours)  # before starting a JVM only to refuse
    except VacuumRefused as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    spark = _spark(spark_master, "cdcd-lake-vacuum", lake_path)
    try:
        left = vacuum(spark, lake_path, retain_hours)
    except VacuumRefused as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    finally:
        spark_session.release()
    for name, files in left.items():
        click.echo(f"{name}: {files} data files after vacuum")


@lake.command("verify")
@_lake_option()
@click.option(
    "--node-dir",
    "node_dirs",
    required=True,
    multiple=True,
    type=click.Path(path_type=Path, exists=True),
    help="A node whose data lands in the lake (stopped); repeat for several.",
)
def lake_verify(lake_path: Path, node_dirs: tuple[Path, ...]) -> None:
    """Compare <lake>/state with the nodes' data (rows and an order-independent checksum per cache).
    The nodes must be stopped; exit 2 when state is behind changes (compact first), 1 on a mismatch."""
    from contextlib import ExitStack

    from cdcd.lake.compact import state_lag
    from cdcd.lake.report import print_verify, verify_summary
    from cdcd.lake.verify import verify
    from cdcd.node.node import NodeLocked
    from cdcd.node.snapshot import NodeSnapshot

    configure_logging("console" if sys.stderr.isatty() else "json", level="warning")
    _require_changes(lake_path)
    end, done, behind = state_lag(lake_path)
    if behind:
        at = "never compacted" if done < 0 else f"at changes version {done}"
        fail(
            f"{lake_path}: state is behind changes ({at}, changes at version {end}): "
            f"compact first (`cdcd lake compact --lake {lake_path}`)",
            EXIT_BAD_INPUT,
        )
    with ExitStack() as stack:
        snapshots = []
        for node_dir in node_dirs:
            try:
                snapshots.append(stack.enter_context(NodeSnapshot(node_dir)))  # read-only
            except NodeLocked as exc:
                fail(f"{exc}: stop the node first", 1)
        checks = verify(lake_path, snapshots)
    print_verify(checks)
    click.echo(verify_summary(checks))
    # Once in a CI run the interpreter's shutdown aborted (SIGABRT, "terminate called without an
    # active exception") after this result was printed: Arrow's and delta-rs' native thread pools
    # can be torn down while a worker is still joinable (apache/arrow#34314, delta-io/delta-rs#2184).
    # The result and its exit code are what matter, so leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if all(c.ok for c in checks) else 1)


@lake.command("show")
@_lake_option()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lake_show(lake_path: Path, as_json: bool) -> None:
    """From the Delta logs: table versions, last commit, application transactions (per source, and
    compaction's), rows per cache in changes and state, whether state is behind."""
    from cdcd.lake.compact import NotADeltaLake
    from cdcd.lake.ops import show
    from cdcd.lake.report import print_show

    try:
        info = show(lake_path)
    except NotADeltaLake as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if as_json:
        click.echo(msgspec.json.encode(info).decode())
    else:
        print_show(info)


@lake.command("history")
@_lake_option()
@click.option(
    "--table", type=click.Choice(["changes", "state"]), default="changes", show_default=True, help="Which Delta table."
)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N commits.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lake_history(lake_path: Path, table: str, limit: int, as_json: bool) -> None:
    """A table's commits, newest first (Delta's history): version, time, operation, rows, writer."""
    from cdcd.lake.compact import NotADeltaLake
    from cdcd.lake.ops import history
    from cdcd.lake.report import print_history

    try:
        rows = history(lake_path, table, limit)
    except NotADeltaLake as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
    else:
        print_history(table, rows)


@lake.command("migrate")
@click.option(
    "--lake", "lake_path", required=True, type=click.Path(path_type=Path, exists=True), help="The lake directory."
)
def lake_migrate(lake_path: Path) -> None:
    """Convert a lake in the pre-Delta format (_cdcd_log/) once: its rows into the Delta table
    <lake>/changes, each source's position carried over. Stop the daemons writing it first."""
    from cdcd.lake.delta import LakeWriteError
    from cdcd.lake.migrate import MigrateError, migrate

    configure_logging("console" if sys.stderr.isatty() else "json", level="warning")
    try:
        done = migrate(lake_path)
    except (MigrateError, LakeWriteError, OSError) as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    sources = ", ".join(f"{s} at {p}" for s, p in sorted(done.sources.items())) or "none"
    click.echo(
        f"migrated {done.rows:,} rows of {done.batches} batches into {lake_path / 'changes'} (sources: {sources}); "
        f"the old files are in {lake_path}/_pre_delta_*: delete them once satisfied; run `cdcd lake compact`"
    )


@main.command("demo")
@click.option("--seconds", type=float, default=0, help="Run this long, then verify (0: until Ctrl-C).")
@click.option("--rate", type=int, default=2000, show_default=True, help="Sample load, entries/s.")
@click.option(
    "--var", type=click.Path(path_type=Path), default=Path("var"), show_default=True, help="Where <var>/demo goes."
)
@click.option("--spark-master", default="local[2]", show_default=True, help="Spark master URL for the lake sink.")
def demo(seconds: float, rate: int, var: Path, spark_master: str) -> None:
    """A node with a sample load, the daemon, the Spark lake sink into <var>/demo/lake; on stop (or
    after --seconds) catch up, compact, `lake show` and `lake verify`. Exit 1 if verification fails."""
    import threading

    from cdcd.demo import run_demo

    configure_logging("console" if sys.stderr.isatty() else "json", level="warning")
    stop = threading.Event()
    on_stop_signals(lambda _signal: stop.set())
    ok = run_demo(var=var, seconds=seconds, rate=rate, spark_master=spark_master, fresh=True, stop=stop)
    sys.exit(0 if ok else 1)


# --- kafka-to-node ----------------------------------------------------------------------------------
@main.command("kafka-to-node")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="kafka-to-node TOML.")
@click.option("--partitions", default=None, metavar="FROM-TO", help="Kafka partitions to read (overrides the config).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Reader threads (overrides the config).")
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY.")
def kafka_to_node(config_path: Path, partitions: str | None, threads: int | None, log_format: str | None) -> None:
    """Apply a cdcd Kafka topic to a node through its replication endpoint (kafka-to-ignite's twin).

    Offsets are committed after the target confirmed; a restart re-applies at most the last
    batches, which the target's resolver counts as duplicates. Exit codes: 0 stopped (SIGTERM),
    1 Kafka or the target failing past max_retry_s, 2 bad config (or metrics port in use).
    """
    from cdcd.config import read_toml
    from cdcd.kafka.options import KafkaToNodeOptions
    from cdcd.kafka.to_node import KafkaToNode, KafkaToNodeError

    configure_logging(log_format or ("console" if sys.stderr.isatty() else "json"))  # type: ignore[arg-type]
    try:
        table = read_toml(config_path)
        if partitions is not None:
            table["partitions"] = partitions
        if threads is not None:
            table["threads"] = threads
        opts = KafkaToNodeOptions.load(table, str(config_path))
        app = KafkaToNode(opts, str(config_path))
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)

    def on_signal(signum: int, _frame: object) -> None:
        if app.stopping.is_set():
            os._exit(128 + signum)  # second signal: leave at once
        app.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if opts.metrics_address:
        from prometheus_client import start_http_server

        from cdcd import metrics

        metrics.export(metrics.KAFKA_TO_NODE)
        metrics.export(metrics.REPLICATION_SENDER)
        host, port = split_host_port(opts.metrics_address, min_port=0)
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            address = opts.metrics_address
            fail(f"{config_path}: key 'metrics_address': cannot listen on {address}: {exc}", EXIT_BAD_INPUT)
    try:
        app.run()
    except (KafkaToNodeError, ConfigError) as exc:
        fail(str(exc), 1)


if __name__ == "__main__":
    main()
