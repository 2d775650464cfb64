"""At a restart in realtime mode: does the consumer's target still hold what the node delivered?

A target restored from a backup, or missing its newest commits (the lake's ``changes`` table), holds less
than the node's consumer confirmed. Before delivering again, the worker asks its consumer
(``Consumer.resume_at``) with the last data record it delivered, as the daemon does at its start. When the
target is behind, the worker does not deliver: it hands delivery to the daemon with a Stop record carrying
that record (``StopRealtimeCdcRecord.delivered``). The PASSIVE daemon turns ACTIVE there, asks its consumer
the same question, and its rewind (``cdcd/daemon/rewind.py``) lands again what the target lost, from the
node's archive, or stops with one line (exit 9) when the archive lost it too. Re-landing on the node side
would need a Stop behind the daemon's committed position if it were cut short (overflow, ``realtime off``,
close), which the crash rule forbids (``marker_behind_committed_position``); the daemon already re-reads
the archive, at any size, with its memory bounded by its queues.
"""

from __future__ import annotations

import structlog

from cdcd.consumer import Consumer, ResumeAt
from cdcd.logging import describe
from cdcd.node.metastorage import RealtimeState

log = structlog.get_logger("cdcd.realtime")

TARGET_BEHIND = "target_behind"
"""Stop reason: the target holds less than the node delivered; the daemon lands it again."""
TARGET_CHECK_FAILED = "target_check_failed"
"""Stop reason: asking the target failed; the daemon asks again at its switch (and fails with the cause)."""


def target_behind(consumer: Consumer, source_node: str, saved: RealtimeState) -> str | None:
    """The Stop reason when the worker must not go on from ``saved`` (its target lost part of what was
    delivered, or cannot say), else None. One log line either way it stops."""
    delivered = saved.last_delivered
    if delivered is None:
        return None
    try:
        answer = consumer.resume_at(source_node, delivered)
    except Exception as exc:
        log.error(
            "realtime_target_check_failed",
            error=f"consumer resume_at() raised {describe(exc)}",
            detail="realtime stops; the daemon delivers (and asks its consumer again)",
        )
        return TARGET_CHECK_FAILED
    if not isinstance(answer, ResumeAt):
        return None
    log.warning(
        "realtime_target_behind",
        target=answer.holds,
        delivered=str(delivered),
        position=str(saved.position),
        resume_at=str(answer.position),
        detail="the consumer's target holds less than the node delivered (restored from a backup? newest commit "
        "deleted?): realtime stops, the daemon delivers again from the target's mark (or stops with exit 9 if "
        "the node's archive lost those records), then `realtime on` takes over again",
    )
    return TARGET_BEHIND
