"""What runs beside a node without the node knowing it: realtime delivery and the replication
endpoint live in packages above ``cdcd.node`` and are attached through these interfaces.

The node offers every flushed WAL chunk to its realtime attachment and starts and stops its
services; which ones it gets is injected (``Node(config, realtime=..., services=...)``), by default
the factories the composition root (``cdcd/__init__.py``) registered in ``cdcd.wiring``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from cdcd import wiring
from cdcd.node.config import NodeConfig
from cdcd.node.metastorage import Metastorage
from cdcd.node.wal_log import WalLog
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import CacheInfo
from cdcd.wal.writer import Chunk

if TYPE_CHECKING:
    from cdcd.node.node import Node


class AttachError(RuntimeError):
    """An attachment refused a command (the message says why)."""


@dataclass(frozen=True)
class NodeParts:
    """What a realtime attachment gets of the node."""

    config: NodeConfig
    wal: WalLog
    metastorage: Metastorage
    caches: Callable[[], dict[int, CacheInfo]]
    node_id: str


class Realtime(Protocol):
    """Delivery from inside the node (IEP-104)."""

    @property
    def position(self) -> WalPosition | None:
        """Everything before it is delivered (None: nothing yet)."""
        ...

    def offer(self, chunks: list[Chunk]) -> None:
        """The flusher's thread: take flushed chunks, never block."""

    def open(self, open_position: WalPointer) -> None:
        """Called once the WAL runs; ``open_position`` is where new records go."""

    def close(self) -> None: ...

    def switch(self, state: str) -> str:
        """``on`` or ``off`` (the control command); returns the mode now. Raises AttachError."""
        ...

    def status(self) -> dict[str, Any]:
        """At least ``mode`` ("on" while the node delivers) and ``last_event_commit_ts_ns``."""
        ...

    def cdc_links(self, on: bool) -> bool:
        """The node's CDC switch (``cdcd control cdc on|off``), also told once before ``open``. Off
        stops capture (its Stop record durable when this returns) and refuses ``on`` until CDC is on
        again. True: capture was running and stopped. Raises AttachError if it did not stop in time."""
        ...


class Service(Protocol):
    """A server beside the node (the replication endpoint)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


RealtimeFactory = Callable[[NodeParts], Realtime]
ServiceFactory = Callable[["Node"], "Service | None"]
"""Builds a service for a node (None: the config asks for none)."""


def default_realtime() -> RealtimeFactory:
    """The realtime attachment the composition root registered (``cdcd/__init__.py``)."""
    factory = wiring.default("node.realtime")
    if factory is None:
        raise RuntimeError("no realtime attachment registered (cdcd/__init__.py wires it)")
    return cast(RealtimeFactory, factory)


def default_services() -> dict[str, ServiceFactory]:
    """The services the composition root registered, by name."""
    return dict(cast("Mapping[str, ServiceFactory]", wiring.default("node.services") or {}))
