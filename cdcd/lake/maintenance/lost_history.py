"""The rows of a source's history that a node restored from a backup lost.

A restored node reuses WAL positions: the lake lands what it writes from there as the next
generation of its source, and records where each generation starts (the ``cdcd:<node>:g<n>:first``
application transaction, cdcd/lake/landing/delta.py). A row of generation g at a position at or after the
start of a later generation is of the lost history: the node no longer has what it wrote. ``changes``
keeps those rows (it is the log of what happened); compaction leaves them out of ``state`` and the
typed tables, and rebuilds both once when it meets a generation start it has not seen (rows of the
lost history it folded in before cannot be told apart in ``state``).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.lake.deltalog import app_transactions
from cdcd.lake.landing.delta import OFFSET_BITS
from cdcd.lake.storage import LakeDir

_FIRST = re.compile(r"^cdcd:(?P<source>.*):g(?P<generation>[0-9]+):first$")

GenerationStarts = dict[str, list[tuple[int, int]]]
"""source node -> [(generation n >= 1, encoded pointer of its first record)]."""


def generation_starts(changes: LakeDir, version: int) -> GenerationStarts:
    """Where each later generation of each source starts, as of ``changes`` version ``version``."""
    out: GenerationStarts = {}
    for txn in app_transactions(changes, version).values():
        match = _FIRST.match(txn.app_id)
        if match is not None:
            out.setdefault(match["source"], []).append((int(match["generation"]), txn.version))
    for starts in out.values():
        starts.sort()
    return out


def start_ids(starts: GenerationStarts) -> list[str]:
    """The generation starts as sorted strings (what a compaction records having seen)."""
    return sorted(f"{source}:g{g}:{first}" for source, gens in starts.items() for g, first in gens)


def drop_lost(feed: pa.Table, starts: GenerationStarts) -> tuple[pa.Table, int]:
    """``feed`` (with ``source_node``, ``source_generation``, ``wal_segment``, ``wal_offset``) without
    the rows of lost histories; and how many were left out."""
    if not starts or not feed.num_rows:
        return feed, 0
    gens = feed.column("source_generation").fill_null(0).to_numpy(zero_copy_only=False)
    ptrs = pc.add(
        pc.multiply(feed.column("wal_segment").cast(pa.int64()), 1 << OFFSET_BITS),
        feed.column("wal_offset").cast(pa.int64()),
    ).to_numpy(zero_copy_only=False)
    sources = feed.column("source_node").to_numpy(zero_copy_only=False)
    holder = np.zeros(feed.num_rows, np.int64)
    for source, gens_of in starts.items():
        mine = sources == source
        for g, first in gens_of:
            # The history that holds a position now: the newest generation started at or before it.
            holder = np.where(mine & (ptrs >= first), np.maximum(holder, g), holder)
    lost = gens < holder
    n = int(lost.sum())
    return (feed.filter(pa.array(~lost)), n) if n else (feed, 0)
