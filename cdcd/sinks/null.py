"""A consumer that drops everything (benchmarks, and a daemon that only cleans links)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from cdcd.config import convert
from cdcd.consumer import Consumer, EventBatch


class NullOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class NullConsumer(Consumer):
    decodes_entries = False

    def __init__(self) -> None:
        self.events = 0
        self.batches = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> NullConsumer:
        convert(options, NullOptions, source)
        return cls()

    def on_events(self, batch: EventBatch) -> bool:
        self.events += len(batch)
        self.batches += 1
        return True
