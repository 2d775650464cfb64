"""One SparkSession per process, configured from the sink's options, with Delta Lake on.

The Delta jars are never resolved at run time: ``make install`` (``scripts/fetch-delta-jars.sh``)
fetches them from Maven Central once into ``jars_dir()``, and every session loads them from there
(``spark.jars``), so the daemon, ``cdcd lake …``, tests and ``make run`` need no network.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cdcd.faults import ExitCode, Fault

DRIVER_MEMORY = "2g"
"""Default heap of the driver JVM (Spark's own default, 1g, runs out with 500k-row batches)."""

DELTA_VERSION = "4.4.0"
"""delta-spark's jars (built for Spark 4.2, Scala 2.13). The PyPI package may be a patch ahead
(4.4.1): its Python side is a thin wrapper over these classes, and Maven Central has 4.4.0."""

DELTA_ARTIFACTS = (
    ("io.delta", "delta-spark_2.13", DELTA_VERSION),
    ("io.delta", "delta-storage", DELTA_VERSION),
)
"""Only these two: what else delta-spark's POM names is either shipped by pyspark (Jackson, Parquet,
Hadoop, in newer versions) or used only by Unity Catalog and the Delta kernel, which cdcd does not use."""

LOCAL_FS_ARTIFACT = ("com.globalmentor", "hadoop-bare-naked-local-fs", "0.1.0")
LOCAL_FS_CLASS = "com.globalmentor.apache.hadoop.fs.BareLocalFileSystem"
"""Hadoop's ``file:`` file system with permissions set through java.nio. Hadoop's own forks a
``chmod`` process for every file and directory it creates when Hadoop's native library is absent,
as it is from pyspark's wheels: that was most of the time of a compaction over thousands of cache
partitions (one state file each). It must be on the JVM's class path from the start (Hadoop
resolves ``fs.file.impl`` before ``spark.jars`` are loaded), on the driver and every executor."""

S3A_ARTIFACTS = (
    ("org.apache.hadoop", "hadoop-aws", "3.5.0"),
    ("software.amazon.awssdk", "bundle", "2.35.4"),
    ("software.amazon.s3.analyticsaccelerator", "analyticsaccelerator-s3", "1.3.1"),
)
"""Hadoop's ``s3a`` file system for pyspark's Hadoop (3.5.0) and the AWS SDK it was built against: Spark
reaches a lake on S3 (and its compatibles) through these. Loaded only by sessions that use ``s3a``."""

JARS_DIR_ENV = "CDCD_SPARK_JARS_DIR"

_lock = threading.Lock()
_users = 0
_session: Any = None


class DeltaJarsMissing(Fault, RuntimeError):
    """The Delta jars were never fetched (``make install`` was not run in this environment)."""

    exit_code = ExitCode.BAD_INPUT


def jars_dir() -> Path:
    """Where ``make install`` puts the Delta jars: ``$CDCD_SPARK_JARS_DIR``, else ``<venv>/jars``."""
    override = os.environ.get(JARS_DIR_ENV)
    return Path(override) if override else Path(sys.prefix) / "jars"


def jar_name(org: str, artifact: str, version: str) -> str:
    """The file name the fetch script retrieves an artifact to (Ivy's ``[organisation]_[artifact]-[revision]``)."""
    return f"{org}_{artifact}-{version}.jar"


def delta_jars(directory: Path | None = None, s3a: bool = False) -> list[Path]:
    """The local Delta jar files (and the ``s3a`` ones); ``DeltaJarsMissing`` (one line saying how to
    fix it) if any is absent."""
    where = jars_dir() if directory is None else directory
    wanted = (*DELTA_ARTIFACTS, LOCAL_FS_ARTIFACT) + (S3A_ARTIFACTS if s3a else ())
    paths = [where / jar_name(*coords) for coords in wanted]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DeltaJarsMissing(
            f"{where}: no {', '.join(missing)}: run `make install` (scripts/fetch-delta-jars.sh) once with "
            f"network, or set {JARS_DIR_ENV} to a directory holding them"
        )
    return paths


def delta_conf(jars: list[Path], user_conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings that turn Delta (and the fork-free local file system) on in a session built
    from local jar files. Jars other than Delta's go on the driver's and executors' class paths
    from the same local path: the local file system is needed before ``spark.jars`` load, and on a
    cluster the AWS SDK alone is hundreds of MB, which costs more to ship to every executor than to
    install at the same path on each machine (``make install`` does). The user's own
    ``spark.jars`` and class paths are kept, after these."""
    user = dict(user_conf or {})
    delta = [p for p in jars if p.name.split("_", 1)[0] == "io.delta"]
    local = [p for p in jars if p not in delta]

    def joined(key: str, sep: str, ours: list[str]) -> str:
        return sep.join(ours + ([user[key]] if user.get(key) else []))

    classpath = [str(p) for p in local]
    conf = {
        "spark.jars": joined("spark.jars", ",", [p.as_uri() for p in delta]),
        "spark.driver.extraClassPath": joined("spark.driver.extraClassPath", ":", classpath),
        "spark.executor.extraClassPath": joined("spark.executor.extraClassPath", ":", classpath),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    }
    if "spark.hadoop.fs.file.impl" not in user and any(p.name == jar_name(*LOCAL_FS_ARTIFACT) for p in local):
        conf["spark.hadoop.fs.file.impl"] = LOCAL_FS_CLASS  # unless the user chose one
    return conf


def _local_defaults(master: str) -> dict[str, str]:
    """Sizes for a single machine: Delta's snapshot replay (50 partitions), Spark's shuffles (200) and
    parallel file listing (10,000 tasks, which Delta's VACUUM uses to list a table) are sized for
    clusters and cost seconds to minutes per job in local mode; cluster masters keep theirs."""
    if not master.startswith("local"):
        return {}
    return {
        "spark.databricks.delta.snapshotPartitions": "4",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": "8",
    }


def acquire(master: str, app_name: str, conf: Mapping[str, str]) -> Any:
    """The process's SparkSession (created on first use); pair every call with ``release``."""
    global _users, _session
    with _lock:
        if _session is None:
            # Before any JVM starts: a missing jar is one clear line, not a ClassNotFoundException.
            jars = delta_jars(s3a=any(k.startswith("spark.hadoop.fs.s3a.") for k in conf))
            # Executors (local or on a cluster) must run the same interpreter and packages.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
            from pyspark.sql import SparkSession

            builder = (
                SparkSession.builder.master(master)
                .appName(app_name)
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.session.timeZone", "UTC")
                .config("spark.sql.execution.arrow.pyspark.enabled", "true")
                .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
                .config("spark.sql.parquet.compression.codec", "zstd")
                # What pyarrow writes (writer = "deltalake"): one timestamp encoding across the lake.
                .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
            )
            # A JVM out of heap can leave a job waiting forever (seen: the local scheduler's
            # dispatcher dies of it): exit instead, so the write fails and the daemon with it.
            java_opts = conf.get("spark.driver.extraJavaOptions", "")
            if "OutOfMemoryError" not in java_opts:
                java_opts = f"{java_opts} -XX:+ExitOnOutOfMemoryError".strip()
            builder = builder.config("spark.driver.memory", DRIVER_MEMORY)
            for key, value in _local_defaults(master).items():
                builder = builder.config(key, value)
            for key, value in conf.items():
                builder = builder.config(key, value)
            for key, value in delta_conf(jars, conf).items():
                builder = builder.config(key, value)
            builder = builder.config("spark.driver.extraJavaOptions", java_opts)
            _session = _create(builder)
            _session.sparkContext.setLogLevel("WARN")
        _users += 1
        return _session


def release() -> None:
    global _users, _session
    with _lock:
        _users -= 1
        if _users <= 0 and _session is not None:
            _session.stop()
            _session = None
            _users = 0


def _jvm_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
    """PySpark's gateway Popen, with SIGTERM and SIGINT ignored in the JVM (as PySpark already does for
    SIGINT): systemd (every process of the unit's cgroup) and Ctrl-C (the process group) signal the JVM
    too, which would fail the batch in flight; the daemon stops the JVM itself (session stop, or EOF on
    the JVM's stdin when the daemon dies). The JVM's stdout and stderr go to this process's logger: what
    Spark and Delta print (VACUUM's "Deleted N files ..." line, log4j's lines) is not a result of cdcd's
    commands, whose stdout is theirs alone, nor a raw line in a JSON log."""
    inner = kwargs.get("preexec_fn")

    def preexec() -> None:
        if inner is not None:
            inner()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    kwargs["preexec_fn"] = preexec
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.STDOUT)
    proc = subprocess.Popen(*args, **kwargs)
    if proc.stdout is not None:
        threading.Thread(
            target=_forward_jvm_output, args=(proc.stdout,), name="cdcd-spark-jvm-log", daemon=True
        ).start()
    return proc


def _forward_jvm_output(stream: Any) -> None:
    """The JVM's output as ``spark_jvm`` events (one per log4j record, its stack trace folded in) until the JVM
    closes it."""
    import structlog

    from cdcd.lake import jvm_log

    jvm_log.forward(stream, structlog.get_logger("cdcd.spark"))


def _create(builder: Any) -> Any:
    """``builder.getOrCreate()`` keeping this process's SIGINT handler (SparkContext installs one that
    raises KeyboardInterrupt anywhere; the daemon's handler stops it cleanly instead)."""
    import pyspark.java_gateway

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    pyspark.java_gateway.Popen = _jvm_popen  # type: ignore[assignment,attr-defined]
    try:
        return builder.getOrCreate()
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGINT, previous)


def main() -> None:
    """``python -m cdcd.lake.spark``: print the jar directory and the Maven coordinates, one per line
    (``scripts/fetch-delta-jars.sh`` reads them: one source of truth for versions)."""
    print(jars_dir())
    for org, artifact, version in (*DELTA_ARTIFACTS, LOCAL_FS_ARTIFACT, *S3A_ARTIFACTS):
        print(org, artifact, version)


if __name__ == "__main__":
    main()
