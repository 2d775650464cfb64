"""The daemon's position moved back to where its consumer's target stops holding what was delivered.

A target restored from a backup, or missing its newest commits (the lake's ``changes`` table), holds
less than the daemon committed. At start the daemon asks the consumer (``Consumer.resume_at``) with
the last data record it delivered (``DaemonState.last_delivered``, exact where the position is not:
markers and cache records move the position too). When the target is behind, the records from its
mark on are delivered again: from the CDC dir's links, hard-linked back from the node's archive
where the links are already deleted; the consumer drops what it holds. When the WAL no longer has
them, the daemon stops with one line (exit 9), never going on past the loss. The same check runs at
every switch to ACTIVE, with the last record the node's realtime worker delivered (carried by its Stop
record): a target restored while the node delivered is landed again by the daemon taking over.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import structlog

from cdcd import metrics
from cdcd.consumer import Consumer, ResumeAt
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.durable import fsync_dir
from cdcd.faults import ExitCode, Fault
from cdcd.logging import describe
from cdcd.wal.segment import list_segments, segment_name

log = structlog.get_logger("cdcd.daemon")

ACCEPT_LOSS_HINT = (
    "restore the target from a newer backup, or accept the loss: stop the daemon, run `cdcd state reset`, "
    "then `cdcd control resend <cache>` for each cache to land its current entries again"
)


class TargetBehind(Fault, Exception):
    """The consumer's target lost records the daemon delivered, and the WAL no longer has them."""

    exit_code = ExitCode.TARGET_BEHIND
    hint = ACCEPT_LOSS_HINT


class ResumeFailed(Fault, Exception):
    """The consumer's ``resume_at`` raised."""

    exit_code = ExitCode.CONSUMER_FAILED


def _ask(consumer: Consumer, source_node: str, state: DaemonState) -> ResumeAt | None:
    if state.last_delivered is None:
        return None
    try:
        answer = consumer.resume_at(source_node, state.last_delivered)
    except Exception as exc:
        if isinstance(exc, Fault):
            raise
        raise ResumeFailed(f"consumer resume_at() raised {describe(exc)}") from exc
    return answer if isinstance(answer, ResumeAt) else None


def rewind(
    config: DaemonConfig, store: StateStore, state: DaemonState, consumer: Consumer, source_node: str
) -> DaemonState:
    """``state``, with its position moved back (and committed) to where the consumer's target stops
    holding what was delivered; unchanged when it holds everything or cannot tell. Only in ACTIVE: in
    PASSIVE the node's realtime worker delivers (and checks at its own restart, ``realtime/target.py``)."""
    if state.mode is not CdcMode.DAEMON_ACTIVE or state.position is None or not source_node:
        return state
    answer = _ask(consumer, source_node, state)
    if answer is None or answer.position >= state.position:
        return state
    delivered = state.last_delivered
    assert delivered is not None
    cdc_dir = config.cdc_path
    archive = config.node().archive_path
    links, _ = list_segments(cdc_dir)
    archived, _ = list_segments(archive) if archive.is_dir() else ({}, [])
    needed = range(answer.position.segment, delivered.segment + 1)
    gone = [seg for seg in needed if seg not in links and seg not in archived]
    if gone:
        span = f"{gone[0]}" if len(gone) == 1 else f"{gone[0]}..{gone[-1]}"
        raise TargetBehind(
            f"{answer.holds}, but {store.data_file} has node {source_node} delivered up to record {delivered} "
            f"(committed position {state.position}); segment(s) {span} are neither linked in {cdc_dir} nor in the "
            f"node's archive {archive}: the records after the target's mark are lost to it"
        )
    relinked = []
    for seg in needed:
        if seg in links:
            continue
        try:
            os.link(archived[seg], cdc_dir / segment_name(seg), follow_symlinks=False)
        except FileExistsError:
            continue  # the node linked it meanwhile
        relinked.append(seg)
    if relinked:
        fsync_dir(Path(cdc_dir))
        metrics.DAEMON_RELINKED_SEGMENTS.inc(len(relinked))
    metrics.DAEMON_REWINDS.inc()
    log.warning(
        "target_behind_relanding",
        target=answer.holds,
        delivered=str(delivered),
        position=str(state.position),
        resume_at=str(answer.position),
        relinked=len(relinked),
        detail="the consumer's target holds less than was delivered (restored from a backup? newest commit "
        "deleted?): delivering again from its mark; what it holds is dropped",
    )
    return store.commit(msgspec.structs.replace(state, position=answer.position))
