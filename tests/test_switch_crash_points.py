"""No crash point of a realtime switch, on either side, leaves the node and the daemon disagreeing
about who delivers (DESIGN §5, crash rule).

Each case arms one fail point (``cdcd.failpoints``: the process SIGKILLs itself exactly there), runs
the switch under load, restarts the killed process, switches both ways again and checks the two
outputs entry by entry against the WAL: every entry delivered, each side exactly its share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.control import request
from tests.support.procs import log_events, wait_for
from tests.support.realtime import Rig, check_delivery, rig_maker


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


def _send(rig: Rig, state: str) -> None:
    """``realtime on|off`` over the control socket; the node may die before it answers."""
    try:
        request(rig.socket, {"cmd": "realtime", "state": state}, timeout_s=60)
    except (ConnectionError, OSError, ValueError):
        pass


def _delivering(rig: Rig) -> None:
    """Wait until the side that delivers has written something (the switch then happens under load)."""
    size = sum(p.stat().st_size for p in (rig.node_out, rig.daemon_out) if p.exists())
    wait_for(
        lambda: sum(p.stat().st_size for p in (rig.node_out, rig.daemon_out) if p.exists()) > size,
        60,
        "events to be delivered",
    )


def _finish(rig: Rig) -> None:
    """Both switches once more, then everything delivered and checked against the WAL."""
    if rig.status()["realtime"]["mode"] != "on":
        rig.switch_on()
    _delivering(rig)
    rig.switch_off()
    _delivering(rig)
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    check_delivery(rig)


NODE_POINTS = [
    ("on", "realtime.on.try_start_durable"),  # the TryStart is in the WAL, the node's intent is not persisted
    ("on", "realtime.on.try_start_persisted"),
    ("on", "realtime.on.before_enabled"),  # the daemon passed the TryStart; the node has not persisted ON
    ("on", "realtime.on.enabled"),
    ("off", "realtime.off.persisted"),  # OFF persisted, the Stop record not yet written
    ("off", "realtime.off.stop_durable"),
]


@pytest.mark.parametrize(("command", "point"), NODE_POINTS, ids=[p for _, p in NODE_POINTS])
def test_node_killed_at_a_step_of_a_switch(rig_factory: Any, command: str, point: str) -> None:
    # Realtime runs first, so the node has a committed realtime position: a Stop record written at
    # its restart carries it. An "on" point is armed for its second hit (the first is at open).
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=30, failpoints=point + ("@2" if command == "on" else ""))
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    _delivering(rig)
    if command == "on":
        rig.switch_off()
        _delivering(rig)
    _send(rig, command)
    rig.node_died(timeout=60)
    rig.start_node(first_tx=100_000, pause_ms=30)
    _delivering(rig)
    if point == "realtime.on.try_start_durable":
        # The node came back with its older position and wrote Stop(that); the daemon, PASSIVE past
        # the TryStart, keeps its own position instead of going back to deleted links.
        wait_for(
            lambda: any(e["event"] == "marker_behind_committed_position" for e in log_events(rig.daemon_err)),
            60,
            "the daemon to see the Stop record behind its position",
        )
    _finish(rig)


DAEMON_POINTS = [
    "daemon.switch.before_commit@1",  # ACTIVE -> PASSIVE at the TryStart, before its commit
    "daemon.switch.committed@1",  # ... committed, links not yet deleted
    "daemon.switch.before_commit@2",  # PASSIVE -> ACTIVE at the Stop record
    "daemon.switch.committed@2",
]


@pytest.mark.parametrize("point", DAEMON_POINTS)
def test_daemon_killed_at_a_step_of_its_mode_change(rig_factory: Any, point: str) -> None:
    rig: Rig = rig_factory(realtime_cdc=False)
    rig.start_node(pause_ms=30)
    rig.start_daemon(failpoints=point)  # a fresh daemon asks the node: ACTIVE from the start, no switch
    rig.wait_mode("off", "ACTIVE")
    _delivering(rig)
    _send(rig, "on")
    if point.endswith("@2"):
        rig.wait_mode("on", "PASSIVE")
        _delivering(rig)
        _send(rig, "off")
    rig.daemon_died(timeout=60)
    rig.wait_written(1)  # the node keeps writing while no daemon runs (observed, not slept for)
    rig.start_daemon()
    rig.wait_mode("off" if point.endswith("@2") else "on", "ACTIVE" if point.endswith("@2") else "PASSIVE")
    _finish(rig)
