"""Which top-level fields a batch's values hold, per cache: what tells the lake sink that a known cache
brought a field its typed table has no column for (its next compaction is then due at once, as for a new
cache: cdcd/lake/maintenance/maintainer.py ``landed``)."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

PROBE_MAX_ROWS = 50_000
"""Batches up to this many rows are probed; a larger one is a backlog being caught up (behind by more than
the readiness bound anyway), whose new fields become columns at the next scheduled compaction."""

_OBJECTS = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
"""Keys decoded, values left as raw text: no Python object per nested value."""


def top_level_fields(data: pa.Table) -> dict[str, set[str]]:
    """cache -> the top-level fields of its JSON-object values in ``data`` (a changes batch: ``cache``,
    ``value``); {} for a batch over ``PROBE_MAX_ROWS``."""
    if not data.num_rows or data.num_rows > PROBE_MAX_ROWS:
        return {}
    values = data.column("value").combine_chunks()
    objects = pc.fill_null(pc.starts_with(values, "{"), False)
    if not pc.any(objects).as_py():
        return {}
    values = values.filter(objects)
    caches = data.column("cache").combine_chunks().filter(objects)
    out: dict[str, set[str]] = {}
    for cache in pc.unique(caches).to_pylist():
        mine = values.filter(pc.equal(caches, cache))
        # One decode of the values joined into one JSON array (the join is pyarrow's, in C++).
        joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(mine)], pa.int32()), mine), ",")
        names: set[str] = set()
        for obj in _OBJECTS.decode(b"[" + joined[0].as_buffer().to_pybytes() + b"]"):
            names.update(obj)
        out[str(cache)] = names
    return out
