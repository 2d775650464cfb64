"""A built-in load generator so a newcomer sees data flowing (``cdcd node run --load-rate N``)."""

from __future__ import annotations

import random
import threading
import time

import structlog

from cdcd.faults import ExitCode, Fault
from cdcd.node.node import Node

log = structlog.get_logger("cdcd.node.load")


class LoadFailed(Fault, RuntimeError):
    """The built-in load generator died of an error of its own (``cdcd node run`` exits 1)."""

    exit_code = ExitCode.FAILED


PROGRESS_EVERY_S = 10.0
"""How often the load says how far it got (``load_progress``): a log line, never a line of its own on
the terminal that log lines would run into."""


class LoadGenerator:
    """Writes about ``rate`` changes/s to cache ``load``: 10-change transactions, ~80% upserts, ~20% removes.

    Values are ~100-byte dicts with a stable shape (``id``, ``seq``, ``updated_at``, ``payload``);
    ``updated_at`` is the wall clock in ns, a ready-made ``conflict_resolve_field``. The load
    stops by itself after ``seconds`` (0: runs until ``stop()``). ``written`` counts the entries the
    node logged: a remove of a key that is not there writes nothing, so it is not counted (the WAL
    holds exactly ``written`` entries of this load). Every ``progress_every_s`` it logs
    ``load_progress`` (0: never).
    """

    def __init__(
        self,
        node: Node,
        rate: int,
        *,
        keyspace: int = 100_000,
        cache: str = "load",
        seed: int = 1,
        remove_ratio: float = 0.2,
        seconds: float = 0,
        progress_every_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self.node = node
        self.rate = rate
        self.keyspace = keyspace
        self.cache_name = cache
        self.remove_ratio = remove_ratio
        self.seconds = seconds
        self.done = threading.Event()
        self.failure: BaseException | None = None
        """Why the load stopped by itself other than the node refusing writes (``cdcd node run`` then exits 1)."""
        self.written = 0
        """Entries the node logged for this load (its WAL's entries of it)."""
        self.removes_drawn = 0
        """Removes the load asked for, of absent keys too (those write nothing)."""
        self.progress_every_s = progress_every_s
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdcd-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self.failure = exc
            log.error("load_failed", error=f"{type(exc).__name__}: {exc}", written=self.written)
            self.done.set()

    def _loop(self) -> None:
        cache = self.node.cache(self.cache_name)
        rng = self._rng
        tx_size = max(1, min(10, self.rate // 100 or 1))
        interval_s = tx_size / self.rate
        next_at = started = time.monotonic()
        next_progress = started + self.progress_every_s
        seq = 0
        while not self._stop.is_set() and not (self.seconds and time.monotonic() - started >= self.seconds):
            puts = {}
            removes = []
            for _ in range(tx_size):
                key = rng.randrange(self.keyspace)
                seq += 1
                if rng.random() < self.remove_ratio:
                    removes.append(key)
                else:
                    puts[key] = {"id": key, "seq": seq, "updated_at": time.time_ns(), "payload": "x" * 48}
            try:
                tx = self.node.transaction()
                for k, v in puts.items():
                    tx.put(cache.name, k, v)
                for k in removes:
                    if k not in puts:
                        tx.remove(cache.name, k)
                logged = tx.commit()
            except Exception:
                if self.node.failure is None and not self._stop.is_set():
                    raise
                # The node refuses writes (its supervisor reports why and exits) or is closing.
                log.info("load_stopped", written=self.written, cache=self.cache_name)
                self.done.set()
                return
            self.written += logged
            self.removes_drawn += len(removes)
            now = time.monotonic()
            if self.progress_every_s and now >= next_progress:
                log.info("load_progress", written=self.written, wal=str(self.node.wal_position), cache=self.cache_name)
                next_progress = now + self.progress_every_s
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            elif delay < -1.0:
                next_at = time.monotonic()  # fell behind by a second: do not burst to catch up
        log.info("load_finished", written=self.written, cache=self.cache_name)
        self.done.set()
