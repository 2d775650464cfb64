"""What ``cdcd top`` shows, read from the three places that already expose it.

Sources, all read-only: the node's control socket (``{"cmd": "status"}``), the daemon's state
(``show_state``: LMDB opened read-only, the CDC dir listed) with the daemon's lock file read for its pid
(never locked), and the Prometheus endpoints of the node and the daemon. A source that is missing or
fails is recorded in ``Snapshot.sources`` as a short line; nothing here raises for a missing source.

``build_snapshot`` is pure (raw answers in, frozen snapshot out); ``collect`` does the reading, and
``rates`` compares two consecutive snapshots.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lmdb
import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cdcd.control import request
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.ops import show_state
from cdcd.daemon_state import DaemonState, StateRefused
from cdcd.lock import read_holder_pid
from cdcd.wal.segment import list_segments

# Prefixes of the consumer's own figures on the daemon's endpoint (lake, Kafka, replication).
CONSUMER_PREFIXES = ("cdcd_lake_", "cdcd_kafka_", "cdcd_replication_")
# Metric names holding one of these words count as trouble: retries, stalls, dead letters.
PROBLEM_WORDS = ("retries", "stall", "dead_letter", "refused", "rejected", "conflicts", "aborts")
SCRAPE_TIMEOUT_S = 2.0
CONTROL_TIMEOUT_S = 2.0

MetricsReader = Callable[[], tuple[dict[str, float] | None, str]]
"""One read of an endpoint: its samples (``name{labels}``: value) and ``ok``, or None and why not."""
StateReader = Callable[[DaemonConfig], tuple[dict[str, Any] | None, int | None, str]]
"""The daemon's state as ``cdcd state show`` gives it, the daemon's pid, and ``ok`` or why not."""


class NodeFigures(msgspec.Struct, frozen=True, kw_only=True):
    """From the control socket's status (plus the node's metrics where noted)."""

    node_id: str
    writes: str
    """``ok``, ``waiting for disk space`` or ``failed: ...`` (as the node says it)."""
    wal_position: str
    wal_segment: int
    wal_offset: int
    cdc: str
    delivering: str
    """``node`` or ``daemon`` (normalised by ``who_delivers``)."""
    realtime_mode: str
    buffer_used_bytes: int | None
    buffer_max_bytes: int | None
    buffer_max_used_bytes: int | None
    realtime_stops: dict[str, int]
    lag_segments: int | None
    lag_ms: float | None
    wal_bytes_total: float | None = None
    """Node metrics: bytes written to the WAL since the node started."""
    entries_total: float | None = None
    """Node metrics: entries (create, update, delete) since the node started."""


class DaemonFigures(msgspec.Struct, frozen=True, kw_only=True):
    """From the daemon's state, its CDC dir, its lock file and (where noted) its metrics."""

    pid: int | None
    """The running daemon's pid (from ``<node_dir>/cdcd.lock``), None when none runs."""
    fresh: bool
    """No state yet: the daemon never committed."""
    mode: str
    position: str | None
    position_parts: list[int] | None
    updated: str | None
    commits: int
    backlog_segments: int
    """Links in the CDC dir: segments the daemon has not consumed (or, in PASSIVE, not dropped) yet."""
    first_link: int | None
    last_link: int | None
    consumer_kind: str
    events_total: float | None = None
    lag_seconds: float | None = None
    segments_pending: float | None = None
    last_commit_unix_s: float | None = None


class LakeFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The lake sink's own figures, from the daemon's metrics (None where the sink has not set one yet:
    a maintenance task that never succeeded has no sample)."""

    table_version: int | None
    rows_written: float | None
    files_per_partition_max: int | None
    last_compaction_unix_s: float | None
    """End of the last successful scheduled compaction."""
    last_compaction_seconds: float | None
    """How long that compaction ran."""
    last_optimize_unix_s: float | None
    last_optimize_seconds: float | None


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    taken_unix_s: float
    sources: dict[str, str]
    """``control_socket``, ``daemon_state``, ``node_metrics``, ``daemon_metrics``: ``ok``, ``off`` or why not."""
    node: NodeFigures | None
    daemon: DaemonFigures | None
    consumer: dict[str, float]
    """The consumer's own metrics, one entry per sample (``name{labels}``)."""
    problems: dict[str, float]
    """Retries, stalls, dead letters and refusals from both endpoints, one entry per sample."""
    lake: LakeFigures | None = None
    """Read out of ``consumer`` when the daemon's consumer is a lake sink (None otherwise)."""


class Rates(msgspec.Struct, frozen=True, kw_only=True):
    """Per second, between two snapshots (None where either lacks the figure)."""

    wal_bytes_per_s: float | None
    wal_segments_per_s: float | None
    node_entries_per_s: float | None
    daemon_events_per_s: float | None
    daemon_segments_per_s: float | None


# --- reading ------------------------------------------------------------------------------------
def who_delivers(status: Mapping[str, Any]) -> str:
    """``node`` or ``daemon`` from the status's ``delivering`` field.

    The one place that reads it: the field's vocabulary is being renamed (``node``/``daemon`` may
    become ``NODE_ACTIVE``/``DAEMON_ACTIVE``); anything else is shown as it is."""
    raw = str(status.get("delivering", ""))
    low = raw.lower()
    if "node" in low:
        return "node"
    if "daemon" in low:
        return "daemon"
    return raw or "unknown"


def read_status(socket_path: Path) -> tuple[dict[str, Any] | None, str]:
    """The node's status reply and ``ok``, or None and why not."""
    try:
        reply = request(socket_path, {"cmd": "status"}, timeout_s=CONTROL_TIMEOUT_S)
    except FileNotFoundError:
        return None, f"{socket_path}: no control socket (node not running)"
    except ConnectionRefusedError:
        return None, f"{socket_path}: nobody answers (node not running)"
    except (OSError, msgspec.DecodeError) as exc:
        return None, f"{socket_path}: {type(exc).__name__}: {exc}"
    if not reply.get("ok"):
        return None, f"{socket_path}: {reply.get('error')}"
    return reply, "ok"


def read_state(config: DaemonConfig) -> tuple[dict[str, Any] | None, int | None, str]:
    """``cdcd state show``'s dict, the running daemon's pid, and ``ok`` or why the state is unreadable."""
    pid = read_holder_pid(Path(config.node_dir) / "cdcd.lock")
    if pid is not None and not os.path.exists(f"/proc/{pid}"):
        pid = None  # a SIGKILLed daemon leaves its pid in the file
    try:
        return show_state(config), pid, "ok"
    except (StateRefused, OSError, lmdb.Error) as exc:  # shown in the view; read again next time
        return None, pid, f"{type(exc).__name__}: {exc}"


def scrape(address: str) -> tuple[dict[str, float] | None, str]:
    """One scrape of ``http://address/metrics`` as ``{"name{labels}": value}``, or None and why not."""
    if not address:
        return None, "off"
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        return None, f"{address}: {exc}"
    try:
        return parse_metrics(text), "ok"
    except ValueError as exc:
        return None, f"{address}: not Prometheus text ({exc})"


def parse_metrics(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return samples


def metric(samples: Mapping[str, float] | None, name: str) -> float | None:
    """The sum of every sample named ``name`` (any labels), None when there is none."""
    if samples is None:
        return None
    found = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None


def read_registries(*registries: CollectorRegistry) -> tuple[dict[str, float] | None, str]:
    """What a metrics listener would serve of ``registries``: for a node or daemon in this process."""
    samples: dict[str, float] = {}
    for registry in registries:
        samples.update(parse_metrics(generate_latest(registry).decode()))
    return samples, "ok"


def running_state(config: DaemonConfig, state: DaemonState, consumer_kind: str) -> dict[str, Any]:
    """What ``read_state`` gives (the keys top reads) for a daemon running in this process: LMDB refuses
    a second open of an environment in one process, so its state comes from the daemon itself."""
    links, _ = list_segments(config.cdc_path)
    pos = state.position
    return {
        "fresh": state.commits == 0,
        "mode": state.mode.value,
        "position": str(pos) if pos else None,
        "position_parts": msgspec.to_builtins(pos) if pos else None,
        "updated": datetime.fromtimestamp(state.updated_ns / 1e9, UTC).isoformat() if state.updated_ns else None,
        "commits": state.commits,
        "links": len(links),
        "first_link": min(links) if links else None,
        "last_link": max(links) if links else None,
        "consumer": {"kind": consumer_kind},
    }


def collect(
    node_dir: Path,
    config: DaemonConfig,
    node_metrics_address: str,
    *,
    state_reader: StateReader = read_state,
    node_metrics: MetricsReader | None = None,
    daemon_metrics: MetricsReader | None = None,
) -> Snapshot:
    """Read the three sources once. A node or daemon in this process (``make run``) is read through
    ``state_reader`` and the metrics readers instead of its LMDB file and its listeners."""
    status, status_src = read_status(node_dir / "control.sock")
    state, pid, state_src = state_reader(config)
    node_m, node_m_src = node_metrics() if node_metrics else scrape(node_metrics_address)
    daemon_m, daemon_m_src = daemon_metrics() if daemon_metrics else scrape(config.metrics_address)
    sources = {
        "control_socket": status_src,
        "daemon_state": state_src,
        "node_metrics": node_m_src,
        "daemon_metrics": daemon_m_src,
    }
    return build_snapshot(
        time.time(), sources=sources, status=status, state=state, daemon_pid=pid, node_m=node_m, daemon_m=daemon_m
    )


# --- building -----------------------------------------------------------------------------------
def _position_parts(text: str) -> tuple[int, int]:
    """(segment, offset) of a position as status prints it (``5:40`` or ``79:0#0``)."""
    seg, _, rest = text.partition(":")
    return int(seg), int(rest.partition("#")[0] or 0)


def _node_figures(status: Mapping[str, Any], node_m: Mapping[str, float] | None) -> NodeFigures:
    rt = status.get("realtime") or {}
    segment, offset = _position_parts(str(status["wal_position"]))
    return NodeFigures(
        node_id=str(status.get("node_id", "")),
        writes=str(status.get("writes", "unknown")),
        wal_position=str(status["wal_position"]),
        wal_segment=segment,
        wal_offset=offset,
        cdc=str(status.get("cdc", "unknown")),
        delivering=who_delivers(status),
        realtime_mode=str(rt.get("mode", "unknown")),
        buffer_used_bytes=rt.get("buffer_used_bytes"),
        buffer_max_bytes=rt.get("buffer_max_bytes"),
        buffer_max_used_bytes=rt.get("buffer_max_used_bytes"),
        realtime_stops={str(k): int(v) for k, v in (rt.get("stops") or {}).items()},
        lag_segments=status.get("lag_segments"),
        lag_ms=status.get("lag_ms"),
        wal_bytes_total=metric(node_m, "cdcd_node_wal_bytes_total"),
        entries_total=metric(node_m, "cdcd_node_entries_total"),
    )


def _daemon_figures(state: Mapping[str, Any], pid: int | None, daemon_m: Mapping[str, float] | None) -> DaemonFigures:
    parts = state.get("position_parts")
    return DaemonFigures(
        pid=pid,
        fresh=bool(state.get("fresh")),
        mode=str(state.get("mode")),
        position=state.get("position"),
        position_parts=list(parts) if parts is not None else None,
        updated=state.get("updated"),
        commits=int(state.get("commits", 0)),
        backlog_segments=int(state.get("links", 0)),
        first_link=state.get("first_link"),
        last_link=state.get("last_link"),
        consumer_kind=str((state.get("consumer") or {}).get("kind", "")),
        events_total=metric(daemon_m, "cdcd_daemon_events_total"),
        lag_seconds=metric(daemon_m, "cdcd_daemon_lag_seconds"),
        segments_pending=metric(daemon_m, "cdcd_daemon_segments_pending"),
        last_commit_unix_s=metric(daemon_m, "cdcd_daemon_last_commit_timestamp_seconds"),
    )


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _lake_figures(consumer: Mapping[str, float]) -> LakeFigures | None:
    if not any(k.startswith("cdcd_lake_") for k in consumer):
        return None

    def task(name: str, which: str) -> float | None:
        return consumer.get(f'cdcd_lake_{name}{{task="{which}"}}')

    return LakeFigures(
        table_version=_int(metric(consumer, "cdcd_lake_table_version")),
        rows_written=metric(consumer, "cdcd_lake_rows_written_total"),
        files_per_partition_max=_int(metric(consumer, "cdcd_lake_files_per_partition_max")),
        last_compaction_unix_s=task("last_maintenance_timestamp_seconds", "compact"),
        last_compaction_seconds=task("last_maintenance_duration_seconds", "compact"),
        last_optimize_unix_s=task("last_maintenance_timestamp_seconds", "optimize"),
        last_optimize_seconds=task("last_maintenance_duration_seconds", "optimize"),
    )


def build_snapshot(
    taken_unix_s: float,
    *,
    sources: dict[str, str],
    status: Mapping[str, Any] | None,
    state: Mapping[str, Any] | None,
    daemon_pid: int | None,
    node_m: Mapping[str, float] | None,
    daemon_m: Mapping[str, float] | None,
) -> Snapshot:
    """The snapshot of raw answers (None for a source that did not answer)."""
    consumer = {k: v for k, v in (daemon_m or {}).items() if k.startswith(CONSUMER_PREFIXES)}
    problems = {
        k: v
        for samples in (node_m or {}, daemon_m or {})
        for k, v in samples.items()
        # A counter at zero is no problem (unlabelled ones are exported from the start).
        if v and any(word in k.partition("{")[0] for word in PROBLEM_WORDS)
    }
    return Snapshot(
        taken_unix_s=taken_unix_s,
        sources=dict(sources),
        node=_node_figures(status, node_m) if status is not None else None,
        daemon=_daemon_figures(state, daemon_pid, daemon_m) if state is not None else None,
        consumer=consumer,
        problems=problems,
        lake=_lake_figures(consumer),
    )


def daemon_lag_segments(snap: Snapshot) -> int | None:
    """Segments between the node's WAL and the daemon's committed position."""
    if snap.node is None or snap.daemon is None or not snap.daemon.position_parts:
        return None
    return max(0, snap.node.wal_segment - snap.daemon.position_parts[0])


def _per_s(new: float | None, old: float | None, dt_s: float) -> float | None:
    if new is None or old is None or dt_s <= 0:
        return None
    return max(0.0, (new - old) / dt_s)


def rates(old: Snapshot, new: Snapshot) -> Rates:
    """Rates between two consecutive snapshots (a counter that went back, a restart, reads as 0)."""
    dt = new.taken_unix_s - old.taken_unix_s
    on, nn, od, nd = old.node, new.node, old.daemon, new.daemon
    old_seg = od.position_parts[0] if od is not None and od.position_parts else None
    new_seg = nd.position_parts[0] if nd is not None and nd.position_parts else None
    return Rates(
        wal_bytes_per_s=_per_s(nn.wal_bytes_total if nn else None, on.wal_bytes_total if on else None, dt),
        wal_segments_per_s=_per_s(nn.wal_segment if nn else None, on.wal_segment if on else None, dt),
        node_entries_per_s=_per_s(nn.entries_total if nn else None, on.entries_total if on else None, dt),
        daemon_events_per_s=_per_s(nd.events_total if nd else None, od.events_total if od else None, dt),
        daemon_segments_per_s=_per_s(new_seg, old_seg, dt),
    )
