"""Every format cdcd keeps on disk or in a broker besides the WAL (whose segment header carries its
own, docs/wal-format.md), the version this code writes, and the one check all of them go through.

A file or record written by v0.1.0 carries no version: absent is version 1. A version above the one
this code knows is refused with one line naming where it was found, both versions and what to do
(``FormatTooNew``, exit 10): an older cdcd must not guess at what a newer one wrote, and writing
over it would lose what it does not understand. A version at or below the current one is read; a
format whose layout changes gets a migration in its own module, crash-safe (one LMDB transaction,
or a new file renamed over the old), and its number goes up here. Within a version, msgspec
structs only ever gain fields appended with defaults, so a reader ignores fields it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdcd.faults import ExitCode, Fault

__all__ = [
    "COMPACT_MARK",
    "DAEMON_STATE",
    "FORMATS",
    "KAFKA_OFFSETS",
    "LAKE_CACHES",
    "LAKE_CUTS",
    "METASTORAGE",
    "REPLICATION_DROPS",
    "Format",
    "FormatTooNew",
    "check",
    "parse_version",
]

UPGRADE_HINT = "upgrade cdcd to the release that wrote it, or a newer one (docs/operations.md: Upgrading)"


@dataclass(frozen=True)
class Format:
    name: str
    current: int
    """The version this code writes and the newest it reads."""
    where: str
    """Where the version is kept (for the docs' table and the error line)."""


DAEMON_STATE = Format("daemon state", 1, "LMDB `<state_dir>/data.mdb`, key `format` of the `state` database")
METASTORAGE = Format("node metastorage", 1, "LMDB `<node_dir>/metastorage/data.mdb`, key `format`")
LAKE_CACHES = Format("lake cache registry", 1, '`<lake>/_cdcd_caches.json`, top-level key `"format"`')
LAKE_CUTS = Format("lake cuts table", 1, "`<lake>/_cuts`, metadata `cdcd.format` of its column `changes_version`")
COMPACT_MARK = Format("lake compaction mark", 1, '`<lake>/state` commits\' `userMetadata`, key `"cdcd_format"`')
KAFKA_OFFSETS = Format("Kafka offset record", 1, 'each record of the offsets topic, JSON key `"format"`')
REPLICATION_DROPS = Format(
    "replication drop marks", 2, '`<node_dir>/replication_drops.json`: `{"format": 2, "marks": …}` (1: the bare marks)'
)

FORMATS = (DAEMON_STATE, METASTORAGE, LAKE_CACHES, LAKE_CUTS, COMPACT_MARK, KAFKA_OFFSETS, REPLICATION_DROPS)
"""Every versioned format (docs/design.md lists them in a table)."""


def _cdcd_version() -> str:
    from cdcd.version import version

    return version()


class FormatTooNew(Fault, Exception):
    """A file or record of a newer format than this cdcd knows: refused before anything is read or written."""

    exit_code = ExitCode.FORMAT_TOO_NEW
    hint = UPGRADE_HINT

    def __init__(self, where: str, fmt: Format, found: int) -> None:
        super().__init__(
            f"{where}: {fmt.name} format version {found}, newer than the version {fmt.current} "
            f"cdcd {_cdcd_version()} reads"
        )
        self.where = where
        self.format = fmt
        self.found = found


def parse_version(raw: object) -> int:
    """A stored version marker as an int; ValueError (naming the value) for anything but a positive
    integer, which the caller reports as damage of its file."""
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"format version {raw!r} is not a positive integer")
    return raw


def check(fmt: Format, found: int | None, where: str) -> int:
    """The version of what was found at ``where`` (None: no marker, as v0.1.0 wrote it: 1); raises
    ``FormatTooNew`` when it is newer than ``fmt.current``."""
    version = 1 if found is None else found
    if version > fmt.current:
        raise FormatTooNew(where, fmt, version)
    return version
