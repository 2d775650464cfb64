"""The state a daemon starts from: its committed one, or, with none yet, what the node says.

A state of another node is refused before anything acts on it (its position would delete this
node's links).
"""

from __future__ import annotations

import uuid

import msgspec
import structlog

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.follower import SegmentFollower
from cdcd.daemon.processor import INITIAL_MODE, start_from_node
from cdcd.daemon_state import CdcMode, DaemonState, ForeignState, StateRefused, StateStore
from cdcd.wal.records import CacheInfo

log = structlog.get_logger("cdcd.daemon")


class ForeignConsumerState(StateRefused):
    """The state's position belongs to another consumer (another kind or target) than the one configured."""


def load_start_state(
    config: DaemonConfig,
    store: StateStore,
    node_id: uuid.UUID | None,
    *,
    name: str = "default",
    identity: str = "",
    markers: bool = True,
) -> tuple[DaemonState, dict[int, CacheInfo], uuid.UUID | None]:
    """(state, cache registry, node id: ``node_id`` or the one the state names).

    ``identity``: the consumer's kind and target (``cdcd.sinks.consumer_identity``), which the state
    is bound to: a state bound to another is refused; one not bound yet (new, or written before
    consumers had names) is bound to it. ``markers`` False: a consumer the node's realtime worker never
    stands in for starts ACTIVE at the oldest link, without asking the node."""
    state = store.load(INITIAL_MODE)
    caches = store.caches()
    if identity:
        _check_consumer(config, store, state, name, identity)
    if not store.has_state():
        state = _initial_state(config, state) if markers else DaemonState(CdcMode.DAEMON_ACTIVE)
        if not caches:
            from cdcd.daemon.source import node_caches

            caches, caches_from = node_caches(config.node())
            store.commit(state, caches=caches)  # the registry stays with the state
            state = store.load(INITIAL_MODE)
            log.info("cache_registry_from_node", caches=len(caches), source=caches_from)
    state, node_id = _check_owner(config, store, state, node_id)
    if identity and state.consumer != identity:
        state = store.commit(msgspec.structs.replace(state, consumer=identity))
        log.info("consumer_state_bound", consumer=name, identity=identity, state_dir=str(store.path))
    return state, caches, node_id


def _check_consumer(config: DaemonConfig, store: StateStore, state: DaemonState, name: str, identity: str) -> None:
    """A position of another consumer is never used: it would start this one where the other stopped. A state
    that holds no position yet (its consumer failed before it delivered anything) is no one's: it is bound anew."""
    if not state.consumer or state.consumer == identity or state.position is None:
        return
    key = config.consumer_key(name)
    raise ForeignConsumerState(
        f"{store.data_file}: daemon state of consumer '{state.consumer}', but {key} is '{identity}': a "
        f"position belongs to one consumer; give this one its own state (state_dir, or run both from one daemon "
        f"as [consumers.<name>] tables: docs/daemon.md, Several consumers), or, if its target moved, "
        f"stop the daemon and run `cdcd state reset`"
    )


def _initial_state(config: DaemonConfig, state: DaemonState) -> DaemonState:
    """No state (new, deleted or emptied): ask the node who delivers rather than wait PASSIVE for a Stop
    record that a running node writes only when it opens. Its realtime worker delivers: PASSIVE. It does
    not: ACTIVE from where its realtime worker stopped, or the oldest link."""
    from cdcd.daemon.source import ask_starting_node

    node = ask_starting_node(config.node())
    if node is None:
        log.warning(
            "daemon_without_state_waits",
            node_dir=config.node_dir,
            hint="the node neither answers on its control socket nor has a metastorage; "
            "PASSIVE until it writes a Stop record (at its next start)",
        )
        return state
    links = SegmentFollower(config.cdc_path, None).scan()
    mode, position = start_from_node(node.realtime_on, node.position, min(links) if links else None)
    log.info(
        "daemon_state_from_node",
        source=node.source,
        mode=mode.value,
        cdc_mode=mode.name,
        position=str(position) if position else None,
        start="the oldest link" if position is None and mode is CdcMode.DAEMON_ACTIVE else None,
    )
    return msgspec.structs.replace(state, mode=mode, position=position)


def _check_owner(
    config: DaemonConfig, store: StateStore, state: DaemonState, node_id: uuid.UUID | None
) -> tuple[DaemonState, uuid.UUID | None]:
    """A state of another node is an error; a state that does not say whose it is yet gets this node's id."""
    if state.node_id and node_id is not None and state.node_id != str(node_id):
        raise ForeignState(
            f"{store.data_file}: daemon state of node {state.node_id}, but {config.node_dir} is node "
            f"{node_id} (node dir re-created, or state_dir of another node?); stop the daemon and run "
            "`cdcd state reset`"
        )
    if state.node_id and node_id is None:
        node_id = uuid.UUID(state.node_id)
    if node_id is not None and (not state.node_id or not store.has_state()):
        state = store.commit(msgspec.structs.replace(state, node_id=str(node_id)))
    return state, node_id
