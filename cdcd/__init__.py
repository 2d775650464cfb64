"""cdcd: change-data-capture for an embedded key-value node, modelled on Apache Ignite CDC."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdcd import wiring
from cdcd.logging import configure_library as _configure_library

if TYPE_CHECKING:
    from cdcd.node.attach import NodeParts, Realtime, Service
    from cdcd.node.node import Node

_configure_library()


def _wire() -> None:
    """The composition root: what every node gets attached unless it is given its own. Realtime
    delivery and the replication endpoint live above ``cdcd.node`` (which sees only the interfaces
    of ``cdcd.node.attach``); nothing is imported before a node asks."""

    def realtime(parts: NodeParts) -> Realtime:
        from cdcd.realtime import RealtimeWorker
        from cdcd.sinks import load_consumer

        return RealtimeWorker(parts, load_consumer)

    def replication(node: Node) -> Service | None:
        from cdcd.replication.applier import replication_server

        return replication_server(node)

    wiring.set_default("node.realtime", realtime)
    wiring.set_default("node.services", {"replication": replication})


_wire()


def __getattr__(name: str) -> str:
    # ``cdcd.__version__`` on demand: finding it reads package metadata, which ``import cdcd`` should not pay for.
    if name == "__version__":
        from cdcd.version import version

        return version()
    raise AttributeError(f"module 'cdcd' has no attribute {name!r}")
