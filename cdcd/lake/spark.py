"""One SparkSession per process, configured from the sink's options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

DRIVER_MEMORY = "2g"
"""Default heap of the driver JVM (Spark's own default, 1g, runs out with 500k-row batches)."""

_lock = threading.Lock()
_users = 0
_session: Any = None


def acquire(master: str, app_name: str, conf: Mapping[str, str]) -> Any:
    """The process's SparkSession (created on first use); pair every call with ``release``."""
    global _users, _session
    with _lock:
        if _session is None:
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
                # What pyarrow writes (writer = "arrow"): one timestamp encoding across the lake.
                .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
            )
            # A JVM out of heap can leave a job waiting forever (seen: the local scheduler's
            # dispatcher dies of it): exit instead, so the write fails and the daemon with it.
            java_opts = conf.get("spark.driver.extraJavaOptions", "")
            if "OutOfMemoryError" not in java_opts:
                java_opts = f"{java_opts} -XX:+ExitOnOutOfMemoryError".strip()
            builder = builder.config("spark.driver.memory", DRIVER_MEMORY)
            for key, value in conf.items():
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
    the JVM's stdin when the daemon dies)."""
    inner = kwargs.get("preexec_fn")

    def preexec() -> None:
        if inner is not None:
            inner()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    kwargs["preexec_fn"] = preexec
    return subprocess.Popen(*args, **kwargs)


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
