"""One rule for the mode of a daemon that has no state and no node to ask (issue 46.5): fresh or after
`cdcd state reset`, it waits PASSIVE for the node to say who delivers (`INITIAL_MODE`). The case that makes
the rule: the node's realtime worker was delivering when the daemon's state was lost, and the node
(stopped, its metastorage out of the daemon's reach) restores realtime at its next open. An ACTIVE daemon
would deliver the links' entries beside it; the PASSIVE one delivers nothing of the node's share. Real
node and daemon processes (`tests/support/realtime.py`'s rig); the reference is the WAL's markers."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cdcd.daemon.ops import NO_ANSWER
from tests.support.procs import cdcd, log_events, state_show, wait_for
from tests.support.realtime import Rig, as_pos, check_delivery, node_realtime_state, rig_maker
from tests.support.wal import cdc_links


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


@pytest.mark.parametrize("how", ["reset", "fresh"])
def test_without_an_answer_the_daemon_waits_passive_and_never_delivers_beside_the_node(
    rig_factory: Callable[..., Rig], how: str
) -> None:
    """The node delivers (realtime on, the daemon PASSIVE); the daemon stops, the node writes on and stops,
    leaving links of entries it delivered. The daemon's state is deleted and the node's metastorage moved
    out of reach: `state reset` (or a fresh start) cannot ask anyone and picks PASSIVE. The node then
    reopens, restoring realtime, and delivers alone: the daemon's output is exactly its share by the
    protocol, and together they are the WAL's entries, each once."""
    rig = rig_factory()
    rig.start_node()
    rig.start_daemon()
    rig.wait_mode("off", "ACTIVE")
    rig.wait_delivered("daemon", 30)
    rig.switch_on()
    rig.wait_delivered("node", 30)
    rig.stop_daemon()
    rig.wait_delivered("node", 60)
    written = rig.stop_node(drained=True)
    assert node_realtime_state(rig.node_dir).enabled, "the node's realtime worker was delivering when it stopped"
    assert cdc_links(rig.node_dir), "links of the node's share are left for a daemon to misread"

    shutil.rmtree(rig.node_dir / "cdcd-state")
    meta, aside = rig.node_dir / "db" / "metastorage", rig.tmp / "metastorage-aside"
    meta.rename(aside)
    if how == "reset":
        res = cdcd("state", "reset", "--config", str(rig.daemon_config), "--yes")
        assert res.returncode == 0, res.stderr
        assert f"reset to  PASSIVE at {min(cdc_links(rig.node_dir))}:0#0 (mode from {NO_ANSWER})" in res.stdout
    rig.start_daemon()
    if how == "fresh":
        assert "daemon_without_state_waits" in [e["event"] for e in log_events(rig.daemon_err)]
    assert state_show(rig.daemon_config)["mode"] == "PASSIVE"
    aside.rename(meta)

    rig.start_node(first_tx=written)
    rig.wait_delivered("node", 60)
    rig.stop_node(drained=True)
    last = node_realtime_state(rig.node_dir).position
    assert last is not None
    wait_for(lambda: rig.daemon_position() == as_pos(last), 60, f"the daemon to commit the node's {last}")
    assert state_show(rig.daemon_config)["mode"] == "PASSIVE"
    rig.stop_daemon()
    check_delivery(rig)
