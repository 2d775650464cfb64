"""The Delta lake rig: the lake sink's consumer table, reading ``<lake>/changes`` and checking it against the
WAL (one row per data entry, whole records per commit, application transactions), and a child process landing
a node's WAL as one source."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from cdcd.consumer import EventBatch, RecordSlice
from cdcd.lake.landing.delta import app_id, decode_version
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.wal import CacheRecord, DataRecord, WalPointer
from tests.support.config import NO_MAINTENANCE
from tests.support.lake import QUICK_START
from tests.support.wal import wal_events, wal_records

Pos = tuple[int, int, int]


def lake_consumer(lake: Path, writer: str = "deltalake", **options: Any) -> dict[str, Any]:
    """A ``[consumer]`` table; the Spark writer on ``local[1]`` with a quick-starting JVM."""
    table = {"kind": "lake", "lake_path": str(lake), "writer": writer, **NO_MAINTENANCE, **options}
    if writer == "spark":
        table = {"spark_master": "local[1]", "spark_conf": QUICK_START, **table}
    return table


# --- the lake and the reference ----------------------------------------------------------------------
def delta_commits(lake: Path) -> list[dict[str, Any]]:
    """Every commit of ``<lake>/changes`` from its JSON log files: version, cdcd's commit info, adds, txns."""
    out = []
    for p in sorted((lake / "changes" / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        out.append(
            {
                "version": int(p.stem),
                "cdcd": json.loads(info["cdcd"]) if "cdcd" in info else None,
                "adds": [a["add"] for a in actions if "add" in a],
                "rewritten": [a["remove"] for a in actions if not a.get("remove", {}).get("dataChange", True)],
                # A generation's start (":first") aside, one transaction per source and commit.
                "txns": {
                    a["txn"]["appId"]: a["txn"]["version"]
                    for a in actions
                    if "txn" in a and not a["txn"]["appId"].endswith(":first")
                },
            }
        )
    assert [c["version"] for c in out] == list(range(len(out))), "the log's versions are contiguous"
    return out


def lake_rows(lake: Path, version: int | None = None) -> pa.Table:
    dt = DeltaTable(str(lake / "changes"), version=version)
    return dt.to_pyarrow_table()


def record_sizes(expected: list[dict[str, Any]]) -> Counter[tuple[int, int]]:
    return Counter((e["pos"][0], e["pos"][1]) for e in expected)


def check_whole_records(table: pa.Table, sizes: Counter[tuple[int, int]], what: str) -> int:
    """Every record with rows in ``table`` has all of them (a reader never sees half a transaction)."""
    seen = Counter(zip(table.column("wal_segment").to_pylist(), table.column("wal_offset").to_pylist(), strict=True))
    halves = {p: (n, sizes[p]) for p, n in seen.items() if n != sizes[p]}
    assert not halves, f"{what}: records with part of their rows: {list(halves.items())[:5]}"
    return len(seen)


def check_lake(
    lake: Path,
    node_dir: Path,
    expected: list[dict[str, Any]] | None = None,
    source: str | None = None,
) -> list[dict[str, Any]]:
    """The lake (of ``source``, if given) is exactly the WAL (see the module docstring); returns the commits."""
    expected = wal_events(node_dir) if expected is None else expected
    positions = [tuple(e["pos"]) for e in expected]
    table = lake_rows(lake)
    if source is not None:
        table = table.filter(pa.compute.equal(table.column("source_node"), source))
    rows = table.to_pylist()
    pos_of = [(r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in rows]
    dupes = [p for p, n in Counter(pos_of).items() if n > 1]
    assert not dupes, f"{len(dupes)} WAL entries landed more than once, e.g. {dupes[:5]}"
    missing = set(positions) - set(pos_of)
    assert not missing, f"{len(missing)} WAL entries never landed, e.g. {sorted(missing)[:5]}"
    assert Counter(pos_of) == Counter(positions), "the table's positions are not the WAL's data entries"
    by_pos = dict(zip(pos_of, rows, strict=True))
    sources = {r["source_node"] for r in rows}
    assert len(sources) <= 1
    for ev in expected:
        r = by_pos[tuple(ev["pos"])]
        got = {
            "cache": r["cache"],
            "op": r["op"],
            "key": json.loads(r["key"]),
            "value": json.loads(r["value"]) if r["value"] is not None else None,
            "partition": r["partition"],
            "primary": r["primary"],
            "version": {
                "order": r["version_order"],
                "node_order": r["node_order"],
                "cluster_id": r["version_cluster_id"],
                "topology_version": r["topology_version"],
            },
            "commit_ts_us": int(r["commit_ts"].timestamp() * 1_000_000),
        }
        want = {
            "cache": ev["cache"],
            "op": ev["op"],
            "key": ev["key"],
            "value": ev["value"] if ev["op"] != "delete" else None,
            "partition": ev["partition"],
            "primary": ev["primary"],
            "version": ev["version"],
            "commit_ts_us": ev["commit_ts_ns"] // 1000,
        }
        assert got == want, f"row at {ev['pos']}"
        assert r["expire_time_ms"] == 0
    # Each commit lands whole records, and no record in two commits.
    commits = [c for c in delta_commits(lake) if source is None or (c["cdcd"] or {}).get("source") == source]
    live = {a["path"] for a in pa.table(DeltaTable(str(lake / "changes")).get_add_actions(flatten=True)).to_pylist()}
    # Files a rewrite that changes no data replaced (the writer's bound on small files, an OPTIMIZE): still on disk.
    live |= {r["path"] for c in delta_commits(lake) for r in c["rewritten"]}
    sizes = record_sizes(expected)
    owner: dict[tuple[int, int], int] = {}
    last_of: dict[str, int] = {}
    for c in commits:
        if not c["adds"] or not any(a.get("dataChange", True) for a in c["adds"]):
            continue  # no commit of a batch: a rewrite of files (rows in other files, the same rows)
        assert c["cdcd"] is not None and len(c["txns"]) == 1, f"commit {c['version']}: one source transaction"
        ptrs: Counter[tuple[int, int]] = Counter()
        for a in c["adds"]:
            assert a["path"] in live, f"commit {c['version']} added {a['path']}, not live (append-only table)"
            t = pq.read_table(lake / "changes" / a["path"], columns=["wal_segment", "wal_offset"])
            ptrs.update(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True))
            assert json.loads(a["stats"])["numRecords"] == t.num_rows
        for p, n in ptrs.items():
            assert n == sizes[p], f"commit {c['version']} holds {n} of the {sizes[p]} entries of record {p}"
            assert p not in owner, f"record {p} in commits {owner[p]} and {c['version']}"
            owner[p] = c["version"]
        ((app, version),) = c["txns"].items()
        assert decode_version(version) == WalPointer(*max(ptrs)), "the transaction names the last record landed"
        last_of[app] = version
    if sources:
        (source,) = sources
        dt = DeltaTable(str(lake / "changes"))
        for app, version in last_of.items():
            assert dt.transaction_version(app) == version, f"{app}: the snapshot keeps the newest transaction"
        assert any(app == app_id(source, 0) for app in last_of)
    return commits


def wal_batch(node_dir: Path, source: str = "test-node") -> EventBatch:
    """All data records of a node's WAL as one EventBatch (what the daemon would hand the sink)."""
    names: dict[int, str] = {}
    slices = []
    for ptr, rec in wal_records(node_dir):
        if type(rec) is CacheRecord:
            names[rec.cache_id] = rec.name
        elif type(rec) is DataRecord:
            slices.append(RecordSlice(ptr, rec, 0))
    return EventBatch(source, slices, names)


def deliver(sink: LakeConsumer, *batches: EventBatch) -> None:
    """``batches`` delivered as the daemon delivers them, then confirmed: a call each (the Spark writer says False,
    its batch written ahead), and a call without events after a last False; everything landed when it returns."""
    ok = True
    for batch in batches:
        ok = sink.on_events(batch)
    if not ok:
        assert sink.on_events(EventBatch(batches[-1].source_node, [], {})) is True


def sub_batch(batch: EventBatch, start: int, stop: int) -> EventBatch:
    return EventBatch(batch.source_node, list(batch.peek_slices()[start:stop]), batch._names)


def land_each_record(lake: Path, batch: EventBatch, *, max_files: int, **options: Any) -> LakeConsumer:
    """Land ``batch`` one record per commit (the most commits it can make) with the JVM-free writer, no scheduled
    maintenance and the writer's rewrites bounding each partition to ``max_files`` (0: none); ``options``: more
    ``LakeOptions`` fields. Every batch must be accepted. Returns the stopped sink (its counters)."""
    settings = {**NO_MAINTENANCE, "max_files_per_partition": max_files, **options}
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **settings))
    sink.start()
    try:
        for k in range(len(batch.peek_slices())):
            assert sink.on_events(sub_batch(batch, k, k + 1)) is True
    finally:
        sink.stop()
    return sink


def land_main() -> None:
    """Child process: ``node_dir lake records_per_batch go_file out_file source``: land the node's WAL as
    ``source`` in batches of ``records_per_batch`` records once ``go_file`` exists; write the sink's counters
    to ``out_file``. ``out_file.ready`` says the sink has opened the table."""
    node_dir, lake, per, go, out, source = sys.argv[1:7]
    batch = wal_batch(Path(node_dir), source)
    n = len(batch.peek_slices())
    sink = LakeConsumer(LakeOptions(lake_path=lake, writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    Path(out + ".ready").touch()  # the table is open: the parent may let the race begin
    while not Path(go).exists():
        time.sleep(0.001)
    k = 0
    try:
        while k < n:
            assert sink.on_events(sub_batch(batch, k, k + int(per))) is True
            k += int(per)
    finally:
        sink.stop()
    table = sink._table
    assert table is not None
    Path(out).write_text(json.dumps({"commits": table.commits, "conflicts": table.conflicts}))


def landed_positions(lake: Path) -> list[Pos]:
    if not (lake / "changes" / "_delta_log").is_dir():
        return []
    t = lake_rows(lake)
    cols = [t.column(c).to_pylist() for c in ("wal_segment", "wal_offset", "wal_index")]
    return list(zip(*cols, strict=True))


def check_moment(lake: Path, positions: list[Pos], sizes: Counter[tuple[int, int]], state: Pos | None) -> set[Pos]:
    """What must hold at any moment, also right after a SIGKILL: no entry twice, only whole records, and the
    daemon's committed position never past the lake (every WAL entry before it landed)."""
    landed = landed_positions(lake)
    dupes = [p for p, n in Counter(landed).items() if n > 1]
    assert not dupes, f"entries landed twice: {dupes[:5]}"
    if landed:
        check_whole_records(lake_rows(lake), sizes, "after the fault")
    got = set(landed)
    missing = [p for p in positions if state is not None and p < state and p not in got]
    assert not missing, f"the daemon committed {state} but {len(missing)} entries before it are not in the lake"
    return got


def check_state_matches_lake(
    lake: Path, positions: list[Pos], sizes: Counter[tuple[int, int]], state: Pos | None
) -> None:
    """After a consumer failure (not a kill) the daemon's state is exactly where the lake ends: it confirmed every
    batch that landed (not behind) and none that did not (not past)."""
    got = check_moment(lake, positions, sizes, state)
    before = sum(1 for p in positions if state is not None and p < state)
    assert before == len(got), f"the daemon's state {state} covers {before} entries, the lake holds {len(got)}"
