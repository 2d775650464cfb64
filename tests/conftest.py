"""Shared fixtures: small segments so rollovers happen in tests; the lake tests' SparkSession."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node

pytest_plugins = ["tests.support.tmux"]  # the `pane` fixture

QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
"""Every JVM the suite starts (Spark in the test process and in daemons, Kafka, Kafka Connect) lives seconds to
minutes: without the C2 JIT and its compiler threads one starts and runs its first jobs on less CPU, and the suite is
CPU-bound on two cores. Verifying the bytecode of the thousands of classes a Spark JVM loads is another part of its
start; the jars are the ones `make install` fetched from Maven Central, so the tests' JVMs skip it (cdcd's own JVMs
do not)."""


SPARK_CDS = Path(sys.prefix) / "spark-driver.jsa"
"""The Spark driver's classes as a class-data-sharing archive (`make test` writes it: scripts/spark_cds.py). Each of
the suite's Spark drivers (the test workers' session, the daemons, every `cdcd lake` command) would otherwise load,
parse and link the same Spark, Scala and Delta classes from their jars. CDS messages go to stderr, never to a
driver's stdout; the JVM refuses an archive that does not fit it, with one warning, and runs without."""


def pytest_configure(config: pytest.Config) -> None:
    # JDK_JAVA_OPTIONS reaches every `java` launch, also in subprocesses (they inherit it); a test that sets
    # its own JVM options keeps them.
    os.environ.setdefault("JDK_JAVA_OPTIONS", QUICK_JVM)
    # SPARK_SUBMIT_OPTS reaches the driver JVM that pyspark starts through spark-submit, but neither Spark's
    # launcher JVM (its classpath differs) nor a standalone master, worker or executor.
    if SPARK_CDS.is_file():
        os.environ.setdefault(
            "SPARK_SUBMIT_OPTS", f"-XX:SharedArchiveFile={SPARK_CDS} -Xlog:cds*=off:stdout -Xlog:cds*=warning:stderr"
        )


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    return tmp_path / "node"


@pytest.fixture
def node(node_dir: Path) -> Iterator[Node]:
    n = Node.open(node_dir, wal_segment_size_bytes=64 * 1024, wal_force_archive_timeout_ms=0)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession per test process (cdcd.lake.spark's process-wide session), started by the first test that
    asks for it and kept to the end: a JVM's start and the JIT's first compilation of Spark and Delta cost more CPU
    than most lake tests, and the suite is CPU-bound. cdcd's compaction and maintenance set their settings on a child
    session (``newSession()``), so none outlives its test; a test that needs another session runs cdcd in a
    subprocess."""
    from cdcd.lake import spark as spark_session
    from tests.support.lake import TEST_MASTER, TEST_SPARK_CONF

    session = spark_session.acquire(TEST_MASTER, "cdcd-tests", TEST_SPARK_CONF)
    try:
        yield session
    finally:
        spark_session.release()


@pytest.fixture(scope="module", params=["c", "python"])
def row_builder(request: pytest.FixtureRequest) -> Iterator[str]:
    """The lake's row builder (cdcd.lake.landing.arrow.build_columns) set to the C module, then to the Python path: a
    test that asks for this runs on both. The C module must be built (the suite's ``make install`` builds it)."""
    from cdcd.lake.landing import arrow, rows_py

    saved = arrow.build_columns
    if request.param == "python":
        arrow.build_columns = rows_py.columns
    else:
        try:
            from cdcd.lake.landing import _rows
        except ImportError:
            pytest.fail(f"cdcd.lake.landing._rows is not built: {arrow.BUILD_HINT}")
        arrow.build_columns = _rows.columns
    try:
        yield request.param
    finally:
        arrow.build_columns = saved


# The files that take longest (end-to-end lake runs, JVMs, real processes), run first: with
# `--dist loadfile` each worker takes the next file when it is free, so a long file collected last
# would run alone at the end while the other worker idles. Measured from `pytest --durations`; the
# order within a file is unchanged.
_LONGEST_FIRST = (
    "test_lake_neighbours.py",
    "test_lake.py",
    "test_lake_cuts.py",
    "test_lake_compact.py",
    "test_lake_faults.py",
    "test_lake_delta.py",
    "test_cache_drop.py",
    "test_chaos_short.py",
    "test_lake_ops.py",
    "test_lake_tables.py",
    "test_lake_small_files.py",
    "test_lake_vacuum_scheduled.py",
    "test_demo.py",
    "test_kafka_sink.py",
    "test_upgrade.py",
    "test_lake_names.py",
    "test_lake_keys.py",
    "test_outages.py",
    "test_kafka_spark.py",
    "test_replication.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
