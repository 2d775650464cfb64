"""The node's topology version: the first field of every version it writes, grown at every open.

A node's ``order`` restarts with its WAL, so ``order`` alone cannot tell a node's later writes from
its earlier ones once the node is re-created from scratch or restored from a backup. Ignite puts the
topology version first in ``GridCacheVersion.compareTo`` and adds the seconds since a base time to
it; cdcd takes the same idea one step further, as a value of its own per node open:

    topology version = max(persisted + 1, milliseconds since TOPOLOGY_EPOCH_MS)

persisted in the page store before the first write of the open (a synced LMDB write).

- restart: ``persisted + 1`` - strictly above every version of the previous open, whatever the clock;
- restore from a backup: the backup's persisted value is old, but the wall clock has moved past the
  opens of the lost history, so the clock term is above them;
- re-created in a fresh dir: nothing persisted, the clock term alone, above every older open.

Milliseconds rather than Ignite's seconds: restarts in quick succession push ``persisted + 1``
ahead of the clock by one per open, and a node re-created while that lead lasts would start below
its old self; no node opens twice within a millisecond, so with milliseconds the lead never
builds. What this needs: the clock of the host must not step back across a re-creation or restore
(a restart does not depend on the clock). ``topology_version`` in the node's config, when not 0,
fixes the value instead (reproducible test output; gives up the guarantee above).
"""

from __future__ import annotations

import time

from cdcd.node.store import PageStore

TOPOLOGY_EPOCH_MS = 1_735_689_600_000
"""2025-01-01T00:00:00Z: older than every node that writes with this scheme; keeps values small."""

_KEY = b"topology_version"


def clock_topology_ms() -> int:
    return time.time_ns() // 1_000_000 - TOPOLOGY_EPOCH_MS


def next_topology_version(persisted: int | None, now_ms: int) -> int:
    """The topology version of a new open, given the last open's (None: none) and the clock term."""
    return max(now_ms, 0 if persisted is None else persisted + 1)


def open_topology_version(store: PageStore, configured: int) -> int:
    """The topology version for this open of the node, persisted (synced) before it is returned."""
    if configured:
        return configured
    raw = store.meta_get(_KEY)
    value = next_topology_version(None if raw is None else int.from_bytes(raw, "big"), clock_topology_ms())
    store.meta_put(_KEY, value.to_bytes(8, "big"))
    return value
