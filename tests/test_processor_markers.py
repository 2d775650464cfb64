"""A realtime marker the daemon reads while it delivers (ACTIVE): the node's realtime worker stopped (a restore
larger than its buffer, say) and its Stop record handed the records after it to the daemon. An expected hand-over,
logged at info level under a name saying so, never as a warning."""

from __future__ import annotations

import structlog

from cdcd.daemon.processor import MarkerCommit, Processor
from cdcd.daemon_state import CdcMode
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import RealtimeCdcRecord, StopRealtimeCdcRecord


def processor(mode: CdcMode) -> Processor:
    return Processor(
        mode=mode,
        position=WalPosition(3, 0, 0),
        caches={},
        source_node="n",
        batch_max_events=10,
        batch_max_bytes=1 << 20,
    )


def test_a_marker_passed_while_active_is_an_info_line_and_changes_nothing() -> None:
    p = processor(CdcMode.DAEMON_ACTIVE)
    with structlog.testing.capture_logs() as logs:
        items = p.feed(WalPointer(3, 40), RealtimeCdcRecord(WalPosition(3, 16, 0)), 24)
    assert items == [] and not p.finished
    assert logs == [
        {
            "event": "daemon_delivers_after_realtime_stop",
            "log_level": "info",
            "pointer": "3:40",
            "last": "3:16#0",
            "hint": "the node's realtime worker stopped; the daemon delivers what it did not",
        }
    ]


def test_a_marker_read_while_passive_commits_its_position_silently() -> None:
    p = processor(CdcMode.NODE_ACTIVE)
    with structlog.testing.capture_logs() as logs:
        items = p.feed(WalPointer(3, 40), RealtimeCdcRecord(WalPosition(3, 16, 0)), 24)
    assert items == [MarkerCommit(WalPosition(3, 16, 0))] and logs == []


def passive_at(position: WalPosition) -> Processor:
    return Processor(
        mode=CdcMode.NODE_ACTIVE,
        position=position,
        caches={},
        source_node="n",
        batch_max_events=10,
        batch_max_bytes=1 << 20,
    )


def test_a_marker_read_again_behind_the_committed_position_is_silent_and_commits_nothing() -> None:
    """Each pass starts at the committed position, a later marker's ``last``, which lies before the markers the node
    wrote while its worker delivered up to it: those are read again at every pass and are no news (a warning per
    marker per pass flooded the PASSIVE daemon's log)."""
    p = passive_at(WalPosition(3, 100, 0))
    with structlog.testing.capture_logs() as logs:
        items = p.feed(WalPointer(3, 200), RealtimeCdcRecord(WalPosition(3, 16, 0)), 24)
        items += p.feed(WalPointer(3, 240), RealtimeCdcRecord(WalPosition(3, 150, 0)), 24)
    assert items == [MarkerCommit(WalPosition(3, 150, 0))] and logs == []


def test_a_stop_naming_a_position_behind_the_committed_one_is_the_crash_rules_warning() -> None:
    """A node killed after its TryStart reached the WAL restarts with its older position and writes Stop(older), after
    the daemon's committed position: the daemon keeps its own position, warns, and delivers from there."""
    p = passive_at(WalPosition(3, 100, 0))
    with structlog.testing.capture_logs() as logs:
        items = p.feed(WalPointer(3, 200), StopRealtimeCdcRecord(WalPosition(3, 16, 0)), 24)
    assert [type(i).__name__ for i in items] == ["Switch"]
    assert items[0].position == WalPosition(3, 100, 0)  # type: ignore[union-attr]
    assert [(e["event"], e["log_level"]) for e in logs] == [("marker_behind_committed_position", "warning")]
