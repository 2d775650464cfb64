"""``realtime_batch_min_interval_ms`` (or the consumer's own ``min_batch_interval_ms``, the lake's
``realtime_commit_interval_ms``): the node's realtime worker starts a delivery at most once per interval,
whatever was flushed meanwhile joining it, every entry still delivered once and in order; closing does not
wait the interval out. A recording consumer in the node's process (``tests.support.rt_lag_consumer``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd import metrics
from cdcd.config import ConfigError
from cdcd.lake.sink import LakeConsumer
from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from tests.support import rt_lag_consumer
from tests.support.procs import wait_for

INTERVAL_MS = 300


def _node(path: Path, channel: str, interval_ms: int, asked_ms: int = 0) -> Node:
    """A node whose realtime consumer records what it gets: ``interval_ms`` the node's pacing, ``asked_ms`` the
    consumer's own."""
    options = {"channel": channel, "min_batch_interval_ms": asked_ms}
    consumer = {"kind": "python", "class": "tests.support.rt_lag_consumer:LagConsumer", "options": options}
    node = Node.open(
        path,
        realtime_cdc=True,
        realtime_consumer=consumer,
        cdc_enabled=False,
        realtime_batch_min_interval_ms=interval_ms,
    )
    wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
    return node


def _keys(rec: Any) -> list[int]:
    return [k for _, _, keys in rec.snapshot() for k in keys]


@pytest.mark.parametrize(("interval_ms", "asked_ms"), [(INTERVAL_MS, 0), (0, INTERVAL_MS), (100, INTERVAL_MS)])
def test_deliveries_start_at_most_once_per_interval(tmp_path: Path, interval_ms: int, asked_ms: int) -> None:
    """40 puts 20 ms apart (each flushed on its own): the consumer is called at most once per 300 ms from the
    first put on (the node's interval, or the consumer's when longer), so a handful of times instead of about 40;
    every key once, in order. The node's lag histogram times each batch from its oldest entry: a batch of n keys
    waited at least (n - 1) x 20 ms."""
    channel = f"pace-{os.getpid()}"
    rec = rt_lag_consumer.recorder(channel, fresh=True)
    lag_sum_s = metrics.NODE.get_sample_value("cdcd_node_realtime_lag_seconds_sum") or 0.0
    node = _node(tmp_path / "node", channel, interval_ms, asked_ms)
    try:
        cache = node.cache("c")
        first_ns = time.perf_counter_ns()
        for key in range(40):
            cache.put(key, "v")
            time.sleep(0.02)
        wait_for(lambda: rec.delivered() >= 40, 60, "every key delivered")
    finally:
        node.close()
        rt_lag_consumer.drop(channel)
    calls = [t for t, _, _ in rec.snapshot()]
    # Delivery k starts at least (k - 1) intervals after the first, which started after the first put.
    allowed = (calls[-1] - first_ns) / (INTERVAL_MS * 1e6) + 1
    assert len(calls) <= allowed, (len(calls), allowed)
    assert len(calls) < 20, "deliveries were not paced"
    assert _keys(rec) == list(range(40))
    waited_s = (metrics.NODE.get_sample_value("cdcd_node_realtime_lag_seconds_sum") or 0.0) - lag_sum_s
    at_least_s = sum(len(keys) - 1 for _, _, keys in rec.snapshot()) * 0.02
    assert waited_s >= at_least_s, (waited_s, at_least_s)


def test_closing_does_not_wait_for_the_interval(tmp_path: Path) -> None:
    """With 20 s between deliveries (the close timeout is 10 s), what is put right after a delivery is
    delivered by the node at close, without a ``close_timeout`` stop: closing wakes the pacing wait."""
    channel = f"pace-close-{os.getpid()}"
    rec = rt_lag_consumer.recorder(channel, fresh=True)
    node = _node(tmp_path / "node", channel, 20_000)
    try:
        cache = node.cache("c")
        cache.put(0, "v")
        wait_for(lambda: rec.delivered() >= 1, 60, "the first key delivered")
        for key in range(1, 10):
            cache.put(key, "v")
        assert rec.delivered() == 1  # the next delivery is 20 s away
    finally:
        node.close()
        rt_lag_consumer.drop(channel)
    assert node.realtime.stops.get("close_timeout") is None
    assert _keys(rec) == list(range(10))


@pytest.mark.parametrize("interval_ms", [-1, 60_001])
def test_an_interval_out_of_range_is_refused(tmp_path: Path, interval_ms: int) -> None:
    with pytest.raises(ConfigError, match="realtime_batch_min_interval_ms"):
        Node.open(tmp_path / "node", realtime_batch_min_interval_ms=interval_ms)


def test_the_lake_asks_for_a_commit_every_100_ms_by_default() -> None:
    """The lake consumer's ``realtime_commit_interval_ms`` (default 100) is the pacing it asks of a node's realtime
    worker; 0 asks none; out of range it is refused with its key."""
    assert LakeConsumer.from_options({"lake_path": "/x"}, "realtime_consumer").min_batch_interval_ms == 100
    options = {"lake_path": "/x", "realtime_commit_interval_ms": 0}
    assert LakeConsumer.from_options(options, "realtime_consumer").min_batch_interval_ms == 0
    with pytest.raises(ConfigError, match="realtime_commit_interval_ms"):
        LakeConsumer.from_options({"lake_path": "/x", "realtime_commit_interval_ms": -1}, "realtime_consumer")
