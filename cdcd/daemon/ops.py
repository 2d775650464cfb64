"""Operator commands on a daemon's state: ``state show``, ``state reset``, ``delete-lost-segment-links``."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import structlog

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import daemon_lock
from cdcd.daemon.follower import delete_links_below
from cdcd.daemon.lane import INVALIDATED_FILE, STOPPED_FILE
from cdcd.daemon.processor import INITIAL_MODE, start_from_node
from cdcd.daemon.source import ask_node, node_caches
from cdcd.daemon_state import DaemonState, StateDamaged, StateStore, delivered_by
from cdcd.delivery import record_entries
from cdcd.durable import fsync_dir
from cdcd.faults import ExitCode, Fault
from cdcd.node.identity import read_node_id
from cdcd.secrets import mask_mapping
from cdcd.wal.errors import WalError
from cdcd.wal.pointer import WalPosition
from cdcd.wal.reader import SegmentReader, check_record_start
from cdcd.wal.records import CacheInfo
from cdcd.wal.segment import list_segments, segment_name

log = structlog.get_logger("cdcd.daemon")


def show_state(config: DaemonConfig) -> dict[str, Any]:
    """The committed state and the CDC dir as plain data (works while the daemon runs): the top-level keys
    are the ``default`` (else the first) consumer's; ``consumers`` has every consumer's, by name."""
    tables = config.named_consumers()
    sizes = _link_sizes(config.cdc_path)
    consumers = {}
    for name in tables:
        one = config.for_consumer(name)
        info = _show_one(one)
        info["realtime"] = name == config.handover_consumer
        info["retained_bytes"] = _retained(info, sizes)
        consumers[name] = info
    first = next(iter(tables))
    out = _show_one(config.for_consumer(first))
    out["consumers"] = consumers
    return out


def _link_sizes(cdc_dir: Path) -> dict[int, int]:
    links, _ = list_segments(cdc_dir)
    sizes = {}
    for seg, path in links.items():
        with contextlib.suppress(FileNotFoundError):  # deleted by the running daemon since the listing
            sizes[seg] = path.stat().st_size
    return sizes


def _retained(info: dict[str, Any], sizes: dict[int, int]) -> int:
    """Bytes of the links from the consumer's position on (0 once invalidated: it holds none)."""
    if info["invalidated"]:
        return 0
    parts = info["position_parts"]
    return sum(n for seg, n in sizes.items() if parts is None or seg >= parts[0])


def _show_one(config: DaemonConfig) -> dict[str, Any]:
    try:
        store = StateStore(config.state_path, readonly=True)
    except FileNotFoundError:
        state, caches = DaemonState(INITIAL_MODE), {}
        fresh = True
    else:
        try:
            state, caches = store.load(INITIAL_MODE), store.caches()
        finally:
            store.close()
        fresh = False
    links, refused = list_segments(config.cdc_path)
    pos = state.position
    return {
        "state_dir": str(config.state_path),
        "fresh": fresh,
        "delivered_by": delivered_by(state.mode),
        "mode": state.mode.value,
        "cdc_mode": state.mode.name,
        "node_id": state.node_id or None,
        "position": str(pos) if pos else None,
        "position_parts": msgspec.to_builtins(pos) if pos else None,
        "updated": datetime.fromtimestamp(state.updated_ns / 1e9, UTC).isoformat() if state.updated_ns else None,
        "commits": state.commits,
        "caches": {str(cid): info.name for cid, info in sorted(caches.items())},
        "cdc_dir": str(config.cdc_path),
        "links": len(links),
        "first_link": min(links) if links else None,
        "last_link": max(links) if links else None,
        "ignored_files": [p.name for p in refused],
        "consumer": mask_mapping(config.consumer),
        "identity": state.consumer or None,
        "stopped": _record(config.state_path / STOPPED_FILE),
        "invalidated": _record(config.state_path / INVALIDATED_FILE),
    }


def _record(path: Path) -> dict[str, Any] | None:
    """``stopped.json`` or ``invalidated.json`` of a consumer's state dir (None: there is none)."""
    try:
        found: dict[str, Any] = msgspec.json.decode(path.read_bytes())
    except (FileNotFoundError, msgspec.DecodeError):
        return None
    return found


def list_consumers(config: DaemonConfig) -> list[dict[str, Any]]:
    """Every consumer of the config, then every consumer state no longer in it (``in_config`` False): its
    identity, position, mode, whether it stopped or was invalidated, and the link bytes it holds."""
    sizes = _link_sizes(config.cdc_path)
    shown = show_state(config)["consumers"]
    out = []
    for name, info in shown.items():
        out.append({"name": name, "in_config": True, **_holds(info, sizes)})
    named = config.state_path / "consumers"
    for path in sorted(named.iterdir()) if named.is_dir() else []:
        if path.name in shown or not (path / "data.mdb").exists():
            continue
        one = msgspec.structs.replace(
            config, state_dir=str(path), consumer={"kind": "null"}, consumers={}, has_default_consumer=True
        )
        info = {**_show_one(one), "realtime": False}
        out.append({"name": path.name, "in_config": False, **_holds(info, sizes)})
    return out


def _holds(info: dict[str, Any], sizes: dict[int, int]) -> dict[str, Any]:
    return {**info, "invalidated": info["invalidated"] is not None, "holds_bytes": _retained(info, sizes)}


class DropRefused(Fault, Exception):
    """``state drop-consumer`` of a consumer the config still names, or of ``default``."""

    exit_code = ExitCode.BAD_INPUT


def drop_consumer(config: DaemonConfig, name: str) -> tuple[Path, list[int]]:
    """With the daemon stopped: forget a consumer removed from the config (its state dir), then delete the
    links no configured consumer needs any more. Returns (the state dir removed, the links deleted)."""
    if name in config.named_consumers():
        raise DropRefused(f"consumer {name} is in the config ({config.consumer_key(name)}): remove it there first")
    path = config.consumer_state_path(name)
    if name == "default" or not (path / "data.mdb").exists():
        raise DropRefused(f"no state of a removed consumer {name!r} in {config.state_path / 'consumers'}")
    lock = daemon_lock(config)
    lock.acquire(0)
    try:
        shutil.rmtree(path)
        fsync_dir(path.parent)
        positions = [_show_one(config.for_consumer(n))["position_parts"] for n in config.named_consumers()]
        deleted: list[int] = []
        if positions and all(p is not None for p in positions):
            deleted = delete_links_below(config.cdc_path, min(p[0] for p in positions))
        log.info("consumer_dropped", consumer=name, state_dir=str(path), links_deleted=len(deleted))
        return path, deleted
    finally:
        lock.release()


@dataclass
class LostLinksPlan:
    run_start: int | None
    run_end: int | None
    to_delete: list[int]
    old_position: WalPosition | None


def plan_lost_links(config: DaemonConfig) -> LostLinksPlan:
    """Keep the newest contiguous run of links; everything before the gap goes.

    A gap can also lie between the committed position and the oldest link (the links before it
    were consumed and deleted): then nothing is deleted but the position still moves.
    """
    links, _ = list_segments(config.cdc_path)
    position = show_position(config)
    if not links:
        return LostLinksPlan(None, None, [], position)
    segs = sorted(links)
    start = segs[-1]
    while start - 1 in links:
        start -= 1
    return LostLinksPlan(start, segs[-1], [s for s in segs if s < start], position)


def show_position(config: DaemonConfig) -> WalPosition | None:
    """The lowest committed position of the daemon's consumers (None: none yet); the one of a daemon of one."""
    positions = []
    for name in config.named_consumers():
        one = config.for_consumer(name)
        try:
            store = StateStore(one.state_path, readonly=True)
        except FileNotFoundError:
            continue
        try:
            position = store.load(INITIAL_MODE).position
        finally:
            store.close()
        if position is not None:
            positions.append(position)
    return min(positions, default=None)


def plan_needs_work(plan: LostLinksPlan) -> bool:
    if plan.run_start is None:
        return False
    behind = plan.old_position is not None and plan.old_position.segment < plan.run_start
    return bool(plan.to_delete) or behind


def delete_lost_segment_links(config: DaemonConfig, plan: LostLinksPlan) -> DaemonState:
    """Carry out ``plan`` under the daemon's lock: delete links before the gap, reset the position."""
    lock = daemon_lock(config)
    lock.acquire(0)
    try:
        links, _ = list_segments(config.cdc_path)
        for seg in plan.to_delete:
            path = links.get(seg)
            if path is not None:
                path.unlink()
        run_start = WalPosition(plan.run_start, 0, 0) if plan.run_start is not None else None
        first: DaemonState | None = None
        for i, name in enumerate(config.named_consumers()):  # every consumer's position past the gap
            one = config.for_consumer(name)
            if i and not (one.state_path / "data.mdb").exists():
                continue  # a consumer without a state yet starts at the oldest link anyway
            store = StateStore(one.state_path)
            try:
                state = store.load(INITIAL_MODE)
                if first is None:
                    plan.old_position = state.position
                position = run_start
                if state.position is not None and position is not None and state.position > position:
                    position = state.position  # never move a position backwards past what was delivered
                state = store.commit(msgspec.structs.replace(state, position=position))
                first = first or state
            finally:
                store.close()
        assert first is not None
        return first
    finally:
        lock.release()


@dataclass
class RelinkPlan:
    start: int | None
    """First segment the daemon still needs (its position's segment, or the oldest link)."""
    relink: list[int]
    """Segments with no link that the node's archive still has: re-linked, nothing is lost."""
    gone: list[int]
    """Segments with neither: only ``delete-lost-segment-links`` and ``resend`` get past those."""


def plan_relink(config: DaemonConfig, archive: Path) -> RelinkPlan:
    """Which missing links the node's archive can restore (links are hard links of archive files)."""
    links, _ = list_segments(config.cdc_path)
    archived, _ = list_segments(archive)
    position = show_position(config)
    start = position.segment if position is not None else (min(links) if links else None)
    if start is None:
        return RelinkPlan(None, [], [])
    end = max([*links, *archived], default=-1)
    missing = [s for s in range(start, end + 1) if s not in links]
    return RelinkPlan(start, [s for s in missing if s in archived], [s for s in missing if s not in archived])


def relink_lost_segments(config: DaemonConfig, archive: Path, plan: RelinkPlan) -> list[int]:
    """Hard-link ``plan.relink`` back into the CDC dir, under the daemon's lock; returns what was linked."""
    lock = daemon_lock(config)
    lock.acquire(0)
    try:
        archived, _ = list_segments(archive)
        done = []
        for seg in plan.relink:
            src = archived.get(seg)
            if src is None:  # retention removed it meanwhile
                continue
            try:
                os.link(src, config.cdc_path / segment_name(seg), follow_symlinks=False)
            except FileExistsError:
                continue  # the node linked it itself meanwhile
            done.append(seg)
        if done:
            fsync_dir(config.cdc_path)
        return done
    finally:
        lock.release()


@dataclass
class ResetPlan:
    old: DaemonState | None
    """The state as it was (None: none, or unreadable)."""
    damaged: str | None
    """Why the old state is unreadable (it is moved aside, not deleted)."""
    new: DaemonState
    caches: dict[int, CacheInfo]
    caches_from: str
    mode_from: str


class ResetRefused(Fault, ValueError):
    """``--to`` names no position the CDC dir can deliver from."""

    exit_code = ExitCode.BAD_INPUT


NO_ANSWER = (
    "the node neither answers nor has a realtime state: PASSIVE until it writes a Stop record, at its next start, "
    "as a fresh daemon waits"
)
"""Where ``state reset``'s mode came from when nothing could say who delivers."""


def plan_reset(config: DaemonConfig, to: WalPosition | None) -> ResetPlan:
    """The state ``state reset`` would write: position ``to`` (checked against the links) or the oldest link;
    the mode the node says (its realtime worker delivers: PASSIVE), else the old state's, else
    ``INITIAL_MODE`` (PASSIVE), as a daemon that starts without state and cannot ask its node."""
    old: DaemonState | None = None
    caches: dict[int, CacheInfo] = {}
    damaged = None
    try:
        store = StateStore(config.state_path, readonly=True)
    except FileNotFoundError:
        pass
    except StateDamaged as exc:
        damaged = str(exc)
    else:
        try:
            old, caches = store.load(INITIAL_MODE), store.caches()
        except StateDamaged as exc:
            damaged = str(exc)
        finally:
            store.close()
    links, _ = list_segments(config.cdc_path)
    if to is None:
        position = WalPosition(min(links), 0, 0) if links else None
    else:
        position = _check_reset_position(config, links, to)
    caches_from = "old state"
    if old is None:
        caches, caches_from = _node_caches(config)
    node = ask_node(config.node())
    if node is not None:
        mode, mode_from = start_from_node(node.realtime_on, None, None)[0], node.source
    elif old is not None:
        mode, mode_from = old.mode, "old state"
    else:
        # The same rule as a fresh daemon's (``INITIAL_MODE``): ACTIVE here could deliver beside a node
        # that restores realtime at its next open; PASSIVE waits for the Stop record every open writes.
        mode, mode_from = INITIAL_MODE, NO_ANSWER
    node_id = read_node_id(config.node_dir)
    new = DaemonState(
        mode,
        position,
        commits=old.commits if old else 0,
        node_id=str(node_id) if node_id else (old.node_id if old else ""),
    )
    return ResetPlan(old, damaged, new, caches, caches_from, mode_from)


def _check_reset_position(config: DaemonConfig, links: dict[int, Path], to: WalPosition) -> WalPosition:
    path = links.get(to.segment)
    if path is None:
        have = f"links {min(links)}..{max(links)}" if links else "no links"
        raise ResetRefused(f"--to {to}: segment {to.segment} has no link in {config.cdc_path} ({have})")
    try:
        start = check_record_start(path, to.offset)
    except WalError as exc:
        raise ResetRefused(f"--to {to}: {exc}") from None
    if to.entry_index:
        entries = next((record_entries(r) for p, r in SegmentReader(path, start_offset=start) if p.offset == start), 0)
        if to.entry_index >= entries:
            raise ResetRefused(f"--to {to}: the record at {path} offset {start} has {entries} entr(y/ies)")
    return WalPosition(to.segment, start if to.entry_index else to.offset, to.entry_index)


def _node_caches(config: DaemonConfig) -> tuple[dict[int, CacheInfo], str]:
    return node_caches(config.node())


def reset_state(config: DaemonConfig, plan: ResetPlan) -> tuple[DaemonState, Path | None]:
    """Write ``plan.new`` under the daemon's lock; an unreadable state is moved aside first (returned)."""
    lock = daemon_lock(config)
    lock.acquire(0)
    try:
        moved = None
        data = config.state_path / "data.mdb"
        if plan.damaged is not None and data.exists():
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            moved = data.with_name(f"data.mdb.damaged-{stamp}")
            os.replace(data, moved)
            with contextlib.suppress(FileNotFoundError):
                (config.state_path / "lock.mdb").unlink()
            fsync_dir(config.state_path)
        store = StateStore(config.state_path)
        try:
            gone = [cid for cid in store.caches() if cid not in plan.caches]
            state = store.commit(plan.new, caches=plan.caches, destroyed=gone)
        finally:
            store.close()
        for name in (INVALIDATED_FILE, STOPPED_FILE):  # the consumer is tried again from its new position
            with contextlib.suppress(FileNotFoundError):
                (config.state_path / name).unlink()
        log.info(
            "state_reset",
            state_dir=str(config.state_path),
            old_position=str(plan.old.position) if plan.old and plan.old.position else None,
            old_mode=plan.old.mode.value if plan.old else None,
            damaged=plan.damaged,
            moved_aside=str(moved) if moved else None,
            position=str(state.position) if state.position else None,
            mode=state.mode.value,
            cdc_mode=state.mode.name,
            mode_from=plan.mode_from,
            caches=len(plan.caches),
            caches_from=plan.caches_from,
        )
        return state, moved
    finally:
        lock.release()
