"""Format versions of everything cdcd keeps besides the WAL (``cdcd/formats.py``, issue 44 section 3): a state,
metadata file or offset record of a newer format than this code knows is refused with one line naming it and both
versions (exit 10, no traceback, nothing changed); one without a version (as v0.1.0 wrote it) is read, and marked or
rewritten in place crash-safely: a SIGKILL in the middle of that loses nothing. Real nodes, LMDB files, Delta tables
and ``cdcd`` processes; the Kafka offset records are refused in ``tests/test_upgrade.py``, next to its broker."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import msgspec
import pyarrow as pa
import pytest
from deltalake import CommitProperties, Transaction, write_deltalake

from cdcd import formats
from cdcd.daemon_state import FORMAT_KEY as STATE_FORMAT_KEY
from cdcd.faults import ExitCode
from cdcd.kafka.offsets import decode_record, encode_stored, stored
from cdcd.lake.cuts import CUTS, CUTS_SCHEMA, latest_cut, record_cut
from cdcd.lake.cuts import FORMAT_KEY as CUTS_FORMAT_KEY
from cdcd.lake.maintenance.compact_mark import COMPACT_APP_ID, commit_ids, read_mark
from cdcd.lake.registry import FILE_NAME as REGISTRY
from cdcd.lake.registry import read_registry
from cdcd.lake.table import STATE
from cdcd.node.metastorage import FORMAT_KEY as META_FORMAT_KEY
from cdcd.node.metastorage import Metastorage, RealtimeState
from cdcd.replication.drops import FILE_NAME as DROPS
from cdcd.replication.drops import DropMarks
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import CacheVersion
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.delta_lake import lake_consumer
from tests.support.procs import ROOT, catch_up_and_stop, cdcd, child_env, run_daemon_until_exit, state_show
from tests.support.wal import archived_segments, read_jsonl, wal_events
from tests.support.writer import make_node


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("cdcd: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def too_new_line(where: Path | str, fmt: formats.Format, found: int) -> str:
    return (
        f"cdcd: error: {where}: {fmt.name} format version {found}, newer than the version {fmt.current} cdcd "
        f"{_version()} reads ({formats.UPGRADE_HINT})"
    )


def _version() -> str:
    from cdcd.version import version

    return version()


def put_lmdb(path: Path, key: bytes, value: bytes | None, db: bytes | None = None) -> None:
    """Set (None: delete) ``key`` in an LMDB env, as another cdcd release would have left it."""
    env = lmdb.open(str(path), max_dbs=2)
    try:
        handle = env.open_db(db) if db is not None else None
        with env.begin(write=True, db=handle) as txn:
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
    finally:
        env.close()


def lmdb_items(path: Path, db: bytes | None = None) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), max_dbs=2, readonly=True)
    try:
        handle = env.open_db(db, create=False) if db is not None else None
        with env.begin(db=handle) as txn:
            return dict(txn.cursor())
    finally:
        env.close()


def daemon_with_state(tmp_path: Path) -> tuple[Path, Path]:
    """A node of two archived segments and a daemon (jsonl) that delivered them: (config, state dir)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=5)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    catch_up_and_stop(config, tmp_path / "first.err", (max(archived_segments(node_dir)) + 1, 0, 0))
    return config, node_dir / "cdcd-state"


# --- newer formats are refused ----------------------------------------------------------------------------------
def test_newer_daemon_state_is_refused_by_run_and_state_show(tmp_path: Path) -> None:
    """A daemon state marked with a newer format: `cdcd run` and `cdcd state show` exit 10 with one line naming
    data.mdb and both versions, and the state is left as it was (the run wrote nothing)."""
    config, state = daemon_with_state(tmp_path)
    put_lmdb(state, STATE_FORMAT_KEY, b"2", db=b"state")
    before = lmdb_items(state, b"state")
    want = too_new_line(state / "data.mdb", formats.DAEMON_STATE, 2)
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == ExitCode.FORMAT_TOO_NEW
    assert one_error_line(err.read_text()) == want
    res = cdcd("state", "show", "--config", str(config), "--json")
    assert (res.returncode, one_error_line(res.stderr)) == (ExitCode.FORMAT_TOO_NEW, want)
    assert lmdb_items(state, b"state") == before


def test_newer_metastorage_is_refused_by_node_run(tmp_path: Path) -> None:
    """A node whose metastorage is marked with a newer format: `cdcd node run` exits 10 with one line naming it."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=2)
    meta = node_dir / "db" / "metastorage"
    put_lmdb(meta, META_FORMAT_KEY, b"7")
    config = tmp_path / "node.toml"
    config.write_text(f'node_dir = "{node_dir}"\n')
    res = cdcd("node", "run", "--config", str(config), timeout=60)
    assert res.returncode == ExitCode.FORMAT_TOO_NEW, res.stderr[-3000:]
    assert one_error_line(res.stderr) == too_new_line(meta / "data.mdb", formats.METASTORAGE, 7)


def test_newer_lake_cache_registry_is_refused_by_the_lake_sink(tmp_path: Path) -> None:
    """A lake whose `_cdcd_caches.json` is of a newer format: the daemon landing into it exits 10 with one line naming
    the file (wrapped by the consumer, still the format's code), and the file is left as it was."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=3)
    lake = tmp_path / "lake"
    lake.mkdir()
    (lake / REGISTRY).write_text('{"format": 3, "1": {"name": "x", "partitions": 1}}')
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake))
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err, timeout=120) == ExitCode.FORMAT_TOO_NEW, err.read_text()[-3000:]
    line = one_error_line(err.read_text())
    assert f"{lake / REGISTRY}: {formats.LAKE_CACHES.name} format version 3, newer than the version 1" in line
    assert line.endswith(f"({formats.UPGRADE_HINT})")
    assert (lake / REGISTRY).read_text() == '{"format": 3, "1": {"name": "x", "partitions": 1}}'


def test_newer_cuts_table_is_refused_by_lake_cut(tmp_path: Path) -> None:
    """A `_cuts` table created by a newer cdcd (its format in the column metadata): `cdcd lake cut` exits 10 with
    one line naming it; recording a cut there is refused too, and nothing is appended."""
    schema = pa.schema(
        [f.with_metadata({CUTS_FORMAT_KEY: "2"}) if f.name == "changes_version" else f for f in CUTS_SCHEMA]
    )
    now = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    row = pa.Table.from_pylist([{"recorded_at": now, "changes_version": 3, "tables": [], "positions": []}], schema)
    write_deltalake(str(tmp_path / CUTS), row)
    res = cdcd("lake", "cut", "--lake", str(tmp_path))
    assert res.returncode == ExitCode.FORMAT_TOO_NEW, res.stderr
    assert one_error_line(res.stderr) == too_new_line(tmp_path / CUTS, formats.LAKE_CUTS, 2)
    with pytest.raises(formats.FormatTooNew):
        record_cut(tmp_path, {"t": 1}, {}, 4)
    assert len(list((tmp_path / CUTS / "_delta_log").glob("*.json"))) == 1


def test_cuts_written_now_carry_their_format_and_v1_cuts_read(tmp_path: Path) -> None:
    """A `_cuts` table created as v0.1.0 did (no metadata) is read and appended to; one created now carries the
    version in its schema, kept by the appends."""
    old = pa.schema([f.with_metadata(None) for f in CUTS_SCHEMA])
    now = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    row = pa.Table.from_pylist([{"recorded_at": now, "changes_version": 3, "tables": [], "positions": []}], old)
    write_deltalake(str(tmp_path / "old" / CUTS), row)
    record_cut(tmp_path / "old", {"t": 1}, {}, 4)
    cut = latest_cut(tmp_path / "old")
    assert cut is not None and (cut.changes_version, dict(cut.tables)) == (4, {"t": 1})
    record_cut(tmp_path / "new", {"t": 1}, {}, 1)
    record_cut(tmp_path / "new", {"t": 2}, {}, 2)
    from deltalake import DeltaTable

    (field,) = [f for f in DeltaTable(str(tmp_path / "new" / CUTS)).schema().fields if f.name == "changes_version"]
    assert field.metadata == {CUTS_FORMAT_KEY: "1"}


def test_newer_compaction_mark_is_refused(tmp_path: Path) -> None:
    """A `state` table whose compaction mark was recorded by a newer cdcd is refused naming the table; one recorded
    by v0.1.0 (no version in its userMetadata) is read."""
    (tmp_path / "changes").mkdir()
    for name, version in (("new", 2), ("old", None)):
        lake = tmp_path / name
        meta = json.loads(commit_ids(tmp_path / "changes", 0, 5, []))
        assert meta["cdcd_format"] == formats.COMPACT_MARK.current
        meta["cdcd_changes_commits"] = {"5": "abc"}
        if version is None:
            del meta["cdcd_format"]
        else:
            meta["cdcd_format"] = version
        props = CommitProperties(
            custom_metadata={"userMetadata": json.dumps(meta)}, app_transactions=[Transaction(COMPACT_APP_ID, 5)]
        )
        write_deltalake(str(lake / STATE), pa.table({"k": [1]}), commit_properties=props)
    with pytest.raises(formats.FormatTooNew) as info:
        read_mark(tmp_path / "new")
    assert str(info.value) == (
        f"{tmp_path / 'new' / STATE} (its compaction mark): lake compaction mark format version 2, newer than the "
        f"version 1 cdcd {_version()} reads"
    )
    mark = read_mark(tmp_path / "old")
    assert (mark.version, mark.commits) == (5, {5: "abc"})


def test_kafka_offset_records_carry_their_format_and_a_newer_one_is_refused() -> None:
    """An offset record written now carries its format; one of v0.1.0 (none) decodes; a newer one is refused before
    its fields are decoded (they may mean something else there)."""
    record = stored("n", (3, 40, 1), None, 0, 17)
    assert json.loads(encode_stored(record))["format"] == formats.KAFKA_OFFSETS.current
    old = decode_record(b'{"segment":3,"offset":40,"entry_index":1,"node":"n"}', "here")
    assert (old.address, old.format) == ((3, 40, 1), 0)
    with pytest.raises(formats.FormatTooNew, match=r"^here: Kafka offset record format version 2, newer than"):
        decode_record(b'{"segment":"other","format":2}', "here")


# --- unversioned (v0.1.0) formats are read and marked, crash-safely --------------------------------------------
def _killed_at(point: str, code: str) -> None:
    """Run ``code`` in a child process armed with the fail point ``point``: it must die there by SIGKILL."""
    env = {**child_env(), "CDCD_FAILPOINTS": point}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]


def test_unversioned_daemon_state_is_marked_and_a_sigkill_while_marking_loses_nothing(tmp_path: Path) -> None:
    """A daemon state without a format (as v0.1.0 wrote it) is read as version 1; the first writable open marks it
    in one LMDB transaction: SIGKILLed inside it, the state is exactly as before (unmarked, same position and
    caches), and the next daemon marks it and goes on from the same position."""
    config, state = daemon_with_state(tmp_path)
    put_lmdb(state, STATE_FORMAT_KEY, None, db=b"state")
    before = (lmdb_items(state, b"state"), lmdb_items(state, b"caches"))
    shown = state_show(config)  # read-only: reads version 1, marks nothing
    assert lmdb_items(state, b"state") == before[0]
    _killed_at(
        "formats.daemon_state.marking",
        f"from cdcd.daemon_state import StateStore; from pathlib import Path; StateStore(Path({str(state)!r}))",
    )
    assert (lmdb_items(state, b"state"), lmdb_items(state, b"caches")) == before
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=3, first_tx=10)
    catch_up_and_stop(config, tmp_path / "second.err", (max(archived_segments(node_dir)) + 1, 0, 0))
    after = lmdb_items(state, b"state")
    assert after[STATE_FORMAT_KEY] == str(formats.DAEMON_STATE.current).encode()
    assert lmdb_items(state, b"caches") == before[1]
    delivered = [tuple(e["pos"]) for e in read_jsonl(tmp_path / "out.jsonl")]
    assert delivered == [tuple(e["pos"]) for e in wal_events(node_dir)], "every entry once, in WAL order"
    assert shown["position_parts"] is not None


def test_unversioned_metastorage_is_marked_and_a_sigkill_while_marking_loses_nothing(tmp_path: Path) -> None:
    """A node metastorage without a format (v0.1.0's) is marked when the node opens, in one LMDB transaction:
    SIGKILLed inside it, the realtime state and switches are as before; the next open marks it and keeps them."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=2)
    meta = node_dir / "db" / "metastorage"
    store = Metastorage(meta)
    saved = RealtimeState(False, WalPosition(1, 40, 2), WalPointer(1, 40), 0, WalPointer(1, 40))
    store.put(saved)
    store.put_flag(b"cdc_links", False)
    store.close()
    put_lmdb(meta, META_FORMAT_KEY, None)
    before = lmdb_items(meta)
    assert META_FORMAT_KEY not in before
    _killed_at(
        "formats.metastorage.marking",
        f"from cdcd.node import Node; Node.open({str(node_dir)!r}).close()",
    )
    assert lmdb_items(meta) == before
    store = Metastorage(meta)
    try:
        got = store.get()
        assert got is not None and msgspec.structs.replace(got, updated_ns=0) == msgspec.structs.replace(
            saved, updated_ns=0
        )
        assert store.get_flag(b"cdc_links") is False and store.format == formats.METASTORAGE.current
    finally:
        store.close()
    assert lmdb_items(meta)[META_FORMAT_KEY] == b"1"


def test_v1_replication_drop_marks_are_rewritten_and_a_newer_file_refused(tmp_path: Path) -> None:
    """v0.1.0's drop marks (the bare object; a cache may be called "format") load and are rewritten as version 2,
    keeping every mark; a newer file is refused naming it and left alone."""
    version = CacheVersion(5, 1, 2, 3)
    path = tmp_path / DROPS
    path.write_bytes(msgspec.json.encode({"format": {2: version}, "orders": {2: version}}))
    marks = DropMarks(path)
    assert marks.version("format", 2) == version and marks.version("orders", 2) == version
    assert json.loads(path.read_text())["format"] == formats.REPLICATION_DROPS.current
    again = DropMarks(path)
    assert again.version("format", 2) == version and again.version("orders", 3) is None
    path.write_text('{"format": 3, "marks": {}}')
    with pytest.raises(formats.FormatTooNew, match=f"^{path}: replication drop marks format version 3, newer"):
        DropMarks(path)
    assert path.read_text() == '{"format": 3, "marks": {}}'


def test_lake_cache_registry_of_v0_1_0_is_read_and_marked(tmp_path: Path) -> None:
    """`_cdcd_caches.json` without a format (v0.1.0's) is read as version 1; the next write keeps its caches and adds
    the version."""
    from cdcd.lake.registry import record_caches
    from cdcd.wal.records import CacheConfig, CacheInfo

    (tmp_path / REGISTRY).write_text('{"7": {"name": "old", "partitions": 4}}')
    assert read_registry(tmp_path) == {"7": {"name": "old", "partitions": 4}}
    record_caches(tmp_path, [CacheInfo(8, "new", CacheConfig(partitions=2))])
    assert read_registry(tmp_path) == {
        "7": {"name": "old", "partitions": 4},
        "8": {"name": "new", "partitions": 2},
        "format": formats.LAKE_CACHES.current,
    }


def test_every_format_is_listed_once_in_the_docs() -> None:
    """docs/design.md's table names every versioned format with its current version."""
    text = (ROOT / "docs" / "design.md").read_text()
    for fmt in formats.FORMATS:
        assert f"| {fmt.name} | {fmt.current} |" in text, fmt.name
