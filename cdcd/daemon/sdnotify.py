"""systemd notifications (READY=1, WATCHDOG=1, STOPPING=1) over $NOTIFY_SOCKET; no-ops elsewhere."""

from __future__ import annotations

import os
import socket

import structlog

log = structlog.get_logger("cdcd.daemon")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC", "")
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
        """Ping at half the watchdog timeout systemd gave us (None: no watchdog)."""
        self._failed = False

    @property
    def enabled(self) -> bool:
        return bool(self._addr)

    def notify(self, message: str) -> None:
        """Send ``message``; a socket that does not take it is logged once, never raised: the process
        goes on, and a watchdog that misses its pings ends it as it would a stuck one."""
        if not self._addr:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._addr)
                sock.sendall(message.encode())
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("sd_notify_failed", socket=self._addr.lstrip("\0"), error=str(exc))

    def ready(self, status: str = "") -> None:
        self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")
