"""``cdcd top``: a live, read-only view of a node and its daemon (cdcd/top/)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("top")
@click.option("--node-dir", type=click.Path(path_type=Path), default=None, help="The node dir to watch.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Daemon TOML config (its state dir and metrics_address); default: the state in <node-dir>.",
)
@click.option("--node-metrics", default="", help="host:port of the node's metrics endpoint (its metrics_address).")
@click.option("--interval-ms", type=int, default=1000, show_default=True, help="Refresh every this many ms.")
@click.option("--once", is_flag=True, help="Print one snapshot (two reads an interval apart, for the rates) and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the snapshot as one JSON object.")
def top(
    *, node_dir: Path | None, config_path: Path | None, node_metrics: str, interval_ms: int, once: bool, as_json: bool
) -> None:
    """A live view of a node and its daemon (read-only). q or Ctrl-C quits."""
    from cdcd.top import top_command

    sys.exit(top_command(node_dir, config_path, interval_ms, once, as_json, node_metrics=node_metrics))
