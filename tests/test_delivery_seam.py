"""The delivery seam (issue 45, section 3): ``DeliveryLoop`` driven through a tiny real side, and a
consumer's delivery policy read once, from its table, never from the consumer object.

The side here is what the daemon's committer and the realtime deliverer are, reduced to lists: its
``call`` runs the consumer's call, ``commit`` records positions, ``wait`` never sleeps (it records the
wait and says "not stopping"). The loop owns everything else: cache-change dispatch, retries, dead
letters, and one failure type (``DeliveryFailed``) for every way a consumer fails for good.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from cdcd import dead_letters
from cdcd.consumer import (
    CacheDrop,
    CacheInfo,
    Consumer,
    DeliveryPolicy,
    EventBatch,
    RecordSlice,
    RefusedEvent,
    RetriableError,
    UserConsumer,
)
from cdcd.daemon.committer import Committer, ConsumerFailed
from cdcd.daemon_state import CdcMode, StateStore
from cdcd.delivery import Batch, Batcher, CacheChange, DeliveryFailed, DeliveryLoop, feed_active
from cdcd.sinks import load_consumer
from cdcd.wal import WalPointer
from cdcd.wal.pointer import EventAddress, WalPosition
from cdcd.wal.records import CacheConfig, CacheOp, CacheRecord, CacheVersion, DataEntry, DataRecord, Op, Record

T = TypeVar("T")


class ListSide:
    """A side that keeps what the loop told it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.commits: list[WalPosition] = []
        self.waits: list[bool] = []
        self.took = 0

    def call(self, what: str, fn: Callable[[], T]) -> T:
        self.calls.append(what)
        return fn()

    def commit(self, end: WalPosition) -> None:
        self.commits.append(end)

    def wait(self, delay_s: float, retrying: bool = False) -> bool:
        self.waits.append(retrying)
        return False

    def delivered(self, taken: Sequence[RecordSlice], events: EventBatch, took: int, ok: bool) -> None:
        self.took += took


class Recorder(Consumer):
    """Keeps what it hears; ``fail``: what ``on_events`` raises, call by call (None: take the batch)."""

    def __init__(self, *fail: BaseException | None) -> None:
        self.fail = list(fail)
        self.heard: list[tuple[str, Any]] = []

    def on_events(self, batch: EventBatch) -> bool:
        if self.fail and (error := self.fail.pop(0)) is not None:
            raise error
        self.heard.append(("events", [e.key for e in batch]))
        return True

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        self.heard.append(("created", [c.name for c in caches]))

    def on_cache_drop(self, drops: Sequence[CacheDrop]) -> None:
        self.heard.append(("dropped", [d.name for d in drops]))


def _entry(key: int) -> DataEntry:
    raw = msgspec.Raw(msgspec.msgpack.encode(key))
    return DataEntry(7, Op.CREATE, raw, raw, 0, CacheVersion(1, 1, key, 1))


def _items(*keys: int, destroy: bool = True) -> list[Batch | CacheChange]:
    """Cache ``orders`` created, one record of ``keys``, then (``destroy``) dropped: what the loop is fed."""
    records: list[Record] = [
        CacheRecord(7, "orders", CacheOp.CREATE, CacheConfig()),
        DataRecord(tuple(_entry(k) for k in keys), 1),
    ]
    if destroy:
        records.append(CacheRecord(7, "orders", CacheOp.DESTROY, ts_ns=5, version=CacheVersion(1, 1, 99, 1)))
    batcher = Batcher(position=None, caches={}, source_node="n1", batch_max_events=100, batch_max_bytes=1 << 20)
    out: list[Batch | CacheChange] = []
    for offset, record in enumerate(records, 1):
        out += feed_active(batcher, WalPointer(0, offset * 100), record, 0, 10)
    if batcher.slices:
        out.append(batcher.close())
    return out


def _feed(loop: DeliveryLoop, items: list[Batch | CacheChange]) -> None:
    for item in items:
        assert (loop.deliver(item) if isinstance(item, Batch) else loop.cache_change(item)) is True


def test_the_loop_dispatches_cache_changes_and_events_in_wal_order() -> None:
    side, consumer = ListSide(), Recorder()
    _feed(DeliveryLoop(side, consumer, DeliveryPolicy(), retry_s=0.0), _items(1, 2, 3))
    assert consumer.heard == [("created", ["orders"]), ("events", [1, 2, 3]), ("dropped", ["orders"])]
    assert side.calls == ["on_cache_change", "on_events", "on_cache_drop"]
    assert side.commits == [WalPosition(0, 300, 0)], "the batch is committed up to the DESTROY that closed it"
    assert side.took == 3


def test_a_retriable_error_is_waited_out_through_the_side() -> None:
    side, consumer = ListSide(), Recorder(RetriableError("down"), RetriableError("down"))
    _feed(DeliveryLoop(side, consumer, DeliveryPolicy(retry_timeout_s=60), retry_s=0.0), _items(1, 2, destroy=False))
    assert consumer.heard == [("created", ["orders"]), ("events", [1, 2])]
    assert side.waits == [True, True], "one retrying wait per failed attempt, none other"


class _Raises(Recorder):
    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        raise OSError("no space left")


@pytest.mark.parametrize(
    ("consumer", "policy", "said"),
    [
        (Recorder(ValueError("bad row")), DeliveryPolicy(), "consumer on_events() raised ValueError: bad row"),
        (
            Recorder(RetriableError("broker down")),
            DeliveryPolicy(retry_timeout_s=0),
            "consumer on_events() failing for 0.0 s over 1 attempt(s) (retry_timeout_s = 0): "
            "RetriableError: broker down",
        ),
        (
            Recorder(RefusedEvent(EventAddress(0, 200, 1), "too big")),
            DeliveryPolicy(),
            "consumer refused the event at 0:200#1 (cache orders): too big",
        ),
        (_Raises(), DeliveryPolicy(), "consumer on_cache_change() raised OSError: no space left"),
    ],
    ids=["raised", "retries_exhausted", "refused_without_dead_letters", "cache_call_raised"],
)
def test_every_way_a_consumer_fails_for_good_is_one_delivery_failed(
    consumer: Recorder, policy: DeliveryPolicy, said: str
) -> None:
    side = ListSide()
    with pytest.raises(DeliveryFailed) as failed:
        _feed(DeliveryLoop(side, consumer, policy, retry_s=0.0), _items(1, 2, 3))
    assert str(failed.value).startswith(said), str(failed.value)
    if "refused" in said:
        # What came before the refused event was delivered and committed first.
        assert consumer.heard[-1] == ("events", [1]) and side.commits == [WalPosition(0, 200, 1)]


def test_a_dead_letter_file_that_cannot_be_written_is_the_same_failure(tmp_path: Path) -> None:
    (tmp_path / "dead.jsonl").mkdir()  # a directory where the file should be
    policy = DeliveryPolicy(dead_letters_path=str(tmp_path / "dead.jsonl"))
    consumer = Recorder(RefusedEvent(EventAddress(0, 200, 0), "too big"))
    loop = DeliveryLoop(ListSide(), consumer, policy, retry_s=0.0, dead_letter=dead_letters.writer(policy))
    with pytest.raises(DeliveryFailed, match="cannot open the dead-letter file"):
        _feed(loop, _items(1, 2))


# --- the policy: read once, from the table ---------------------------------------------------------------
class UserSink:
    """A user class that does not subclass Consumer, with attributes that look like a policy."""

    retry_timeout_s = 300.0
    dead_letters = False
    dead_letters_path = ""

    def __init__(self) -> None:
        self.keys: list[Any] = []

    def start(self, registry: object) -> None:
        pass

    def stop(self) -> None:
        pass

    def on_events(self, batch: EventBatch) -> bool:
        keys = []
        for event in batch:
            if event.key == 2:
                raise RefusedEvent(event.position, "two is refused")
            if event.key == 9:
                raise RetriableError("nine waits")
            keys.append(event.key)
        self.keys += keys  # nothing of a failed call counts as taken
        return True


def test_a_user_class_is_wrapped_once_and_its_policy_comes_from_its_table(tmp_path: Path) -> None:
    dead = tmp_path / "dead.jsonl"
    table = {
        "kind": "python",
        "class": "tests.test_delivery_seam:UserSink",
        "retry_timeout_s": 0,
        "dead_letters": "on",
        "dead_letters_path": str(dead),
    }
    consumer, policy = load_consumer(table, "c.toml: consumer")
    assert policy == DeliveryPolicy(retry_timeout_s=0.0, dead_letters_path=str(dead))
    assert isinstance(consumer, UserConsumer) and isinstance(consumer.user, UserSink)
    assert consumer.resume_at("n1", WalPointer(0, 0)) is None and consumer.alive(), "Consumer's defaults"
    user = consumer.user
    user.retry_timeout_s, user.dead_letters_path = 999.0, str(tmp_path / "elsewhere.jsonl")  # read by nobody

    store = StateStore(tmp_path / "state")
    try:
        committer = Committer(store, store.load(CdcMode.DAEMON_ACTIVE), {}, consumer, tmp_path, policy=policy)
        assert committer.loop.policy is policy
        for item in _items(1, 2, 3, destroy=False):
            committer.apply(item)
        assert user.keys == [1, 3] and committer.state.position == WalPosition(0, 200, 3)
        assert [json.loads(line)["pos"] for line in dead.read_text().splitlines()] == [[0, 200, 1]]
        assert not (tmp_path / "elsewhere.jsonl").exists()
        # retry_timeout_s = 0 from the table: the first RetriableError fails (the attribute says 999).
        with pytest.raises(ConsumerFailed, match=r"failing for .* \(retry_timeout_s = 0\): RetriableError: nine"):
            committer.apply(_items(9, destroy=False)[-1])
    finally:
        store.close()
