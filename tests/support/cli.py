"""``cdcd`` commands run in this process (click's runner): the lake commands then share the test
worker's SparkSession (``cdcd.lake.spark.acquire`` is reference-counted), so a test of what a command
prints costs no JVM start. What a command does to its process (signals, exit codes seen by a shell)
stays tested with real subprocesses (``tests.support.procs``)."""

from __future__ import annotations

import subprocess

from click.testing import CliRunner

from cdcd.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``cdcd *args`` in process, as ``subprocess.run`` would report it (returncode, stdout, stderr)."""
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(["cdcd", *args], res.exit_code, res.stdout, res.stderr)
