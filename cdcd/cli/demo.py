"""``cdcd demo``: the whole pipeline on this machine (``make run``)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import click

from cdcd.cli.process import log_to_stderr, on_stop_signals


@click.command("demo")
@click.option("--seconds", type=float, default=0, help="Run this long, then verify (0: until Ctrl-C).")
@click.option("--rate", type=int, default=2000, show_default=True, help="Sample load, entries/s.")
@click.option(
    "--var", type=click.Path(path_type=Path), default=Path("var"), show_default=True, help="Where <var>/demo goes."
)
@click.option("--spark-master", default="local[2]", show_default=True, help="Spark master URL for the lake sink.")
def demo(seconds: float, rate: int, var: Path, spark_master: str) -> None:
    """A node with a sample load, the daemon, the Spark lake sink into <var>/demo/lake; on stop (or
    after --seconds) catch up, compact, `lake show` and `lake verify`. Exit 1 if verification fails."""
    from cdcd.demo import run_demo

    log_to_stderr(level="warning")
    stop = threading.Event()
    on_stop_signals(lambda _signal: stop.set())
    ok = run_demo(var=var, seconds=seconds, rate=rate, spark_master=spark_master, fresh=True, stop=stop)
    sys.exit(0 if ok else 1)
