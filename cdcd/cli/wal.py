"""``cdcd wal``: inspect WAL segments."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import msgspec

from cdcd.cli.exits import fail, fail_on
from cdcd.faults import ExitCode
from cdcd.wal.pointer import WalPointer


@click.group()
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
    Exit 2 on a --from that is no record start, 3 on a missing segment, 5 on a bad record (after the
    good ones).
    """
    from cdcd.wal.dump import open_records, record_to_dict

    try:
        pointer = WalPointer.parse(start) if start else None
    except ValueError as exc:
        fail(str(exc), ExitCode.BAD_INPUT)
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        for ptr, record in open_records(path, pointer, active=active):
            out.write(encoder.encode(record_to_dict(ptr, record)))
            out.write(b"\n")
        out.flush()
    except BrokenPipeError:
        os._exit(0)  # `cdcd wal dump | head`
    except Exception as exc:
        out.flush()  # the good records before the bad spot are printed
        fail_on(exc)
