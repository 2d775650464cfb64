"""The chaos suite's short mode (``python -m tests.chaos.run --short``) as pytest tests, one per scenario.

Each test runs one scenario of ``tests/chaos`` with real node and daemon processes and fails with the scenario's
own message (what broke, where, and the /tmp dir kept for inspection). The full mode (``make chaos``) runs the same
scenarios with more runs; see ``tests/chaos/__init__.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.run import DEFAULT_SEED, by_name, format_table
from tests.support.chaos import Result, run_scenario


def run_short(name: str) -> Result:
    scenario = by_name(name)
    res = run_scenario(scenario.name, scenario.fn, short=True, seed=DEFAULT_SEED)
    print("\n" + format_table([res]))
    for note in res.notes:
        print(f"  {note}")
    assert res.passed, (
        f"{name}: {res.error}\n(lost {res.lost}, duplicates {res.duplicates}; files kept in {res.tmp}; repeat with "
        f"`python -m tests.chaos.run --short --only {name} --seed {DEFAULT_SEED}`)"
    )
    assert res.lost == 0
    return res


@pytest.mark.chaos  # the suite's tests/test_daemon_crash.py makes the same claim in a quarter of the time
def test_kill_daemon() -> None:
    """SIGKILLing `cdcd run` at random moments while the node writes loses no WAL entry, and every restart resumes
    exactly at the committed position."""
    res = run_short("kill-daemon")
    assert res.runs >= 4


@pytest.mark.chaos  # tests/test_lake_faults.py's SIGKILL-during-commits test makes the same claim at chosen points
def test_kill_daemon_lake() -> None:
    """SIGKILLing `cdcd run` with the lake sink at random moments lands every WAL entry in the lake exactly once."""
    res = run_short("kill-daemon-lake")
    assert res.duplicates == 0


@pytest.mark.chaos  # tests/test_node_crash.py SIGKILLs the node mid-write and checks every acked entry
def test_kill_node() -> None:
    """SIGKILLing the node (also during its start-up) while it writes leaves a WAL the daemon delivers exactly."""
    run_short("kill-node")


@pytest.mark.chaos  # tests/test_realtime_faults.py SIGKILLs a realtime node and checks its restore point
def test_kill_node_realtime() -> None:
    """SIGKILLing the node while its realtime consumer delivers makes it re-deliver only from its committed position,
    losing nothing."""
    run_short("kill-node-realtime")


@pytest.mark.chaos  # tests/test_switch_crash_points.py kills node and daemon at every step of a switch
def test_kill_mixed() -> None:
    """SIGKILLing the node, the daemon or both around realtime switches keeps every WAL entry delivered by exactly the
    side the hand-over protocol assigns it."""
    run_short("kill-mixed")


@pytest.mark.slow
def test_sigstop_daemon() -> None:
    """Freezing the daemon with SIGSTOP for 0.5-3 s while the node writes delays delivery but loses and duplicates
    nothing, and a SIGTERM sent while frozen still stops it cleanly."""
    res = run_short("sigstop-daemon")
    assert res.duplicates == 0


@pytest.mark.chaos  # tests/test_daemon_errors.py's gap, delete-lost-links and relink tests make the same claim
def test_cdc_dir_full() -> None:
    """A CDC dir over cdc_dir_max_bytes while the daemon is down makes it exit 3 at the gap, and relink-lost-segments
    brings every skipped segment back from the archive: the consumer ends exactly at the node's state."""
    res = run_short("cdc-dir-full")
    assert res.lost == 0


@pytest.mark.chaos  # tests/test_lake_faults.py's full-disk and unwritable-lake tests make the same claim
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_lake_disk_full() -> None:
    """A full lake file system makes the daemon exit 4 with one clear error and its state not past the lake; after
    growing it, a restart lands every entry exactly once."""
    res = run_short("lake-disk-full")
    assert res.duplicates == 0


@pytest.mark.slow
def test_clock_jumps() -> None:
    """Wall-clock jumps of up to a day in node and daemon never make a lag metric negative, crash nothing, and
    leave delivery exact."""
    run_short("clock-jumps")


@pytest.mark.slow
def test_slow_consumer() -> None:
    """A consumer sleeping per batch in front of a large backlog keeps the daemon's RSS flat (back-pressure) and
    still receives every entry exactly once."""
    res = run_short("slow-consumer")
    assert res.details["growth_after_warmup_mb"] < 30


@pytest.mark.chaos  # tests/test_daemon_errors.py's failing-consumer tests make the same claim
def test_consumer_raises() -> None:
    """A consumer that raises makes the daemon exit 4 with one error line and its position exactly at what was
    confirmed; once fixed, a restart delivers the rest exactly."""
    run_short("consumer-raises")
