"""The README's first look at the lake, run as written (relative paths included) in a scratch working
directory: its Python snippet fills ``var/node1``, ``cdcd run --config config/lake.toml`` lands and
compacts it into ``var/lake``, its ``cdcd lake sql`` lines print the typed sums, ``cdcd lake cut`` names
the orders table, and its reader snippet
(DuckDB, polars, Spark, the change data feed, Spark SQL over ``state``) runs without an error."""

from __future__ import annotations

import contextlib
import csv
import io
import shlex
import subprocess
from pathlib import Path

import pytest

from cdcd.lake.cuts import latest_cut
from cdcd.lake.reading.sql import lake_sql
from tests.support.docs import README, block_with
from tests.support.procs import CDCD, child_env, reap, start_daemon, stop_daemon, wait_for
from tests.support.shipped import copy_shipped_config


def lake_sql_line(line: str) -> tuple[str, int]:
    """A README ``cdcd lake sql`` line through the function the command calls (same options)."""
    args = shlex.split(line.split("#", maxsplit=1)[0])
    assert args[:3] == ["cdcd", "lake", "sql"], line
    names = {"--lake": "lake", "--engine": "engine", "--format": "fmt", "--spark-master": "spark_master"}
    options: dict[str, str] = {}
    rest = args[3:]
    while rest[0].startswith("--"):
        options[names[rest[0]]] = rest[1]
        rest = rest[2:]
    assert len(rest) == 1, line
    lake = options.pop("lake")
    return lake_sql(lake, rest[0], **options)


@pytest.mark.timeout(1800)  # a daemon starting Spark, then Spark again for the README's readers
def test_the_first_look_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    monkeypatch.chdir(tmp_path)
    copy_shipped_config(tmp_path / "config")  # its metrics ports free ones
    exec(block_with(text, "python", 'Node.open("var/node1")'), {})  # the README's own code

    shell = block_with(text, "sh", "config/lake.toml")
    run_line = next(ln for ln in shell.splitlines() if ln.startswith("cdcd run"))
    config = Path(shlex.split(run_line.split("#")[0])[-1])
    err = tmp_path / "daemon.err"
    daemon = start_daemon(config, err, env=child_env())
    try:
        lake = Path("var/lake")

        def compacted() -> bool:
            assert daemon.poll() is None, err.read_text()[-3000:]
            cut = latest_cut(lake)
            return cut is not None and "orders" in cut.tables

        wait_for(compacted, 900, "the daemon's scheduled compaction of orders", interval=0.5)
    finally:
        rc = stop_daemon(daemon, timeout=60)
        reap(daemon)
    assert rc == 0, err.read_text()[-3000:]

    sql_lines = [ln for ln in shell.splitlines() if ln.startswith("cdcd lake sql")]
    assert len(sql_lines) == 2
    text_out, code = lake_sql_line(sql_lines[0])
    assert code == 0, text_out
    assert text_out.splitlines()[2:] == ["A-7         3", "(1 row)"]
    csv_out, code = lake_sql_line(sql_lines[1])
    assert code == 0, csv_out
    (row,) = list(csv.DictReader(io.StringIO(csv_out)))
    assert (row["key"], row["qty"], row["sku"]) == ("o-1", "3", "A-7")

    (cut_line,) = [ln for ln in shell.splitlines() if ln.startswith("cdcd lake cut")]
    cut = subprocess.run(
        [*CDCD, *shlex.split(cut_line.split("#")[0])[1:]], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert cut.returncode == 0, cut.stderr
    assert "orders" in cut.stdout, cut.stdout

    readers = block_with(text, "python", "from cdcd.lake.reading.readers import")
    from cdcd.lake import spark as lake_spark

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(readers, {})
    finally:
        lake_spark.release()
    assert "A-7" in out.getvalue()
