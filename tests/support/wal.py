"""The reference: what a node's WAL holds, read with ``WalReader``, and the CDC dir's links."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from cdcd.wal import CacheRecord, DataRecord, WalPointer, WalReader
from cdcd.wal.segment import list_segments

OP_NAMES = {0: "create", 1: "update", 2: "delete"}


_msgpack = msgspec.msgpack.Decoder()


# --- the reference: what the WAL holds -------------------------------------------------------------
def wal_records(node_dir: Path) -> Iterator[tuple[WalPointer, Any]]:
    """Every record of a (closed or running) node's WAL: archive, then the work dir's active segment. A running
    node archives segments while they are read: ``follow`` looks a segment up again when it moved between the listing
    and the opening (CI: a replica node's segment 29 did), and reads a segment rolled meanwhile to its end."""
    wal = node_dir / "wal"
    work, _ = list_segments(wal)
    yield from WalReader([wal / "archive", wal], active_segment=max(work) if work else None, follow=True)


def wal_events(node_dir: Path, *, upto: int | None = None) -> list[dict[str, Any]]:
    """The data entries of the WAL as the jsonl sink documents them, in WAL order.

    ``upto``: only segments below this index.
    """
    names: dict[int, str] = {}
    out: list[dict[str, Any]] = []
    for ptr, rec in wal_records(node_dir):
        if upto is not None and ptr.segment >= upto:
            break
        if type(rec) is CacheRecord:
            names[rec.cache_id] = rec.name
        elif type(rec) is DataRecord:
            for i, e in enumerate(rec.entries):
                v = e.version
                out.append(
                    {
                        "cache": names[e.cache_id],
                        "op": OP_NAMES[int(e.op)],
                        "key": _msgpack.decode(e.key),
                        "value": _msgpack.decode(e.value),
                        "partition": e.partition,
                        "primary": e.primary,
                        "version": {
                            "order": v.order,
                            "node_order": v.node_order,
                            "cluster_id": v.cluster_id,
                            "topology_version": v.topology_version,
                        },
                        "commit_ts_ns": rec.commit_ts_ns,
                        "pos": [ptr.segment, ptr.offset, i],
                    }
                )
    return out


def wal_fold(events: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
    """What ``state`` holds after ``events`` (``wal_events``, in WAL order): (cache, key as JSON text) -> the last
    value, deleted keys left out."""
    live: dict[tuple[str, str], Any] = {}
    for e in events:
        ck = (e["cache"], json.dumps(e["key"]))
        if e["op"] == "delete":
            live.pop(ck, None)
        else:
            live[ck] = e["value"]
    return live


def jsonl_lines(path: Path) -> int:
    """Whole lines in a jsonl file a daemon may be appending to this moment (a partial last line not counted):
    what a test waits on, where ``read_jsonl`` would see the line half written."""
    if not path.exists():
        return 0
    return path.read_bytes().count(b"\n")


def whole_jsonl(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a jsonl file a process may be appending to this moment (a partial last line left out)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "the jsonl file ends in a partial line"
    return [json.loads(line) for line in data.splitlines()]


def archived_segments(node_dir: Path) -> dict[int, Path]:
    return list_segments(node_dir / "wal" / "archive")[0]


def cdc_links(node_dir: Path) -> dict[int, Path]:
    return list_segments(node_dir / "cdc")[0]
