"""A name or value on one line of a printed table (``lake show``, ``lake cut``, ``lake sql``)."""

from __future__ import annotations

import json

__all__ = ["printable"]


def printable(name: str) -> str:
    """A cache name on one table line: control characters (a newline, a tab) and backslashes escaped
    as in JSON, everything else as it is; ``a\\nb`` stays one row and reads back unambiguously."""
    if name.isprintable() and "\\" not in name:
        return name
    return "".join(c if c.isprintable() and c != "\\" else json.dumps(c)[1:-1] for c in name)
