"""`make run`'s live view shows the most files in one partition of `changes`, `state` and the typed tables, and
that figure stays within the bound of 20 at every refresh (issue 43 item 1). `cdcd demo` as `make run` starts it,
at `make run`'s rate, its output a pipe: one plain line of the live view's figures every 2 s."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.procs import CDCD, child_env, reap

BOUND = 20
RUN_S = 60
FILES = re.compile(r"^\s*(\d+)s  WAL .*  files/partition max (\d+|-)(?: \((.*)\))?$")


@pytest.mark.timeout(1200)
def test_make_runs_live_view_shows_at_most_20_files_per_partition_at_every_refresh(tmp_path: Path) -> None:
    """Every refresh line names the most files in one partition; once rows land, `changes` is among the tables it
    counts, and `state` and the typed table `load` once the scheduled compaction ran; no figure exceeds 20. The
    demo then verifies (exit 0)."""
    err = tmp_path / "demo.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [*CDCD, "demo", "--rate", "2000", "--seconds", str(RUN_S), "--var", str(tmp_path / "var")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=child_env(),
            cwd=tmp_path,
        )
        try:
            out, _ = proc.communicate(timeout=1000)
        finally:
            reap(proc)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:] + err.read_text()[-3000:]
    refreshes = [m for line in text.splitlines() if (m := FILES.match(line))]
    assert len(refreshes) >= RUN_S // 4, text
    shown = [int(m.group(2)) for m in refreshes if m.group(2) != "-"]
    assert shown and all(n <= BOUND for n in shown), [m.group(0) for m in refreshes]
    tables = {part.split(" ")[0] for m in refreshes if m.group(3) for part in m.group(3).split(", ")}
    assert {"changes", "state", "tables"} <= tables, tables
    print(f"\nfiles per partition at {len(shown)} refreshes: max {max(shown)}; tables {sorted(tables)}")
