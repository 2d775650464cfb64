"""``maintenance_nice``: the lake sink's scheduled maintenance threads run at a lower CPU priority than the
process (Linux keeps niceness per thread), and the threads they start - delta-rs's and pyarrow's pools, when a
run is the first to need them - inherit it. Read from ``/proc/self/task/<tid>/stat``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import pytest

from cdcd.lake.maintenance.compact import CompactResult
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
from cdcd.lake.sink import LakeConsumer, LakeOptions
from tests.support.procs import wait_for


def nice_of(tid: int) -> int:
    """The niceness of thread ``tid`` of this process (field 19 of its stat line)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


def _thread(name: str) -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == name), None)


def test_the_sinks_maintenance_threads_run_niced_and_delivery_does_not(tmp_path: Path) -> None:
    """A sink with compaction and the optimize lane on: both lanes' threads run at the process's niceness plus
    ``maintenance_nice`` (7), the caller's thread (delivery) at the process's own."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    options = LakeOptions(
        lake_path=str(tmp_path / "lake"),
        writer="deltalake",
        compact_interval_s=3600,
        optimize_interval_s=3600,
        maintenance_nice=7,
    )
    sink = LakeConsumer(options)
    sink.start()
    try:
        for name in ("cdcd-lake-maintainer", "cdcd-lake-maintainer-optimize"):
            thread = _thread(name)
            assert thread is not None and thread.native_id is not None, name
            tid = thread.native_id
            wait_for(lambda tid=tid: nice_of(tid) == min(19, base + 7), 30, f"{name} niced")  # type: ignore[misc]
        assert nice_of(threading.get_native_id()) == base
    finally:
        sink.stop()


def test_threads_a_maintenance_run_starts_inherit_its_niceness(tmp_path: Path) -> None:
    """A thread started inside a run (as delta-rs and pyarrow start their pools on first use) has the lane's
    niceness; with ``nice = 0`` the lane keeps the process's."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (5, 0):
        seen: dict[str, int] = {}
        ran = threading.Event()

        def compact(
            _spark: object, _lake: Path, seen: dict[str, int] = seen, ran: threading.Event = ran
        ) -> CompactResult:
            seen["lane"] = nice_of(threading.get_native_id())
            child = threading.Thread(target=lambda: seen.__setitem__("child", nice_of(threading.get_native_id())))
            child.start()
            child.join()
            ran.set()
            return CompactResult(-1, -1, 0, -1)

        maintainer = Maintainer(
            tmp_path,
            None,
            MaintainerOptions(compact_interval_s=0.05, optimize_interval_s=0, nice=nice),
            compact_fn=compact,
        )
        maintainer.start()
        try:
            wait_for(ran.is_set, 30, "a compaction run")
        finally:
            maintainer.stop()
        assert seen == {"lane": min(19, base + nice), "child": min(19, base + nice)}, nice


@pytest.mark.parametrize("nice", [-1, 20])
def test_maintenance_nice_out_of_range_is_refused(tmp_path: Path, nice: int) -> None:
    with pytest.raises(msgspec.ValidationError, match="maintenance_nice"):
        LakeOptions(lake_path=str(tmp_path / "lake"), writer="deltalake", maintenance_nice=nice)
