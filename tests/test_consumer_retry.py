"""One retry policy for every consumer (issue 29 item 3), through a real `cdcd run` and a `kind = "python"`
consumer: a ``cdcd.consumer.RetriableError`` is waited out with backoff (``consumer_retrying`` lines, the retries
counter, the daemon alive), the same events are offered again and land exactly once; past ``retry_timeout_s`` the
daemon exits 4 with one line naming the cause; the old option name is refused."""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path
from typing import Any

from tests.support.chaos import scrape
from tests.support.config import write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import cdcd, child_env, error_lines, log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node

SINKS = textwrap.dedent(
    '''
    """Test consumers for `kind = "python"`."""
    import json

    from cdcd.consumer import Consumer, RetriableError


    class Flaky(Consumer):
        """Appends every event it takes to ``log`` (one JSON position a line). Its ``fail_batch``-th batch fails
        ``fail_times`` times with a RetriableError, after iterating half of it (not taken: the retry must
        offer it again whole); ``fail_times`` < 0: fails for ever."""

        def __init__(self, log, fail_batch, fail_times):
            self.log, self.fail_batch, self.fail_times = log, fail_batch, fail_times
            self.batches = self.failed = 0

        def on_events(self, batch):
            if self.failed != self.fail_times and self.batches + 1 == self.fail_batch:
                self.failed += 1
                for i, _ev in enumerate(batch):
                    if i >= len(batch) // 2:
                        break
                try:
                    raise ConnectionRefusedError(111, "\\x1b[31mConnection refused\\x1b[0m\\n  caused by: no route")
                except OSError as exc:
                    raise RetriableError(f"sink busy (attempt {self.failed})") from exc
            self.batches += 1
            with open(self.log, "a") as f:
                for ev in batch:
                    p = ev.position
                    f.write(json.dumps([p.segment, p.offset, p.entry_index]) + "\\n")
            return True
    '''
)


def flaky(tmp_path: Path, **options: Any) -> tuple[dict[str, Any], dict[str, str]]:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "retry_sinks.py").write_text(SINKS)
    return {"kind": "python", "class": "retry_sinks:Flaky", "options": options}, child_env(mods)


def delivered(log: Path) -> list[tuple[int, int, int]]:
    if not log.exists():
        return []
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def test_retriable_error_n_times_then_success_lands_everything_once(tmp_path: Path) -> None:
    """The 2nd batch fails 4 times (RetriableError from a ConnectionRefusedError whose text has colour codes and
    two lines): 4 consumer_retrying warnings with attempts 1..4, rising delays and the chained error on one line;
    cdcd_daemon_consumer_retries_total is 4; the daemon keeps running and every WAL entry lands exactly once, in
    order."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=3, tx_per_segment=10)
    expected = [tuple(e["pos"]) for e in wal_events(node_dir)]
    log = tmp_path / "delivered.jsonl"
    consumer, env = flaky(tmp_path, log=str(log), fail_batch=2, fail_times=4)
    port = free_port()
    config = write_daemon_config(
        tmp_path / "cdcd.toml",
        node_dir,
        {**consumer, "retry_timeout_s": 120},
        batch_max_events=40,
        metrics_address=f"127.0.0.1:{port}",
    )
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or len(delivered(log)) >= len(expected), 60, "every event delivered")
        assert proc.poll() is None, err.read_text()[-3000:]
        retries = scrape(port)["cdcd_daemon_consumer_retries_total"][0][1]
    finally:
        rc = stop_daemon(proc)
    assert rc == 0 and error_lines(err) == [], err.read_text()[-3000:]
    assert delivered(log) == expected, "every entry exactly once, in WAL order"
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert [e["attempt"] for e in steps] == [1, 2, 3, 4] and retries == 4
    assert all(e["level"] == "warning" and e["retry_timeout_s"] == 120 for e in steps)
    assert steps[0]["error"] == (
        "RetriableError: sink busy (attempt 1) <- ConnectionRefusedError: [Errno 111] Connection refused <- no route"
    )
    delays = [e["retry_in_s"] for e in steps]
    assert delays[-1] > delays[0] and all(0 < d <= 5 for d in delays), delays
    assert "\x1b" not in err.read_text() and "\\u001b" not in err.read_text()


def test_past_retry_timeout_the_daemon_exits_4_naming_the_cause(tmp_path: Path) -> None:
    """A consumer failing for ever with a RetriableError: the daemon retries for retry_timeout_s = 3, then exits
    4 with one line naming the time, the attempts, the option and the chained cause; nothing of the batch is
    committed."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=5)
    log = tmp_path / "delivered.jsonl"
    consumer, env = flaky(tmp_path, log=str(log), fail_batch=1, fail_times=-1)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, {**consumer, "retry_timeout_s": 3})
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)
    t0 = time.monotonic()
    rc = proc.wait(60)
    took = time.monotonic() - t0
    assert rc == 4, err.read_text()[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and err.read_text().splitlines()[-1] == lines[0], err.read_text()[-3000:]
    match = re.fullmatch(
        r"cdcd: error: consumer on_events\(\) failing for ([0-9.]+) s over (\d+) attempt\(s\) \(retry_timeout_s = 3\): "
        r"RetriableError: sink busy \(attempt \d+\) <- ConnectionRefusedError: \[Errno 111\] Connection refused "
        r"<- no route",
        lines[0],
    )
    assert match, lines[0]
    assert 3 <= float(match.group(1)) < 6 and int(match.group(2)) >= 3 and took >= 3
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert len(steps) == int(match.group(2)) - 1 and steps[-1]["failing_for_s"] <= 3
    assert delivered(log) == []


def test_old_max_retry_s_is_refused_under_strict_config_with_the_new_name(tmp_path: Path) -> None:
    """(Without --strict-config it is read as retry_timeout_s until 0.3.0: tests/test_versions_and_config.py.)"""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=1)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, {"kind": "null", "max_retry_s": 60})
    res = cdcd("--strict-config", "run", "--config", str(config))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"cdcd: error: {config}: consumer: key 'max_retry_s' is now 'retry_timeout_s' (the old spelling is deprecated "
        "in 0.2.0, refused from 0.3.0; --strict-config refuses it)"
    ]
    bad = write_daemon_config(tmp_path / "bad.toml", node_dir, {"kind": "null", "retry_timeout_s": -1})
    res = cdcd("run", "--config", str(bad))
    assert res.returncode == 2 and "key 'retry_timeout_s': -1: must be a finite number of seconds >= 0" in res.stderr
