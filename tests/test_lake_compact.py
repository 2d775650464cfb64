"""``cdcd lake compact``: the MERGE of the change data feed into ``<lake>/state`` (latest per key by
version, then WAL position; deletes applied), incremental and idempotent through its application
transaction, killed (SIGKILL) at every step and mid-MERGE; the Spark runtime loads Delta from local
jars without any resolution."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.lake import spark as spark_session
from cdcd.lake.maintenance.compact import COMPACT_APP_ID, compact, compacted_version, state_lag, table_version
from cdcd.lake.table import CHANGES, STATE
from tests.support.compaction import QUICK_JVM, compact_env, kill_group, run_compact
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import CDCD

TEST_MASTER = "local[2]"
ODD_CACHES = ["orders", "a/b", "new\nline", "x=y", "ünï cödé"]


@pytest.fixture(params=["spark", "deltalake"])
def engine(request: pytest.FixtureRequest) -> Any:
    """What ``compact`` is given: the SparkSession (Spark's MERGE) or None (delta-rs, no JVM)."""
    return request.getfixturevalue("spark") if request.param == "spark" else None


def state_version(lake: Path) -> int:
    version = table_version(lake / STATE)
    assert version is not None
    return version


# --- the fold ---------------------------------------------------------------------------------------
def test_compact_keeps_the_latest_change_per_key_and_applies_deletes(engine: Any, tmp_path: Path) -> None:
    """Across several commits and caches (odd names included): the highest version wins, a WAL position
    breaks a tie, a delete removes the key, a re-create after a delete brings it back, a stale change
    arriving later loses; a second compaction reads only the new commits; a third has nothing to do."""
    lake = tmp_path / "lake"
    first = [
        change("orders", "1", '"a"', 1),
        change("orders", "2", '"b"', 2),
        change("orders", "3", '"c"', 3),
        # Same version: the later WAL position wins (a node transaction writing a key twice).
        change("a/b", "1", '"early"', 5, segment=0, offset=100),
        change("a/b", "1", '"late"', 5, segment=1, offset=10),
        # Higher version at an earlier WAL position still wins (version order first).
        change("new\nline", '"k"', '"v9"', 9, segment=0, offset=1),
        change("new\nline", '"k"', '"v8"', 8, segment=3, offset=1),
        change("x=y", '"gone"', None, 4),  # a delete of a key never seen
        change("ünï cödé", "1", '"u"', 1),
    ]
    append_changes(lake, first, source_txn=("node-a", 1))
    r1 = compact(engine, lake)
    assert r1.did_work and (r1.from_version, r1.to_version) == (0, 0)
    assert r1.keys == 7
    assert state_rows(lake) == expected_state(first)

    second = [
        change("orders", "1", None, 10),  # delete
        change("orders", "2", '"b2"', 11),
        change("orders", "3", '"stale"', 2),  # older than what state holds: loses
        change("a/b", "1", None, 12),
        change("a/b", "1", '"again"', 13),  # re-created after its delete in the same commit
        change("new\nline", '"k2"', '"n"', 14),
    ]
    third = [change("ünï cödé", "1", None, 15), change("orders", "1", '"back"', 16)]
    append_changes(lake, second, source_txn=("node-a", 2))
    append_changes(lake, third, source_txn=("node-a", 3))
    r2 = compact(engine, lake)
    assert (r2.from_version, r2.to_version) == (1, 2)
    assert state_rows(lake) == expected_state(first + second + third)
    assert state_rows(lake)[("orders", "3")] == '"c"'
    assert compacted_version(lake) == 2

    before = state_version(lake)
    r3 = compact(engine, lake)
    assert not r3.did_work and r3.to_version == 2
    assert state_version(lake) == before, "a compaction with nothing new must not commit"
    assert state_lag(lake) == (2, 2, False)


def test_compact_commits_its_application_transaction_atomically_with_the_merge(engine: Any, tmp_path: Path) -> None:
    """Each compaction's own commit carries (cdcd-compact, changes version) - the first one's append
    and a later one's MERGE (with delta-rs, a WRITE whose removes and adds are the MERGE's): no separate
    progress file."""
    import json

    def last_commit() -> tuple[list[str], list[tuple[str, int]]]:
        commits = sorted((lake / STATE / "_delta_log").glob("*.json"))
        actions = [json.loads(line) for line in commits[-1].read_text().splitlines() if line.strip()]
        ops = [a["commitInfo"]["operation"] for a in actions if "commitInfo" in a]
        return ops, [(a["txn"]["appId"], a["txn"]["version"]) for a in actions if "txn" in a]

    lake = tmp_path / "lake"
    append_changes(lake, [change("c", "1", '"x"', 1)])
    append_changes(lake, [change("c", "2", '"y"', 2)])
    compact(engine, lake)
    assert last_commit() == (["WRITE"], [(COMPACT_APP_ID, 1)])
    append_changes(lake, [change("c", "1", '"x2"', 3)])
    compact(engine, lake)
    assert last_commit() == (["MERGE" if engine is not None else "WRITE"], [(COMPACT_APP_ID, 2)])
    assert not list(lake.glob("_cdcd*")), "no side files next to the tables"


# --- kills ------------------------------------------------------------------------------------------


def data_files(table: Path) -> set[str]:
    return {str(p.relative_to(table)) for p in table.rglob("*.parquet") if "_delta_log" not in p.parts}


def batch(step: int, keys: int) -> list[dict[str, Any]]:
    """Updates of existing keys, new keys and deletes over five caches; versions grow with ``step``."""
    rows = []
    base = step * 1_000_000
    for i in range(keys):
        cache = ODD_CACHES[i % len(ODD_CACHES)]
        key = str(i % (keys // 2 + 1) + step * 7)
        if i % 11 == 0:
            rows.append(change(cache, key, None, base + i, segment=step, offset=i))
        else:
            rows.append(change(cache, key, f'"s{step}-{i}"', base + i, segment=step, offset=i))
    return rows


def test_compact_killed_at_every_step_then_again_gives_the_latest_per_key(spark: Any, tmp_path: Path) -> None:
    """SIGKILL of `cdcd lake compact` (and its JVM) after creating the state table, after reading the feed and
    right after its commit: each time state is exactly the old or exactly the new fold, never a mix, and the next
    compaction makes it the latest per key of every change (issue 19.3). The kill inside the MERGE is the next test."""
    lake = tmp_path / "lake"
    everything: list[dict[str, Any]] = []
    for step, point in enumerate(["lake.compact.state_table", "lake.compact.source_read", "lake.compact.committed"]):
        rows = batch(step, 200)
        everything += rows
        before = state_rows(lake) if (lake / STATE).exists() else {}
        version = append_changes(lake, rows)
        proc = run_compact(lake, compact_env(CDCD_FAILPOINTS=point))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, err.decode()[-2000:])
        kill_group(proc)
        after = state_rows(lake) if (lake / STATE / "_delta_log").exists() else {}
        if point == "lake.compact.committed":
            assert after == expected_state(everything) and compacted_version(lake) == version
        else:
            assert after == before and compacted_version(lake) < version
        compact(spark, lake)
        assert state_rows(lake) == expected_state(everything), point
        assert compacted_version(lake) == version


@pytest.mark.chaos  # the named kills above leave state exactly the old fold before the commit and the new one after
# it; this one catches a JVM's MERGE between writing its files and committing them (orphans the next run ignores)
def test_compact_killed_inside_its_merge_leaves_state_whole(spark: Any, tmp_path: Path) -> None:
    """SIGKILL of `cdcd lake compact` in the middle of the MERGE (data files written into state, commit not):
    state is exactly the old fold, and the next compaction makes it the latest per key of every change."""
    lake = tmp_path / "lake"
    everything = batch(0, 200)
    version = append_changes(lake, everything)
    compact(spark, lake)
    assert compacted_version(lake) == version
    # Kill once the MERGE has written data files to state but not committed them. Big enough batches make that
    # window long; if a commit still slips in first, go again with a new batch.
    mid_merge_kills = 0
    for step in range(3, 8):
        rows = batch(step, 40_000)
        everything += rows
        version = append_changes(lake, rows)
        state_log_before = state_version(lake)
        files_before = data_files(lake / STATE)
        proc = run_compact(lake, compact_env())
        deadline = time.monotonic() + 600
        killed_mid = False
        while proc.poll() is None and time.monotonic() < deadline:
            if data_files(lake / STATE) - files_before:
                if state_version(lake) == state_log_before:
                    kill_group(proc)
                    killed_mid = True
                break
            time.sleep(0.005)
        if proc.poll() is None and not killed_mid:
            proc.wait(timeout=600)
        kill_group(proc)
        if killed_mid:
            mid_merge_kills += 1
            assert state_version(lake) == state_log_before, "killed before its commit: state unchanged"
            assert compacted_version(lake) < version
            assert data_files(lake / STATE) - files_before, "the MERGE had written files (now orphans)"
        compact(spark, lake)
        assert state_rows(lake) == expected_state(everything), f"step {step}"
        assert compacted_version(lake) == version
        if mid_merge_kills:
            break
    assert mid_merge_kills == 1, "never caught a MERGE between writing its files and committing"


# --- the runtime ------------------------------------------------------------------------------------
def test_acquire_loads_delta_from_local_jars_and_resolves_nothing(spark: Any, tmp_path: Path) -> None:
    """The session's Delta comes from the jar files `make install` fetched (spark.jars, no
    spark.jars.packages); a compaction in a fresh process with every network fetch made impossible
    (an empty HOME, so no Ivy cache, and proxies pointing at a closed port) still works."""
    jars = [j for j in spark.conf.get("spark.jars").split(",") if j]
    assert jars and all(j.startswith("file:") for j in jars), jars
    assert {Path(j.removeprefix("file:")).name for j in jars} >= {
        spark_session.jar_name(*coords) for coords in spark_session.DELTA_ARTIFACTS
    }
    assert spark.conf.get("spark.jars.packages", None) in (None, "")
    assert spark.conf.get("spark.sql.extensions") == "io.delta.sql.DeltaSparkSessionExtension"
    # Hadoop's local file system without a forked chmod per file (the jar is on the JVM's class path).
    hadoop = spark._jsc.hadoopConfiguration()
    local_fs = spark._jvm.org.apache.hadoop.fs.FileSystem.getLocal(hadoop)
    assert local_fs.getClass().getName() == spark_session.LOCAL_FS_CLASS

    copy = tmp_path / "jars"
    copy.mkdir()
    for jar in spark_session.delta_jars():
        shutil.copy(jar, copy)
    lake = tmp_path / "lake"
    rows = [change("c", "1", '"x"', 1), change("c", "2", '"y"', 2)]
    append_changes(lake, rows)
    home = tmp_path / "home"
    home.mkdir()
    offline = f"{QUICK_JVM} " + " ".join(f"-D{p}.proxyHost=127.0.0.1 -D{p}.proxyPort=9" for p in ("http", "https"))
    env = compact_env(HOME=str(home), CDCD_SPARK_JARS_DIR=str(copy), JAVA_TOOL_OPTIONS=offline)
    res = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(lake), "--spark-master", TEST_MASTER],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 rows upserted (2 new, 0 updated), 0 deleted;" in res.stdout
    assert state_rows(lake) == expected_state(rows)
    assert not (home / ".ivy2").exists() and not (home / ".ivy2.5.2").exists()


def test_missing_delta_jars_is_one_line_naming_the_directory(tmp_path: Path) -> None:
    """No jars where they should be: exit 2 and one line saying how to get them, before any JVM starts."""
    lake = tmp_path / "lake"
    append_changes(lake, [change("c", "1", '"x"', 1)])
    empty = tmp_path / "nojars"
    empty.mkdir()
    res = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(lake), "--engine", "spark"],
        capture_output=True,
        text=True,
        env=compact_env(CDCD_SPARK_JARS_DIR=str(empty)),
        timeout=120,
    )
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("cdcd: error:")]
    assert lines == [
        f"cdcd: error: {empty}: no io.delta_delta-spark_2.13-{spark_session.DELTA_VERSION}.jar, "
        f"io.delta_delta-storage-{spark_session.DELTA_VERSION}.jar, "
        f"{spark_session.jar_name(*spark_session.LOCAL_FS_ARTIFACT)}: run `make install` "
        "(scripts/fetch-delta-jars.sh) once with network, or set CDCD_SPARK_JARS_DIR to a directory holding them"
    ], res.stderr


def test_compact_of_a_directory_without_a_delta_table_is_refused(tmp_path: Path) -> None:
    (tmp_path / "lake" / CHANGES).mkdir(parents=True)
    res = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(tmp_path / "lake")],
        capture_output=True,
        text=True,
        env=compact_env(),
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"cdcd: error: {tmp_path / 'lake' / CHANGES}: not a Delta table (no _delta_log/): not a cdcd lake"
    )
