"""The node's realtime consumer: built and started on first need, stopped when it failed or at close."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog
from prometheus_client import REGISTRY

from cdcd.consumer import Consumer, LoadedConsumer
from cdcd.node.attach import AttachError
from cdcd.node.config import NodeConfig

log = structlog.get_logger("cdcd.realtime")

__all__ = ["ConsumerFactory", "ConsumerSlot", "RealtimeError"]


class RealtimeError(AttachError):
    pass


ConsumerFactory = Callable[[Mapping[str, Any], str], LoadedConsumer]
"""Builds the consumer a ``realtime_consumer`` table describes (``cdcd.sinks.load_consumer``)."""


class ConsumerSlot:
    def __init__(self, config: NodeConfig, load_consumer: ConsumerFactory) -> None:
        self._config = config
        self._load = load_consumer
        self.current: Consumer | None = None
        self._loaded: LoadedConsumer | None = None

    def get(self) -> Consumer:
        """The started consumer; built from the node config's ``realtime_consumer`` table on first call."""
        return self.loaded().consumer

    def loaded(self) -> LoadedConsumer:
        """The started consumer with its delivery policy (``get``)."""
        if self.current is None or self._loaded is None:
            if not self._config.realtime_consumer:
                raise RealtimeError("realtime CDC needs a realtime_consumer table in the node config")
            loaded = self._load(self._config.realtime_consumer_table, "realtime_consumer")
            loaded.consumer.start(REGISTRY)
            self.current, self._loaded = loaded.consumer, loaded
        return self._loaded

    def interrupt(self) -> bool:
        """Ask a consumer call in flight to give up (e.g. one retrying a dead target); False if there is none."""
        if self.current is None:
            return False
        self.current.interrupt()
        return True

    def drop(self, *, failed: bool) -> None:
        """Stop and forget the consumer (the next ``get`` builds a new one). After a failure its own
        stop may fail too: that is logged, as the failure that led here is already being handled."""
        consumer, self.current = self.current, None
        if consumer is None:
            return
        if not failed:
            consumer.stop()
            return
        try:
            consumer.stop()
        except Exception as exc:
            log.error("realtime_consumer_stop_failed", error=f"{type(exc).__name__}: {exc}")
