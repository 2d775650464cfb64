"""The ``cdcd`` command line."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import click
import msgspec

from cdcd import __version__
from cdcd.config import ConfigError
from cdcd.logging import configure as configure_logging
from cdcd.wal.errors import MissingSegment, WalError
from cdcd.wal.pointer import WalPointer

EXIT_BAD_INPUT = 2
EXIT_MISSING_SEGMENT = 3


def fail(message: str, code: int) -> None:
    click.echo(f"cdcd: error: {message}", err=True)
    sys.exit(code)


@click.group()
@click.version_option(__version__, prog_name="cdcd")
def main() -> None:
    """cdcd: change-data-capture for the cdcd storage node."""


# --- wal ------------------------------------------------------------------------------------------
@main.group()
def wal() -> None:
    """Inspect WAL segments."""


@wal.command("dump")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--from", "start", metavar="SEG:OFF", help="Start at this pointer (e.g. 42:1048576).")
@click.option("--active", is_flag=True, help="PATH is an active segment: a short tail is the end, not an error.")
def wal_dump(path: Path, start: str | None, active: bool) -> None:
    """Print the records of a segment file or a directory of segments as JSON lines.

    A node's work dir (one holding archive/) is read with its archive, its newest segment as active.
    """
    from cdcd.wal.dump import record_to_dict
    from cdcd.wal.reader import SegmentReader, WalReader
    from cdcd.wal.segment import list_segments

    try:
        pointer = WalPointer.parse(start) if start else None
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        records: object
        if path.is_dir():
            dirs = [path]
            active_segment = None
            if (path / "archive").is_dir():
                dirs = [path / "archive", path]
                work, _ = list_segments(path)
                active_segment = max(work) if work else None
            records = WalReader(dirs, pointer, active_segment=active_segment)
        else:
            offset = pointer.offset if pointer else 0
            records = SegmentReader(path, start_offset=offset, archived=not active)
        for ptr, record in records:  # type: ignore[attr-defined]
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


# --- node -----------------------------------------------------------------------------------------
@main.group()
def node() -> None:
    """Run the storage node as a process."""


@node.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="Node TOML config.")
@click.option("--load-rate", type=int, default=0, show_default=True, help="Built-in load: entries per second.")
@click.option("--seconds", type=float, default=0, help="Stop after this long (0: until SIGTERM/SIGINT).")
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY.")
def node_run(config_path: Path, load_rate: int, seconds: float, log_format: str | None) -> None:
    """Open a node and keep it running (with an optional load generator) until stopped."""
    from cdcd.config import load_toml
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
    except WalError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:
        fail(str(exc), 1)
    stop = threading.Event()
    signals = {"n": 0}

    def on_signal(signum: int, _frame: object) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            os._exit(130)  # second signal: leave at once
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    load = LoadGenerator(the_node, load_rate) if load_rate > 0 else None
    if load:
        load.start()
    started = time.monotonic()
    interactive = sys.stdout.isatty()
    try:
        while not stop.wait(1.0 if interactive else 0.2):
            if seconds and time.monotonic() - started >= seconds:
                break
            if interactive and load:
                click.echo(
                    f"\rwritten {load.written:>10,} entries   WAL at {the_node.wal_position}   "
                    f"archived up to segment {the_node.wal.last_archived}",
                    nl=False,
                )
    finally:
        if load:
            load.stop()
        the_node.close()
    if interactive:
        click.echo()


if __name__ == "__main__":
    main()
