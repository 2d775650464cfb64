"""The exit codes of every ``cdcd`` command, and the mix-in by which an exception carries its code
and a hint for the operator (the command line maps exceptions to both in one place,
``cdcd.cli.exits``). Codes are per fault, not per command: a corrupt WAL segment is 5 from
``cdcd wal dump`` and from ``cdcd run`` alike."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    """Another process holds the lock, an OS error, a peer failing: restarting may help."""
    BAD_INPUT = 2
    """Bad config, option or argument (a metrics port in use too): fix what the line names."""
    MISSING_SEGMENT = 3
    """A gap in the CDC dir: ``cdcd control relink-lost-segments``."""
    CONSUMER_FAILED = 4
    """The consumer raised or reported itself dead."""
    BAD_WAL = 5
    """A corrupt, truncated or foreign WAL segment: the line names file and offset."""
    STALLED = 6
    """A consumer call or segment read ran past ``consumer_stall_timeout_ms``."""
    BAD_STATE = 7
    """The daemon's state is damaged or belongs to another node: ``cdcd state reset``."""
    DAMAGED_LAKE = 8
    """A Delta log or a file it names is damaged or missing: ``cdcd lake check`` lists every fault."""
    TARGET_BEHIND = 9
    """The consumer's target lost delivered records (a lake restored from a backup) and the WAL no
    longer has them: the line names both positions and the way on."""
    FORMAT_TOO_NEW = 10
    """A state, metadata file or offset record of a newer format than this cdcd knows (``cdcd.formats``):
    the line names it and both versions; upgrade cdcd (a downgrade cannot read it)."""


class Fault:
    """Mix-in of an exception class: the exit code a command ends with when it raises this, and what
    the operator does about it (Litestream's ``LTXError.Hint``). The message stays the exception's
    own (``path at offset N: what``); the hint is separate so the message can be logged alone."""

    exit_code: ExitCode = ExitCode.FAILED
    hint: str = ""
