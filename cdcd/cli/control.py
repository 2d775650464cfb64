"""``cdcd control``: operator commands. realtime, cdc, status and resend talk to a running node
over its control socket; relink-lost-segments and delete-lost-segment-links work on a stopped
daemon's CDC dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec

from cdcd.cli.daemon import confirm, load_config
from cdcd.cli.exits import fail, fail_on
from cdcd.faults import ExitCode


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


class _Control(click.Group):
    """``cdcd control cdc realtime on|off`` is IEP-104's spelling (``control.sh --cdc realtime``) of
    ``cdcd control realtime on|off``: the same command."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if len(args) >= 2 and args[0] == "cdc" and args[1] == "realtime":
            args = args[1:]
        return super().resolve_command(ctx, args)


@click.group(cls=_Control)
@click.option(
    "--node-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The node to talk to (its control socket is <node-dir>/control.sock).",
)
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None, help="Control socket path.")
@click.pass_context
def control(ctx: click.Context, node_dir: Path | None, socket_path: Path | None) -> None:
    """Operator commands (realtime, cdc, status, resend talk to a running node)."""
    ctx.obj = socket_path or (node_dir / "control.sock" if node_dir else None)


def _node_request(ctx: click.Context, message: dict[str, Any]) -> dict[str, Any]:
    from cdcd.control import request

    node_dir = ctx.meta.get("cdcd.node_dir")
    path = ctx.meta.get("cdcd.socket_path") or (node_dir / "control.sock" if node_dir else ctx.obj)
    if path is None:
        fail("give --node-dir DIR (or --socket PATH)", ExitCode.BAD_INPUT)
    try:
        reply = request(path, message)
    except FileNotFoundError:
        fail(f"{path}: no control socket (is the node running?)", ExitCode.FAILED)
    except OSError as exc:
        fail(f"{path}: {exc}", ExitCode.FAILED)
    if not reply.get("ok"):
        fail(f"{path}: {reply.get('error')}", ExitCode.FAILED)
    return reply


@control.command("realtime")
@node_target
@click.argument("state", type=click.Choice(["on", "off"]))
@click.pass_context
def control_realtime(ctx: click.Context, state: str) -> None:
    """Switch realtime CDC for the consumer the node's `[realtime_consumer]` names: `on` tries to start it
    (hand-over from the daemon), `off` stops it; every other consumer stays with the daemon.
    `cdcd control cdc realtime on|off` is the same command."""
    reply = _node_request(ctx, {"cmd": "realtime", "state": state})
    click.echo(f"realtime: {reply['realtime']}")
    consumer = reply.get("consumer")
    if isinstance(consumer, str):  # a node of an older release does not say
        # On stderr: scripts read stdout's one line, as before consumers had names.
        if state == "on":
            line = f"consumer {consumer}: to the node's realtime worker; every other consumer stays with the daemon"
        else:
            line = f"consumer {consumer}: handed back to the daemon (from the archive), as every other consumer"
        click.echo(line, err=True)


@control.command("cdc")
@node_target
@click.argument("state", type=click.Choice(["on", "off"]))
@click.pass_context
def control_cdc(ctx: click.Context, state: str) -> None:
    """Switch CDC links (Ignite's cdc.disabled, the brake for a CDC dir filling the disk): `off` stops
    linking archived segments into the CDC dir, `on` resumes; persisted across restarts. The segments
    archived while off are a gap the daemon reports as `missing segment N`. As Ignite's, `off` stops
    realtime capture too (the daemon delivers up to the switch) and `realtime on` is refused until
    `cdc on`; `cdc on` does not restart it. (`cdc realtime on|off` is `cdcd control realtime on|off`.)"""
    reply = _node_request(ctx, {"cmd": "cdc", "state": state})
    line = f"cdc: {reply['cdc']} (from WAL position {reply['wal_position']})"
    if reply.get("realtime_stopped"):
        line += (
            "; realtime capture stopped too: the daemon delivers up to here "
            "(`cdcd control realtime on` again after `cdc on`)"
        )
    click.echo(line)


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
    for name, one in (reply.get("consumers") or {}).items():
        by = "realtime worker" if one["delivered_by"] == "realtime" else "daemon, from the archive"
        lag = f", lag {one['lag_segments']} segment(s)" if one["lag_segments"] is not None else ""
        rows.append((f"consumer {name}", f"{by}, at {one['position'] or '-'}{lag}"))
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

    config = load_config(config_path)
    archive = archive_path or Path(config.node_dir) / "wal" / "archive"
    plan = plan_relink(config, archive)
    if not plan.relink and not plan.gone:
        click.echo("no missing links: nothing to do")
        return
    if plan.relink:
        click.echo(f"will re-link {len(plan.relink)} segment(s) ({plan.relink[0]}..{plan.relink[-1]}) from {archive}")
        confirm(yes)
        try:
            done = relink_lost_segments(config, archive, plan)
        except LockHeld as exc:
            fail_on(exc, "the daemon is running", hint="stop it first")
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

    config = load_config(config_path)
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
    confirm(yes)
    try:
        new = delete_lost_segment_links(config, plan)
    except LockHeld as exc:
        fail_on(exc, "the daemon is running", hint="stop it first")
    click.echo(
        f"deleted {len(plan.to_delete)} link(s); position {plan.old_position or '-'} -> {new.position}; "
        "resend lost data with `cdcd control resend`"
    )
