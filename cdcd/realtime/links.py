"""How the node learns that the daemon passed its TryStart record: the link of the TryStart's
segment left the CDC dir (the daemon deletes it only once it committed everything before).

While a try-start waits, a watchdog observer on the CDC dir wakes the worker on every change
there; a slow recheck covers events the observer missed (as the daemon's rescan does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from cdcd.node.config import NodeConfig
from cdcd.node.wal_log import WalLog
from cdcd.wal.pointer import WalPointer
from cdcd.wal.segment import segment_path


class _Wake(FileSystemEventHandler):
    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._wake()


class LinkWatch:
    RECHECK_S = 1.0
    """Looked again after this without an event (a missed one costs at most this much switch time)."""

    def __init__(self, config: NodeConfig, wal: WalLog, wake: Callable[[], None]) -> None:
        self.config = config
        self.wal = wal
        self._wake = wake
        self._observer: BaseObserver | None = None

    def daemon_passed(self, try_start: WalPointer) -> bool:
        """The daemon deleted the link of the TryStart segment: it committed everything before it."""
        if not self.config.cdc_enabled:
            return True
        if self.wal.last_archived < try_start.segment or self.wal.link_skipped(try_start.segment):
            return False  # never linked (CDC dir full): the daemon cannot pass it; overflow stops us
        return not segment_path(self.config.cdc_path, try_start.segment).exists()

    def start(self) -> None:
        """Wake on changes of the CDC dir (until ``stop``)."""
        if self._observer is not None or not self.config.cdc_enabled:
            return
        observer = Observer()
        try:
            observer.schedule(_Wake(self._wake), str(self.config.cdc_path), recursive=False)
            observer.start()
        except OSError:
            return  # no dir to watch (yet): the recheck still sees the link go
        self._observer = observer

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            with contextlib.suppress(RuntimeError):  # joined from its own callback's thread: never here
                observer.join()
