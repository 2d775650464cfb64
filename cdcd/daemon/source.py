"""What the node says about who delivers, for a daemon without a state of its own (DESIGN §6).

Asked first over the node's control socket (a running node), else read from its metastorage
(a stopped node: what it will restore when it opens). Both read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import lmdb
import msgspec
import structlog

from cdcd.control import request
from cdcd.daemon_state import StateDamaged, check_lmdb_file
from cdcd.lock import pid_alive, read_holder_pid
from cdcd.node.config import NodeConfig
from cdcd.node.metastorage import MetastorageUnreadable, read_realtime_state
from cdcd.retry import poll_until
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheInfo

log = structlog.get_logger("cdcd.daemon")

ASK_TIMEOUT_S = 5.0
STARTING_NODE_WAIT_S = 60.0
"""How long a daemon waits for a node that holds its lock but does not answer yet (it is opening)."""


@dataclass(frozen=True)
class NodeDelivery:
    realtime_on: bool
    """The node's realtime worker delivers (or will, once it restores at open)."""
    position: WalPosition | None
    """Its last realtime-committed position: where a daemon takes over when realtime is off."""
    source: str
    """Where the answer came from (for the log)."""


def ask_node(node: NodeConfig) -> NodeDelivery | None:
    """None when neither the node's control socket nor its metastorage answers (both where its config puts
    them: ``DaemonConfig.node()``)."""
    socket_path = node.control_socket_path
    if socket_path.exists():
        try:
            reply = request(socket_path, {"cmd": "status"}, timeout_s=ASK_TIMEOUT_S)
        except OSError as exc:
            log.info("node_not_answering", socket=str(socket_path), error=str(exc))
        else:
            if reply.get("ok"):
                rt = reply["realtime"]
                committed = rt.get("committed")
                return NodeDelivery(
                    rt["mode"] == "on",
                    WalPosition.parse(committed) if committed else None,
                    f"control socket {socket_path}",
                )
    try:
        saved = read_realtime_state(node.metastorage_path)
    except MetastorageUnreadable as exc:
        log.warning("node_metastorage_unreadable", error=str(exc))
        return None
    if saved is None:
        return None
    on = saved.enabled and saved.try_start is None and saved.position is not None
    return NodeDelivery(on, saved.position, f"metastorage {node.metastorage_path / 'data.mdb'}")


def ask_starting_node(node: NodeConfig, wait_s: float = STARTING_NODE_WAIT_S) -> NodeDelivery | None:
    """``ask_node``, waiting up to ``wait_s`` while the node is opening: its process holds ``node.lock``
    but its control socket does not answer yet. Without the wait a daemon started a moment after its
    node (one systemd unit right after the other) would sit PASSIVE until the node's next start."""
    answer = ask_node(node)
    if answer is not None or not _node_process_alive(node):
        return answer
    log.info("waiting_for_node_socket", socket=str(node.control_socket_path), wait_s=wait_s)
    return poll_until(lambda: ask_node(node), wait_s, 0.2, alive=lambda: _node_process_alive(node))


def _node_process_alive(node: NodeConfig) -> bool:
    """The pid in ``node.lock`` is a live process (read, not locked: taking the lock, even shared,
    could make the opening node's own attempt fail)."""
    pid = read_holder_pid(node.lock_path)
    return pid is not None and pid_alive(pid)


def node_caches(node: NodeConfig) -> tuple[dict[int, CacheInfo], str]:
    """The node's cache registry from its page store, for a daemon state that lost its own; and where
    it came from. Read-only and without LMDB's lock file, so a node open in this same process is not
    disturbed (the registry changes only at checkpoints; a read that fails is retried)."""
    db = node.db_path
    data = db / "data.mdb"
    if not data.exists():
        return {}, "none (the node has no page store)"
    error = ""
    for _attempt in range(3):
        try:
            check_lmdb_file(data)
            env = lmdb.open(str(db), readonly=True, lock=False, max_dbs=4)
            try:
                names = env.open_db(b"caches", create=False)
                with env.begin(db=names) as txn:
                    infos = [msgspec.msgpack.decode(v, type=CacheInfo) for _k, v in txn.cursor()]
            finally:
                env.close()
        except (StateDamaged, lmdb.Error, msgspec.DecodeError) as exc:
            error = str(exc)
            continue
        return {i.cache_id: i for i in infos}, f"node page store {db}"
    if "already open in this process" in error:
        # A daemon inside the node's own process (cdcd demo, tests): LMDB opens an environment once per
        # process; the cache names come from the WAL's cache records all the same.
        log.info("node_caches_from_wal", path=str(data), reason="the node runs in this process")
        return {}, "none (the node runs in this process; names from the WAL)"
    log.warning("node_caches_unreadable", path=str(data), error=error)
    return {}, f"none (the node's page store is unreadable: {error})"
