"""`cdcd control cdc off` with realtime CDC on (issue 28, item 6), end to end with real processes.

As Ignite's ``cdc.disabled`` does, `cdc off` stops the node's realtime capture too: the node writes
its Stop record into a segment that is still linked, so the PASSIVE daemon takes over from the
node's last position and delivers up to the switch. What is archived while CDC is off is the
documented gap (daemon exit 3, ``missing segment N``, recovered with ``relink-lost-segments``);
`realtime on` is refused until `cdc on`, and then hands over as usual. The reference is the WAL:
each side's file must be exactly the share its markers give it (``check_delivery``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from cdcd.node import Node
from cdcd.node.attach import AttachError
from cdcd.wal.records import StopRealtimeCdcRecord
from tests.support.config import jsonl_consumer
from tests.support.procs import cdcd, error_lines, wait_for
from tests.support.realtime import Rig, check_delivery, entries_in, markers, rig_maker


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


def _skipped_links(rig: Rig) -> list[int]:
    return [int(e["segment"]) for e in rig.node_log_events() if e.get("event") == "cdc_link_skipped"]


def test_cdc_off_stops_realtime_and_the_gap_is_recovered_exactly_once(rig_factory: Any) -> None:
    """Realtime on, write, `cdc off` (realtime stops: the daemon takes over up to the switch), write, restart the
    daemon, `cdc on`, write: the daemon stops at the gap with exit 3, relink-lost-segments gives it back, realtime
    on again hands over to the node. Every entry of the WAL is delivered exactly once, by the side its markers name."""
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=20)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.wait_delivered("node", 300)

    answer = rig.control("cdc", "off")
    # The node no longer delivers: the daemon does, from the node's last position, up to the switch.
    st = rig.wait_mode("off", "ACTIVE", stops={"cdc_off": 1})
    assert st["cdc"] == "off" and st["delivering"] == "daemon"
    assert "realtime capture stopped" in answer, answer
    gap_from = int(answer.split("from WAL position ")[1].split(":")[0])
    # Nothing left to stop, and nothing starts while CDC is off.
    assert rig.control("realtime", "off").strip() == "realtime: off"
    refused = cdcd("control", "--node-dir", str(rig.node_dir), "realtime", "on")
    assert refused.returncode != 0 and "cdcd control cdc on" in refused.stderr, refused.stderr
    assert rig.status()["realtime"]["mode"] == "off"

    rig.wait_written(2)  # archived unlinked: the gap
    # The daemon delivers everything up to the gap, across a restart.
    wait_for(lambda: rig.daemon_position() == (gap_from, 0, 0), 30, f"the daemon at {gap_from}:0#0")
    rig.stop_daemon()
    rig.start_daemon()
    wait_for(lambda: rig.daemon_position() == (gap_from, 0, 0), 30, f"the restarted daemon at {gap_from}:0#0")

    rig.control("cdc", "on")
    daemon = rig.daemon
    assert daemon is not None
    wait_for(lambda: daemon.poll() is not None, 60, "the daemon to stop at the gap")
    assert daemon.returncode == 3, rig.daemon_err.read_text()[-3000:]
    assert any(f"missing segment {gap_from}" in line for line in error_lines(rig.daemon_err))
    rig.daemon = None
    skipped = _skipped_links(rig)
    assert skipped and skipped[0] == gap_from and skipped == list(range(gap_from, gap_from + len(skipped)))

    res = cdcd("control", "relink-lost-segments", "--config", str(rig.daemon_config), "--yes")
    assert res.returncode == 0, res.stderr
    assert f"({gap_from}..{skipped[-1]})" in res.stdout, res.stdout
    rig.start_daemon()
    rig.switch_on()  # passes the TryStart only once the daemon delivered the re-linked gap
    rig.wait_delivered("node", 300)
    rig.stop_node(drained=True)
    assert rig.final_status()["realtime"]["stops"] == {"cdc_off": 1}
    rig.stop_daemon()

    _node_exp, daemon_exp, intervals = check_delivery(rig)
    stops = [rec.reason for _, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert stops == ["node_start_realtime_off", "cdc_off"]
    # The daemon's stretch from `cdc off` to `realtime on` holds the gap's entries.
    (a, b) = intervals[-1]
    assert b is not None and a[0] < gap_from <= skipped[-1] < b[0]
    assert entries_in(daemon_exp, (gap_from, 0, 0), (skipped[-1] + 1, 0, 0)) > 0


def test_realtime_stays_off_while_cdc_is_off_across_a_restart(tmp_path: Path) -> None:
    """`cdc off` during a try-start stops it (reason cdc_off); reopened with `realtime_cdc = true` and CDC still off,
    the node does not start realtime (one warning), `realtime on` is refused naming `cdc on`, and after `cdc on` it
    starts a try-start again."""
    settings: dict[str, Any] = {
        "realtime_cdc": True,
        "realtime_consumer": jsonl_consumer(tmp_path / "node.jsonl"),
        "wal_force_archive_timeout_ms": 0,
    }
    node_dir = tmp_path / "node"
    with Node.open(node_dir, **settings) as n:
        assert n.status()["realtime"]["mode"] == "try_start"  # no daemon passes it here
        n.cache("a").put(1, 1)
        _position, stopped = n.set_cdc_links(False)
        rt = n.status()["realtime"]
        assert stopped and (rt["mode"], rt["stops"]) == ("off", {"cdc_off": 1})
        assert n.set_cdc_links(False)[1] is False  # already off: nothing more to stop
    with structlog.testing.capture_logs() as logs, Node.open(node_dir, **settings) as n:
        assert n.status()["realtime"]["mode"] == "off"
        with pytest.raises(AttachError, match="cdcd control cdc on"):
            n.realtime.switch("on")
        assert n.set_cdc_links(True)[1] is False
        assert n.realtime.switch("on") == "try_start"
    assert [e["reason"] for e in logs if e["event"] == "realtime_not_started"] == ["cdc_off"]
    stops = [rec.reason for _, rec in markers(node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert stops[:3] == ["node_start_realtime_off", "cdc_off", "node_start_realtime_off"]
