"""The ``cdcd`` command line: one module per command group (``cdcd/cli/<group>.py``); exit codes
are per fault (``cdcd.faults.ExitCode``), mapped in one place (``cdcd.cli.exits``)."""

from __future__ import annotations

import click

from cdcd import __version__
from cdcd.cli.control import control
from cdcd.cli.daemon import daemon_run, state
from cdcd.cli.demo import demo
from cdcd.cli.kafka import kafka_to_node
from cdcd.cli.lake import lake
from cdcd.cli.node import node
from cdcd.cli.process import on_stop_signals
from cdcd.cli.top import top
from cdcd.cli.wal import wal


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cdcd")
def main() -> None:
    """cdcd: change-data-capture for the cdcd storage node."""


for _command in (wal, node, daemon_run, state, control, lake, demo, kafka_to_node, top):
    main.add_command(_command)

__all__ = ["main", "on_stop_signals"]
