"""The daemon's per-cache, per-op event count (``cdcd_daemon_events_total``, ``Committer._count``) equals a plain
count entry by entry, for records of one cache, transactions over several, and slices of part of a record."""

from __future__ import annotations

from collections import Counter

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd import metrics
from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.daemon.committer import Committer
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op

_NAMES = {1: "one", 2: "two", 7: "seven"}
_KEY = msgspec.Raw(b"\x01")


def _metric() -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for family in metrics.DAEMON.collect():
        if family.name != "cdcd_daemon_events":
            continue
        for sample in family.samples:
            if sample.name == "cdcd_daemon_events_total":
                out[sample.labels["cache"], sample.labels["op"]] = int(sample.value)
    return out


records = st.lists(
    st.tuples(
        st.lists(st.tuples(st.sampled_from([1, 2, 7, 9]), st.sampled_from(list(Op))), min_size=1, max_size=40),
        st.integers(0, 39),
        st.one_of(st.none(), st.integers(1, 40)),
    ),
    min_size=1,
    max_size=12,
)


@given(records)
@settings(max_examples=150, deadline=None)
def test_counts_equal_a_count_entry_by_entry(spec: list[tuple[list[tuple[int, Op]], int, int | None]]) -> None:
    slices = []
    for r, (entries, start, stop) in enumerate(spec):
        data = tuple(DataEntry(cid, op, _KEY, _KEY, 0, CacheVersion(r, 1, 0, 1)) for cid, op in entries)
        start = min(start, len(data) - 1)
        if stop is not None:
            stop = min(max(stop, start + 1), len(data))
        slices.append(RecordSlice(WalPointer(0, 100 * r), DataRecord(data, 1), start, stop))
    batch = EventBatch("n", slices, _NAMES)
    want: Counter[tuple[str, str]] = Counter()
    for s in slices:
        for e in s.record.entries[s.start : s.end]:
            want[batch.cache_name(e.cache_id), OP_NAMES[e.op]] += 1
    before = _metric()
    Committer._count(slices, batch)
    after = _metric()
    assert after - before == want
