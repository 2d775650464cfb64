"""Lake maintenance and inspection on real Delta tables: ``optimize`` (fewer files, same rows, not a
change for compaction), ``vacuum`` (refused while old changes wait for compaction; removes replaced
files and orphans of writes that never committed), ``show`` (versions, per-source application
transactions, rows per cache, behind or not), ``history``, and ``verify`` against real nodes (one
or several; "compact first" while state is behind; a cache name with a newline keeps the table intact)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.lake.landing.arrow import to_json
from cdcd.lake.maintenance.compact import compact, state_lag
from cdcd.lake.maintenance.ops import Vacuumed, VacuumRefused, data_files_on_disk, optimize
from cdcd.lake.maintenance.vacuum_rs import vacuum
from cdcd.lake.reading.report import byte_size, printable
from cdcd.lake.table import CHANGES
from cdcd.node import Node
from cdcd.node.snapshot import NodeSnapshot
from tests.support.cli import run_cli
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import CDCD, child_env


def cdcd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CDCD, *args], capture_output=True, text=True, timeout=300, env=child_env())


# --- optimize and vacuum ----------------------------------------------------------------------------
def test_optimize_bin_packs_without_changing_data_and_vacuum_removes_what_is_replaced(
    spark: Any, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    rows: list[dict[str, Any]] = []
    for i in range(6):  # six commits: six small files in each of two partitions
        batch = [change("orders", str(i), f'"o{i}"', 10 + i), change("new\nline", str(i), f'"n{i}"', 20 + i)]
        rows += batch
        append_changes(lake, batch, source_txn=("node-a", i))
    compact(spark, lake)
    changes = lake / CHANGES
    assert len(data_files_on_disk(changes)) == 12

    done = optimize(spark, lake)
    assert done[CHANGES]["numFilesRemoved"] == 12 and done[CHANGES]["numFilesAdded"] == 2
    from deltalake import DeltaTable

    assert len(DeltaTable(str(changes)).file_uris()) == 2
    assert DeltaTable(str(changes)).to_pyarrow_table().num_rows == 12
    # OPTIMIZE rewrote files but changed no data: state is not behind, compaction has nothing to do.
    end, compacted, behind = state_lag(lake)
    assert end > compacted and not behind
    assert not compact(spark, lake).did_work
    # The change data feed of the old versions still reads the original files (not vacuumed yet).
    feed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(str(changes))
    assert feed.where("_change_type = 'insert'").count() == 12

    # An orphan of a write that never committed (a writer killed after its files, before its commit).
    orphan = changes / "cache=orders" / "part-99999-orphan.c000.zstd.parquet"
    orphan.write_bytes(b"PAR1 never committed")
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    on_disk = {p: p.stat().st_size for p in data_files_on_disk(changes)}
    with pytest.raises(VacuumRefused, match=r"^--retain-hours 0 is below Delta's default retention \(168 h\)"):
        vacuum(lake, retain_hours=0)
    done = vacuum(lake, retain_hours=0, force=True)
    gone = on_disk.keys() - set(data_files_on_disk(changes))
    assert len(gone) == 13, "the 12 replaced files and the orphan are gone"
    assert done[CHANGES] == Vacuumed(13, sum(on_disk[p] for p in gone), 2)
    assert not orphan.exists()
    assert DeltaTable(str(changes)).to_pyarrow_table().num_rows == 12
    assert state_rows(lake) == expected_state(rows)


def test_vacuum_is_refused_while_old_changes_wait_for_compaction(tmp_path: Path) -> None:
    """Their original files may be the ones vacuum deletes (after an OPTIMIZE), and compaction reads
    them through the change data feed: refuse, one line, before any JVM starts."""
    lake = tmp_path / "lake"
    append_changes(lake, [change("c", "1", '"x"', 1)])
    res = cdcd("lake", "vacuum", "--lake", str(lake), "--retain-hours", "0", "--force")
    assert res.returncode == 2
    assert res.stderr.startswith(f"cdcd: error: {lake}: changes from version 0 (")
    assert res.stderr.rstrip().endswith(
        f"are not compacted yet and older than 0 h: run `cdcd lake compact --lake {lake}` first"
    )
    assert len(res.stderr.strip().splitlines()) == 1
    assert "SparkContext" not in res.stderr


def test_compact_optimize_and_vacuum_say_what_they_did(spark: Any, tmp_path: Path) -> None:
    """Their stdout, line by line: compaction's rows from Delta's MERGE metrics (a delete of an absent key
    and a change older than state's row change nothing, and are said to); compaction and optimize with nothing to do
    say so; vacuum below 168 h needs --force (one line, exit 2), says Delta's check is off, and
    prints its own figures, not Delta's "Deleted N files" line. The commands run in process on the
    worker's session (no JVM start each); their exits in a shell are tested in tests/test_cli_ops.py."""
    lake = tmp_path / "lake"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli("lake", *args, "--lake", str(lake))

    append_changes(lake, [change("c", str(k), f'"v{k}"', 10 + k) for k in range(1, 6)] + [change("c", "9", None, 16)])
    res = run("compact")
    assert res.returncode == 0, res.stderr[-3000:]
    first = (
        r"state version \d+ \(changes versions 0..0\): 5 rows upserted \(5 new, 0 updated\), 0 deleted, "
        r"1 changes without effect \(a delete of an absent key, or older than state's row\); "
        r"1 typed tables, 0 fields rescued\n"
    )
    assert re.fullmatch(first, res.stdout), res.stdout
    second = [
        change("c", "1", '"w1"', 21),
        change("c", "2", '"w2"', 22),
        change("c", "3", None, 23),
        change("c", "4", None, 24),
        change("c", "6", '"v6"', 26),
        change("c", "10", None, 27),  # never in state
        change("c", "5", '"old"', 1),  # older than state's row of key 5
    ]
    append_changes(lake, second)
    res = run("compact")
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.fullmatch(
        r"state version \d+ \(changes versions 1..1\): 3 rows upserted \(1 new, 2 updated\), 2 deleted, "
        r"2 changes without effect \(.*\); 1 typed tables, 0 fields rescued\n",
        res.stdout,
    ), res.stdout
    res = run("compact")
    assert (res.returncode, res.stdout) == (0, "nothing new to compact: state reflects changes version 1\n")

    res = run("optimize")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "changes: 2 small files rewritten as 1 (2 files considered)", res.stdout
    assert [ln.split(":")[0] for ln in lines] == ["changes", "state", "tables/c"]
    res = run("optimize")
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.fullmatch(r"(\S+: nothing to optimize: \d+ files, already compact\n){3}", res.stdout), res.stdout
    assert res.stdout.startswith("changes: nothing to optimize: 1 files, already compact\n")

    res = run("vacuum", "--retain-hours", "0")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (
        "cdcd: error: --retain-hours 0 is below Delta's default retention (168 h): a reader of an older snapshot "
        "(time travel, a query or stream in flight) may lose files it still needs; add --force to vacuum anyway "
        "(the retention check is then off for that run)\n"
    )
    changes = lake / CHANGES
    before = {p: p.stat().st_size for p in data_files_on_disk(changes)}
    assert len(before) == 3  # two written, one OPTIMIZE made of them
    res = run("vacuum", "--retain-hours", "0", "--force")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.startswith(
        "--force: the retention check is off for this run: files replaced more than 0 h ago are deleted, below the "
        "168 h Delta keeps by default\n"
    )
    gone = before.keys() - set(data_files_on_disk(changes))
    assert len(gone) == 2
    lines = res.stdout.splitlines()
    assert lines[0] == (
        f"changes: deleted 2 data files ({byte_size(sum(before[p] for p in gone))}) no snapshot of the last 0 h "
        "needs; 1 data files left"
    )
    assert [ln.split(":")[0] for ln in lines] == ["changes", "state", "tables/c"]
    assert "Deleted" not in res.stdout


def test_byte_sizes_read_as_people_read_them() -> None:
    assert [byte_size(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 40, 5000 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 TiB",
        "5000.0 TiB",
    ]


# --- show and history -------------------------------------------------------------------------------
def test_show_reads_versions_sources_rows_per_cache_from_the_logs(spark: Any, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    append_changes(
        lake, [change("orders", "1", '"a"', 1), change("new\nline", "1", '"n"', 2)], source_txn=("node-a", 7)
    )
    append_changes(lake, [change("orders", "2", '"b"', 3, source="node-b")], source_txn=("node-b", 3))
    res = cdcd("lake", "show", "--lake", str(lake), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert [t["name"] for t in info["tables"]] == ["changes"]
    assert info["tables"][0]["app_transactions"] == {"node-a": 7, "node-b": 3}
    assert info["tables"][0]["rows_per_cache"] == {"new\nline": 1, "orders": 2}
    assert info["state_behind"] is True and info["compacted_to"] == -1

    compact(spark, lake)
    append_changes(lake, [change("orders", "2", '"b2"', 4, source="node-b")], source_txn=("node-b", 9))
    res = cdcd("lake", "show", "--lake", str(lake))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "changes app transaction node-a: 7" in lines
    assert "changes app transaction node-b: 9" in lines
    assert "state app transaction cdcd-compact: 1" in lines
    assert "state reflects changes version 1 (behind: run lake compact)" in lines
    rows = lines[lines.index(next(x for x in lines if x.startswith("cache "))) + 1 :]
    rows = rows[: rows.index("")] if "" in rows else rows  # the typed tables' section follows
    by_cache = {ln.split()[0]: ln.split()[1:] for ln in rows}
    assert by_cache == {"new\\nline": ["1", "1"], "orders": ["3", "2"]}
    assert any(ln.startswith("changes ") and ln.split()[1] == "2" for ln in lines), lines


def test_history_lists_commits_newest_first(spark: Any, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    append_changes(lake, [change("c", "1", '"x"', 1)])
    compact(spark, lake)  # the first compaction appends
    append_changes(lake, [change("c", "2", '"y"', 2)])
    compact(spark, lake)  # later ones MERGE
    res = cdcd("lake", "history", "--lake", str(lake), "--json")
    assert res.returncode == 0, res.stderr
    assert [(h["version"], h["operation"]) for h in json.loads(res.stdout)] == [(1, "WRITE"), (0, "WRITE")]
    res = cdcd("lake", "history", "--lake", str(lake), "--table", "state")
    assert res.returncode == 0, res.stderr
    ops = [ln.split()[1:4:2] for ln in res.stdout.splitlines()[1:]]
    assert [v for v, _ in ops] == ["2", "1", "0"]
    assert "MERGE" in res.stdout.splitlines()[1]


# --- verify -----------------------------------------------------------------------------------------
def node_with(node_dir: Path, caches: dict[str, dict[Any, Any]]) -> None:
    with Node.open(node_dir) as node:
        for name, items in caches.items():
            node.cache(name).put_all(items)


def lake_from_nodes(lake: Path, node_dirs: list[Path]) -> list[dict[str, Any]]:
    """The changes a writer would land from these (stopped) nodes: one row per live entry."""
    rows = []
    version = 1
    for node_dir in node_dirs:
        with NodeSnapshot(node_dir) as snap:
            for cache in snap.caches():
                for key_raw, value_raw in snap.raw_items(cache):
                    rows.append(change(cache, to_json(key_raw), to_json(value_raw), version, source=node_dir.name))
                    version += 1
    append_changes(lake, rows)
    return rows


def test_verify_against_several_nodes_says_compact_first_and_finds_mismatches(spark: Any, tmp_path: Path) -> None:
    n1, n2, lake = tmp_path / "node1", tmp_path / "node2", tmp_path / "lake"
    node_with(n1, {"orders": {1: "one", 2: "two"}, "people": {"ann": {"age": 3}}})
    node_with(n2, {"orders": {3: "three"}, "items": {"x": 1}})
    lake_from_nodes(lake, [n1, n2])

    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(n1), "--node-dir", str(n2))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"cdcd: error: {lake}: state is behind changes (never compacted, changes at version 0): "
        f"compact first (`cdcd lake compact --lake {lake}`)"
    )

    compact(spark, lake)
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(n1), "--node-dir", str(n2))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:-1]] == ["items", "orders", "people"]
    assert all(ln.endswith(" OK") for ln in lines[1:-1])
    assert lines[-1] == "verified: 5 keys, OK"

    # One node only: its partner's keys in the lake are a mismatch; exit 1.
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(n1))
    assert res.returncode == 1
    result = {ln.split()[0]: ln.split()[-1] for ln in res.stdout.splitlines()[1:-1]}
    assert result == {"items": "MISMATCH", "orders": "MISMATCH", "people": "OK"}
    assert res.stdout.splitlines()[-1] == "verified: 5 keys, MISMATCH in 2 of 3 caches"


def test_verify_table_keeps_one_line_per_cache_with_a_newline_in_its_name(spark: Any, tmp_path: Path) -> None:
    """Issue 19.13: a cache called "a\\nb" (or with a tab, or a backslash) is one escaped row, so no
    row can pass for another cache's and the summary is the last line."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    names = ["a\nb", "tab\there", "back\\slash", "plain"]
    node_with(node_dir, {name: {1: name} for name in names})
    lake_from_nodes(lake, [node_dir])
    compact(spark, lake)
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 + len(names) + 1
    assert sorted(ln.split()[0] for ln in lines[1:-1]) == sorted(printable(n) for n in names)
    assert {printable(n) for n in names} == {"a\\nb", "tab\\there", "back\\\\slash", "plain"}
    assert lines[-1] == f"verified: {len(names)} keys, OK"


def test_optimize_leaves_files_at_or_above_its_minimum_size_alone(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lake = tmp_path / "lake"
    for i in range(3):  # three small files in one partition
        append_changes(lake, [change("orders", str(i), f'"o{i}"', 10 + i)], source_txn=("node-a", i))
    import pyarrow as pa
    from deltalake import DeltaTable

    from cdcd.lake.maintenance import ops

    adds = pa.table(DeltaTable(str(lake / CHANGES)).get_add_actions(flatten=True))
    sizes = sorted(adds.column("size_bytes").to_pylist())
    # Every file at the minimum: a frequent scheduled run must not rewrite files that are big enough.
    monkeypatch.setattr(ops, "OPTIMIZE_MIN_FILE_BYTES", sizes[0])
    assert optimize(spark, lake)[CHANGES]["numFilesRemoved"] == 0
    monkeypatch.setattr(ops, "OPTIMIZE_MIN_FILE_BYTES", sizes[-1] + 1)
    assert optimize(spark, lake)[CHANGES]["numFilesRemoved"] == 3
    assert len(DeltaTable(str(lake / CHANGES)).file_uris()) == 1
