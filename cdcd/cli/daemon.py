"""``cdcd run`` and ``cdcd state``: the CDC daemon and its state."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
import msgspec
import structlog

from cdcd.cli.exits import fail, fail_on, line_for
from cdcd.cli.process import log_to_stderr, on_stop_signals, serve_metrics, stop_timeout_option
from cdcd.faults import ExitCode

if TYPE_CHECKING:
    from cdcd.daemon.config import DaemonConfig

_LOG_EVENTS = {
    ExitCode.MISSING_SEGMENT: "missing_segment",
    ExitCode.CONSUMER_FAILED: "consumer_failed",
    ExitCode.BAD_WAL: "bad_segment",
    ExitCode.STALLED: "pipeline_stalled",
    ExitCode.BAD_STATE: "bad_state",
}
"""The event of the daemon's last log line, by exit code (others: ``daemon_failed``)."""


_IGNORED_ENV: list[str] = []
"""``CDCD_*`` names that are no config key, warned about once logging is set up."""


def load_config(path: Path) -> DaemonConfig:
    from cdcd.daemon.config import load_daemon_config

    try:
        return load_daemon_config(path, ignored=_IGNORED_ENV)
    except Exception as exc:
        fail_on(exc)


def confirm(yes: bool) -> None:
    """Ask before changing the daemon's links or state; without a terminal only --yes proceeds."""
    if yes:
        return
    if not sys.stdin.isatty():
        fail("refusing without --yes (not a terminal)", ExitCode.BAD_INPUT)
    click.confirm("Proceed?", abort=True)


@click.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option(
    "--log-format",
    type=click.Choice(["json", "console"]),
    default=None,
    help="Overrides the config's log_format. Default: console on a terminal, else JSON lines.",
)
@stop_timeout_option
def daemon_run(config_path: Path, log_format: str | None, stop_timeout: float) -> None:
    """Run the CDC daemon: follow the node's CDC dir and deliver to the consumer until SIGTERM/SIGINT.

    A node_dir (or CDC dir) that does not exist yet is waited for (`waiting_for_node`).
    Exit codes: 0 stopped cleanly, 1 another daemon holds the node (or an OS error), 2 bad config,
    3 missing segment, 4 consumer failed, 5 corrupt, truncated or foreign segment, 6 pipeline
    stalled (a consumer call ran past consumer_stall_timeout_ms), 7 damaged daemon state or a state
    of another node (see `cdcd state reset`), 141 the reader of its log went away (a closed pipe:
    it stopped as on SIGTERM). It exits within --stop-timeout of SIGTERM/SIGINT or a failure,
    stopped cleanly or not (then 128 + the signal's number, or the failure's code).
    """
    import asyncio

    from cdcd.daemon.daemon import Daemon, PipelineStalled, fix_mmap_threshold
    from cdcd.daemon.node_wait import wait_for_node
    from cdcd.daemon.sdnotify import Notifier
    from cdcd.lock import LockHeld
    from cdcd.sinks import load_consumer

    config = load_config(config_path)
    log_to_stderr(log_format or config.log_format)
    log = structlog.get_logger("cdcd.daemon")
    for name in _IGNORED_ENV:
        log.warning("environment_variable_ignored", name=name, reason="not a cdcd config key")
    fix_mmap_threshold()
    consumers = {}
    try:
        for name, table in config.named_consumers().items():
            consumers[name] = load_consumer(table, f"{config_path}: {config.consumer_key(name)}").consumer
    except Exception as exc:
        fail_on(exc)
    only = consumers.get("default") if len(consumers) == 1 else None
    daemon = Daemon(config, only or consumers, show_progress=sys.stdout.isatty())

    def fatal(exc: BaseException, context: str = "", event: str | None = None) -> NoReturn:
        code, line = line_for(exc, context)
        log.error(event or _LOG_EVENTS.get(ExitCode(code), "daemon_failed"), error=line)
        stops.start_clock(f"a failure ({line})", code)
        daemon.close()  # its log lines first: the error stays the last line on stderr
        fail(line, code)

    stopped = threading.Event()

    def on_stop(signum: signal.Signals) -> None:
        log.info("daemon_stopping", signal=signum.name)
        stopped.set()  # ends a wait for the node
        daemon.stop()  # thread- and signal-safe; also before run() starts (run() then returns at once)

    # Installed before anything else, so a SIGTERM during start-up is a clean stop, not a kill.
    stops = on_stop_signals(
        on_stop,
        bound_s=stop_timeout,
        what=f"the daemon of {config_path}",
        hint="the next start resumes from its last commit",
        when_log_reader_gone=True,
    )

    async def main_async() -> None:
        try:
            await daemon.run()
        except PipelineStalled as exc:
            # The stuck call holds a worker thread that asyncio.run would wait for: leave now.
            code, line = line_for(exc)
            log.error(_LOG_EVENTS[ExitCode.STALLED], error=line)
            click.echo(f"cdcd: error: {line}", err=True)
            sys.stderr.flush()
            os._exit(code)

    try:
        # A node not there yet is waited for (a library caller of Daemon.start() gets FileNotFoundError),
        # with the metrics served meanwhile; otherwise they are served as soon as the daemon holds its lock,
        # so that a start waiting out a target's outage shows its retries.
        served: list[bool] = []

        def serve() -> None:
            serve_metrics(config.metrics_address, config_path)
            served.append(True)

        if wait_for_node(Path(config.node_dir), daemon.cdc_dir, Notifier(), stopped, serve=serve):
            daemon.start(locked=None if served else serve)
            asyncio.run(main_async())
    except LockHeld as exc:
        fatal(exc, "another cdcd daemon runs for this node", "daemon_locked")
    except Exception as exc:  # one line, non-zero; the code says whether systemd restarts us
        fatal(exc)
    finally:
        daemon.close()
    if stops.exit_code:
        sys.exit(stops.exit_code)


@click.group()
def state() -> None:
    """Inspect the daemon's state."""


@state.command("show")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def state_show(config_path: Path, as_json: bool) -> None:
    """Print the daemon's committed position, mode, caches and the CDC dir's links."""
    from cdcd.daemon.ops import show_state

    try:
        info = show_state(load_config(config_path))
    except Exception as exc:
        fail_on(exc)
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
    if len(info["consumers"]) > 1 or "default" not in info["consumers"]:
        for name, one in info["consumers"].items():
            stopped = one["stopped"]
            how = f"STOPPED (exit {stopped['exit_code']}): {stopped['error']}" if stopped else "delivering"
            realtime = ", realtime hand-over" if one["realtime"] else ""
            click.echo(f"consumer {name}: {one['mode']} at {one['position'] or '-'}{realtime}; {how}")
    else:
        stopped = info["stopped"]
        if stopped:
            click.echo(f"{'stopped':<12} exit {stopped['exit_code']}: {stopped['error']}")


@state.command("consumers")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def state_consumers(config_path: Path, as_json: bool) -> None:
    """List the daemon's consumers: each one's target, position, mode and the link bytes it holds, and the
    states of consumers no longer in the config (`state drop-consumer` forgets them)."""
    from cdcd.daemon.ops import list_consumers

    try:
        found = list_consumers(load_config(config_path))
    except Exception as exc:
        fail_on(exc)
    if as_json:
        click.echo(msgspec.json.encode(found).decode())
        return
    for c in found:
        stopped = c["stopped"]
        how = (
            "invalidated"
            if c["invalidated"]
            else f"stopped (exit {stopped['exit_code']})"
            if stopped
            else "in config"
            if c["in_config"]
            else "not in config"
        )
        realtime = " realtime" if c["realtime"] else ""
        click.echo(
            f"{c['name']:<16} {c['mode']:<8} {c['position'] or '-':<24} holds {c['holds_bytes']} B  "
            f"{how}{realtime}  {c['identity'] or '-'}"
        )


@state.command("drop-consumer")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def state_drop_consumer(config_path: Path, name: str, yes: bool) -> None:
    """With the daemon stopped: forget the state of consumer NAME, removed from the config, and delete the links
    no other consumer needs."""
    from cdcd.daemon.ops import drop_consumer
    from cdcd.lock import LockHeld

    log_to_stderr()
    config = load_config(config_path)
    click.echo(f"drop      consumer {name}: {config.consumer_state_path(name)}")
    confirm(yes)
    try:
        path, deleted = drop_consumer(config, name)
    except LockHeld as exc:
        fail_on(exc, "the daemon is running", hint="stop it first")
    except Exception as exc:
        fail_on(exc)
    click.echo(f"dropped   {path}; {len(deleted)} link(s) no consumer needs deleted")


@state.command("reset")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Daemon TOML config.")
@click.option(
    "--to",
    "to",
    metavar="SEG:OFF[#IDX]",
    default=None,
    help="Deliver from this position (a record start in a linked segment); default: the oldest link.",
)
@click.option(
    "--consumer",
    "consumer_name",
    default=None,
    help="The consumer whose state is reset, of a daemon of several ([consumers.NAME]); default: default.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def state_reset(config_path: Path, to: str | None, consumer_name: str | None, yes: bool) -> None:
    """Replace the daemon's state (damaged, of another node, or at a wrong position) with one at the
    oldest link or at --to. The daemon must be stopped. A damaged state file is moved aside, not deleted;
    the mode is what the node says (its realtime worker delivers: PASSIVE), the cache registry is kept
    or read from the node."""
    from cdcd.daemon.ops import plan_reset, reset_state
    from cdcd.lock import LockHeld
    from cdcd.wal.pointer import WalPosition

    log_to_stderr()
    config = load_config(config_path)
    names = config.named_consumers()
    if consumer_name is None and len(names) > 1:
        fail(
            f"{config_path} has consumers {', '.join(names)}: name the one to reset with --consumer", ExitCode.BAD_INPUT
        )
    try:
        config = config.for_consumer(consumer_name or next(iter(names)))
    except Exception as exc:
        fail_on(exc)
    try:
        position = WalPosition.parse(to) if to else None
    except ValueError as exc:
        fail(str(exc), ExitCode.BAD_INPUT)
    if not Path(config.node_dir).is_dir():
        fail(f"{config_path}: key 'node_dir': {config.node_dir} does not exist", ExitCode.BAD_INPUT)
    try:
        plan = plan_reset(config, position)
    except Exception as exc:
        fail_on(exc)
    old = plan.old
    was = "damaged" if plan.damaged else (f"{old.mode.value} at {old.position or '-'}" if old else "none")
    new = plan.new
    click.echo(f"state     {config.state_path} (now: {was})")
    click.echo(f"reset to  {new.mode.value} at {new.position or 'the oldest link'} (mode from {plan.mode_from})")
    click.echo(f"caches    {len(plan.caches)} from {plan.caches_from}")
    if old is not None and old.position is not None and new.position is not None and new.position > old.position:
        click.echo(f"warning   entries from {old.position} to {new.position} will not be delivered")
    confirm(yes)
    try:
        new_state, moved = reset_state(config, plan)
    except LockHeld as exc:
        fail_on(exc, "the daemon is running", hint="stop it first")
    if moved is not None:
        click.echo(f"moved the damaged state to {moved}")
    click.echo(f"state reset: {new_state.mode.value} at {new_state.position or 'the oldest link'}; start the daemon")
