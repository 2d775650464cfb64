"""The node's control-socket commands (``cdcd control``) and its status."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cdcd.control import ControlError
from cdcd.daemon_state import CdcMode, read_daemon_state
from cdcd.node.attach import AttachError
from cdcd.node.config import CONSUMER_NAME, DEFAULT_CONSUMER
from cdcd.node.diff import digests
from cdcd.secrets import mask_mapping
from cdcd.wal.pointer import WalPointer, WalPosition

if TYPE_CHECKING:
    from cdcd.node.node import Node


def status(node: Node) -> dict[str, Any]:
    """What ``cdcd control status`` prints: realtime state, daemon state, lag."""
    config = node.config
    rt = node.realtime.status()
    wal_pos = node.wal.position
    default = read_daemon_state(config.daemon_state_path)
    daemon = _handover_state(node, default)
    cdc_mode = CdcMode.NODE_ACTIVE if rt["mode"] == "on" else CdcMode.DAEMON_ACTIVE
    node_active = cdc_mode is CdcMode.NODE_ACTIVE
    committed = node.realtime.position if node_active else _daemon_position(daemon)
    lag_ms = None
    if node_active and rt["last_event_commit_ts_ns"]:
        lag_ms = max(0.0, (time.time_ns() - rt["last_event_commit_ts_ns"]) / 1e6)
    return {
        "consumers": consumers(node, default, node_active, wal_pos),
        "node_dir": config.node_dir,
        "node_id": str(node.node_id),
        "writes": node.writes_state(),
        "wal_position": str(wal_pos),
        "last_archived_segment": node.wal.last_archived,
        "cdc": "on" if node.cdc_links_on else "off" if config.cdc_enabled else "disabled in config",
        "cdc_links_skipped": node.cdc_links_skipped,
        "realtime": rt,
        "daemon": daemon,
        "cdc_mode": cdc_mode.name,
        "delivering": "node" if node_active else "daemon",
        "lag_segments": max(0, wal_pos.segment - committed.segment) if committed is not None else None,
        "lag_ms": lag_ms,
        "realtime_consumer": mask_mapping(config.realtime_consumer),
        "cluster_id": config.cluster_id,
        "replication": node.replication.status() if node.replication is not None else None,
    }


def _handover_state(node: Node, default: dict[str, Any] | None) -> dict[str, Any] | None:
    """The state of the daemon's consumer the realtime worker hands over with (``[realtime_consumer] name``): what
    the single-consumer keys ``daemon`` and ``lag_segments`` describe."""
    config = node.config
    name = config.realtime_consumer_name if config.realtime_consumer else DEFAULT_CONSUMER
    if name == DEFAULT_CONSUMER:
        return default
    path = config.daemon_state_path / "consumers" / name  # the daemon's layout (DaemonConfig.consumer_state_path)
    return read_daemon_state(path) if (path / "data.mdb").is_file() else None


def consumers(
    node: Node, default: dict[str, Any] | None, node_active: bool, wal_pos: WalPointer
) -> dict[str, dict[str, Any]]:
    """Per consumer of the daemon (its states in ``daemon_state_dir``, and the one ``[realtime_consumer]``
    names): who delivers it (``delivered_by``: ``realtime``, the node's realtime worker, or ``daemon``, from
    the archive), its committed position and its lag in segments."""
    config = node.config
    states: dict[str, dict[str, Any] | None] = {DEFAULT_CONSUMER: default} if default is not None else {}
    named = config.daemon_state_path / "consumers"  # the daemon's layout (DaemonConfig.consumer_state_path)
    for path in sorted(named.iterdir()) if named.is_dir() else []:
        if CONSUMER_NAME.fullmatch(path.name) and (path / "data.mdb").is_file():
            states[path.name] = read_daemon_state(path)
    realtime = config.realtime_consumer_name if config.realtime_consumer else None
    if realtime is not None:
        states.setdefault(realtime, None)
    out = {}
    for name, state in sorted(states.items()):
        by_realtime = name == realtime and node_active
        committed = node.realtime.position if by_realtime else _daemon_position(state)
        out[name] = {
            "delivered_by": "realtime" if by_realtime else "daemon",
            "realtime_consumer": name == realtime,
            "position": str(committed) if committed is not None else None,
            "lag_segments": max(0, wal_pos.segment - committed.segment) if committed is not None else None,
        }
    return out


def _daemon_position(daemon: dict[str, Any] | None) -> WalPosition | None:
    if daemon is None or daemon["position_parts"] is None:
        return None
    return WalPosition(*daemon["position_parts"])


def handle(node: Node, req: dict[str, Any]) -> dict[str, Any]:
    """One control request (``{"cmd": ...}``); a refusal is a ControlError."""
    cmd = req["cmd"]
    if cmd == "realtime":
        try:
            switched = node.realtime.switch(str(req.get("state")))
        except AttachError as exc:
            raise ControlError(str(exc)) from None
        return {"realtime": switched, "consumer": node.config.realtime_consumer_name}
    if cmd == "cdc":
        state = req.get("state")
        if state not in ("on", "off"):
            raise ControlError("cdc: state must be 'on' or 'off'")
        try:
            position, realtime_stopped = node.set_cdc_links(state == "on")
        except (ValueError, AttachError) as exc:
            raise ControlError(str(exc)) from None
        return {"cdc": state, "wal_position": str(position), "realtime_stopped": realtime_stopped}
    if cmd == "status":
        return status(node)
    if cmd == "digest":
        return {"caches": digests(node)}
    if cmd == "resend":
        cache = req.get("cache")
        if not isinstance(cache, str):
            raise ControlError('resend: expected {"cache": NAME}')
        try:
            return {"resent": node.resend(cache), "cache": cache}
        except ValueError as exc:
            raise ControlError(str(exc)) from None
    raise ControlError(f"unknown command {cmd!r} (one of: realtime, cdc, status, resend, digest)")
