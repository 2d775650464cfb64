"""``cdcd.failpoints`` in real processes: a kill point SIGKILLs at its N-th hit, a pause point stops the first
process of all to reach it (its pid in the claim file) until it is killed, and the others go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import child_env, wait_for

HIT_THREE_TIMES = """
import sys
from cdcd import failpoints
for i in range(3):
    print(f"before {i}", flush=True)
    failpoints.hit("test.point")
print("done", flush=True)
"""


def run(armed: str, out: Path) -> subprocess.Popen[bytes]:
    env = {**child_env(), "CDCD_FAILPOINTS": armed}
    return subprocess.Popen([sys.executable, "-c", HIT_THREE_TIMES], env=env, stdout=out.open("wb"))


def test_a_kill_point_sigkills_at_its_nth_hit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("test.point@2", out)
    assert proc.wait(60) == -signal.SIGKILL
    assert out.read_text().splitlines() == ["before 0", "before 1"]


def test_a_pause_point_stops_the_first_process_only_until_it_is_killed(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    first = run(f"test.point@2=pause:{claims}", tmp_path / "first")
    claim = claims / "test.point"
    try:
        wait_for(lambda: claim.is_file() and claim.read_text() != "", 60, "the first process to pause")
        assert int(claim.read_text()) == first.pid
        second = run(f"test.point@2=pause:{claims}", tmp_path / "second")
        assert second.wait(60) == 0, "the pause is taken: the second process goes on"
        assert (tmp_path / "second").read_text().splitlines()[-1] == "done"
        assert first.poll() is None, "still paused"
        assert (tmp_path / "first").read_text().splitlines() == ["before 0", "before 1"]
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(60)


def test_a_bad_action_fails_at_import_naming_the_variable(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", "import cdcd.failpoints"],
        env={**child_env(), "CDCD_FAILPOINTS": "test.point=explode"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "CDCD_FAILPOINTS: 'test.point=explode': the action is kill, stop, pause or pause:DIR" in res.stderr


@pytest.mark.parametrize("armed", ["", "other.point"])
def test_an_unarmed_point_does_nothing(tmp_path: Path, armed: str) -> None:
    out = tmp_path / "out"
    assert run(armed, out).wait(60) == 0
    assert out.read_text().splitlines()[-1] == "done"
