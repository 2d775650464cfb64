"""The ``cdcd`` command line: one module per command group (``cdcd/cli/<group>.py``); exit codes
are per fault (``cdcd.faults.ExitCode``), mapped in one place (``cdcd.cli.exits``)."""

from __future__ import annotations

import click

from cdcd.cli.control import control
from cdcd.cli.daemon import daemon_run, state
from cdcd.cli.demo import demo
from cdcd.cli.kafka import kafka_to_node
from cdcd.cli.lake import lake
from cdcd.cli.node import node
from cdcd.cli.process import on_stop_signals
from cdcd.cli.top import top
from cdcd.cli.wal import wal


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from cdcd.version import version_and_commit

    click.echo(f"cdcd {version_and_commit()}")
    ctx.exit()


def _warn(line: str) -> None:
    click.echo(f"cdcd: warning: {line}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="The version, and the git commit when run from a checkout; then exit.",
)
@click.option(
    "--strict-config",
    is_flag=True,
    envvar="CDCD_STRICT_CONFIG",
    help="Refuse a deprecated config spelling (exit 2) instead of reading it with a warning "
    "(for CI; env CDCD_STRICT_CONFIG=1).",
)
def main(strict_config: bool) -> None:
    """cdcd: change-data-capture for the cdcd storage node."""
    from cdcd.config import set_deprecation_policy

    # A deprecated spelling is one line on stderr at once; its log line waits for the command's log set-up.
    set_deprecation_policy(strict=strict_config, echo=_warn, log_later=True)


for _command in (wal, node, daemon_run, state, control, lake, demo, kafka_to_node, top):
    main.add_command(_command)

__all__ = ["main", "on_stop_signals"]
