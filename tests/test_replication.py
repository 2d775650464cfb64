"""Node-to-node replication with real processes: `cdcd node run` nodes of two clusters, `cdcd run` daemons with the
replication consumer between them (one-way, active-active with and without a conflict field, faults).

A node process runs the built-in load (``--load-*``) or serves data written into it before it started. After the
nodes stop, their WALs are the reference: a local entry has no ``other_cluster_version``, a replicated one carries
its origin's version there. A node is *caught up* when it holds nothing unarchived (its active segment is empty) and
its daemon has committed the start of that active segment: everything it wrote went through its daemon.
"""

from __future__ import annotations

import re
import signal
import struct
import time
from pathlib import Path
from typing import Any

from cdcd.node.node import Node
from cdcd.node.writes import key_encoder, key_hash
from cdcd.replication.protocol import Error, Hello, Welcome, encode_frame
from cdcd.wal.reader import WalReader
from cdcd.wal.records import DataRecord, Op
from tests.support.procs import error_lines, wait_for
from tests.support.replication import exchange
from tests.support.replication_rig import (
    NODE_SETTINGS,
    RULES,
    TOKEN,
    DaemonProc,
    NodeProc,
    Procs,
    _tail,
    caught_up,
    committed,
    node_data,
    node_diff,
    origin,
    procs,
    split_entries,
    stop_all,
    version_text,
    wait_caught_up,
    write_token,
)

__all__ = ["procs"]  # a fixture, used by name


def test_one_way_replication_under_load(tmp_path: Path, procs: Procs) -> None:
    """A node under load (puts, updates, removes) replicated by a daemon process makes the other cluster's node equal to
    it (node diff exit 0 live and key by key), its WAL an entry-for-entry mirror of A's with A's versions as origins."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=2000, seconds=4, keyspace=4000, remove_pct=20, seed=11)
    daemon = DaemonProc(procs, tmp_path, a, b)
    daemon.start()
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    assert live["load"]["same"] and live["load"]["rows_a"] > 1000
    received = b.received()
    stop_all(daemon, a, b)

    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    assert (diff["load"]["only_a"], diff["load"]["only_b"], diff["load"]["different"]) == (0, 0, 0)
    data_a = node_data(a)
    assert list(data_a) == ["load"] and len(data_a["load"]) == live["load"]["rows_a"]
    assert node_data(b) == data_a

    a_local, a_repl = split_entries(a)
    b_local, b_repl = split_entries(b)
    assert a_repl == [] and b_local == []
    assert len(a_local) > 5000 and {e.version.cluster_id for e in a_local} == {1}
    ops = {op: sum(1 for e in a_local if e.op is op) for op in Op}
    assert ops[Op.DELETE] > 0 and ops[Op.UPDATE] > 0
    mirror = [(e.op, bytes(e.key), bytes(e.value), origin(e)) for e in b_repl]
    assert mirror == [(e.op, bytes(e.key), bytes(e.value), e.version) for e in a_local]
    assert {e.version.cluster_id for e in b_repl} == {2}
    # Every entry was new (rule 2) or a newer version of A's (rule 3); none rejected, none applied twice.
    assert received == {
        "local": 0,
        "new": ops[Op.CREATE],
        "version": ops[Op.UPDATE] + ops[Op.DELETE],
        "field": 0,
        "unresolved": 0,
        "duplicate": 0,
        "rejected": 0,
    }


def test_active_active_with_conflict_field(tmp_path: Path, procs: Procs) -> None:
    """Two clusters writing the same keys at once, each replicated to the other, end identical with the higher
    updated_at winning every key on both sides, and nothing bounces: each WAL holds its load's entries plus at most
    one replicated entry per entry of the other side, and stays still once both are quiet."""
    a = NodeProc(procs, tmp_path, "a", 1, conflict_resolve_field="updated_at")
    b = NodeProc(procs, tmp_path, "b", 2, conflict_resolve_field="updated_at")
    load = {"rate": 1500, "seconds": 4, "keyspace": 1500, "remove_pct": 0}
    a.start(**load, seed=21)
    b.start(**load, seed=22)
    a_to_b, b_to_a = DaemonProc(procs, tmp_path, a, b), DaemonProc(procs, tmp_path, b, a)
    a_to_b.start()
    b_to_a.start()
    wait_caught_up((a, a_to_b), (b, b_to_a))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    received = {"a": a.received(), "b": b.received()}
    written = {"a": a.entries_written(), "b": b.entries_written()}
    time.sleep(3)  # a quiet period: a bouncing entry would be written again and again
    assert {"a": a.entries_written(), "b": b.entries_written()} == written, "a WAL grew after quiescence"
    assert caught_up(a) and caught_up(b)
    assert {"a": a.received(), "b": b.received()} == received
    stop_all(a_to_b, b_to_a, a, b)

    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    data_a, data_b = node_data(a), node_data(b)
    assert data_a == data_b

    local = {"a": split_entries(a)[0], "b": split_entries(b)[0]}
    repl = {"a": split_entries(a)[1], "b": split_entries(b)[1]}
    assert len(local["a"]) == a.load_written() and len(local["b"]) == b.load_written()
    # Every key's winner: the write with the highest updated_at among both sides' local writes (tie: higher cluster).
    best: dict[Any, tuple[int, int, Any]] = {}
    for e in local["a"] + local["b"]:
        value = e.decoded_value()
        cand = (value["updated_at"], e.version.cluster_id, value)
        key = e.decoded_key()
        if key not in best or cand[:2] > best[key][:2]:
            best[key] = cand
    assert data_a["load"] == {k: c[2] for k, c in best.items()}
    keys_a = {e.decoded_key() for e in local["a"]}
    keys_b = {e.decoded_key() for e in local["b"]}
    assert len(keys_a & keys_b) > 500, "the loads must overlap for the test to mean anything"
    won_by_b = sum(1 for c in best.values() if c[1] == 2)
    assert 0 < won_by_b < len(best), "each side won some keys"

    for me, other in (("a", "b"), ("b", "a")):
        got, theirs = received[me], local[other]
        their_versions = {e.version for e in theirs}
        origins = [origin(e) for e in repl[me]]
        assert all(v.cluster_id == (2 if me == "a" else 1) for v in origins), f"an entry bounced back to {me}"
        assert len(set(origins)) == len(origins) and set(origins) <= their_versions
        # Each entry of the other side arrived exactly once (no retries here) and was applied or rejected by a rule.
        assert sum(got[r] for r in RULES) == len(theirs)
        assert (got["local"], got["unresolved"], got["duplicate"]) == (0, 0, 0)
        assert got["field"] > 0
        assert len(repl[me]) == len(theirs) - got["rejected"], f"{me}: one replicated WAL entry per applied entry"
        assert written[me] == len(local[me]) + len(repl[me])


def _write_before_start(node: NodeProc, values: dict[int, Any]) -> None:
    """Write ``values`` into cache ``c`` of the (not yet running) node, in records of 50, all archived."""
    with Node.open(node.dir, cluster_id=node.cluster_id, **NODE_SETTINGS) as n:
        cache = n.cache("c")
        keys = sorted(values)
        for i in range(0, len(keys), 50):
            cache.put_all({k: values[k] for k in keys[i : i + 50]})
        n.force_archive()


def test_active_active_without_conflict_field_rejects_exactly_the_overlap(tmp_path: Path, procs: Procs) -> None:
    """Without a conflict field, two clusters that wrote overlapping keys each reject exactly the overlapping keys by
    rule 5 (metrics and one log line per key with both versions) and take every other key of the other side."""
    n = 200
    a = NodeProc(procs, tmp_path, "a", 1)
    b = NodeProc(procs, tmp_path, "b", 2)
    a_vals = {k: {"from": "a", "k": k} for k in range(n)}
    b_vals = {k: {"from": "b", "k": k} for k in range(n // 2, 3 * n // 2)}
    overlap = set(a_vals) & set(b_vals)
    assert len(overlap) == n // 2
    _write_before_start(a, a_vals)
    _write_before_start(b, b_vals)
    a.start()
    b.start()
    a_to_b, b_to_a = DaemonProc(procs, tmp_path, a, b), DaemonProc(procs, tmp_path, b, a)
    a_to_b.start()
    b_to_a.start()
    wait_caught_up((a, a_to_b), (b, b_to_a))
    received = {"a": a.received(), "b": b.received()}
    rc, live = node_diff(a, b)
    assert rc == 1 and not live["c"]["same"]
    conflicts = {"a": a.events("replication_conflict_unresolved"), "b": b.events("replication_conflict_unresolved")}
    stop_all(a_to_b, b_to_a, a, b)

    expected = {
        "local": 0,
        "new": n // 2,
        "version": 0,
        "field": 0,
        "unresolved": n // 2,
        "duplicate": 0,
        "rejected": n // 2,
    }
    assert received == {"a": expected, "b": expected}
    versions = {
        "a": {e.decoded_key(): e.version for e in split_entries(a)[0]},
        "b": {e.decoded_key(): e.version for e in split_entries(b)[0]},
    }
    assert set(versions["a"]) == set(a_vals) and set(versions["b"]) == set(b_vals)
    by_hash = {key_hash(key_encoder.encode(k)): k for k in overlap}  # lines name keys by hash, never in clear
    for me, other in (("a", "b"), ("b", "a")):
        lines = conflicts[me]
        assert sorted(e["key_hash"] for e in lines) == sorted(by_hash), f"{me}: one line per overlapping key"
        for e in lines:
            assert "key" not in e
            k = by_hash[e["key_hash"]]
            assert (e["level"], e["cache"], e["conflict_resolve_field"]) == ("warning", "c", None)
            assert e["held_version"] == version_text(versions[me][k])
            assert e["new_version"] == version_text(versions[other][k])

    rc, diff = node_diff(a, b)
    assert rc == 1
    assert (diff["c"]["only_a"], diff["c"]["only_b"], diff["c"]["different"]) == (0, 0, n // 2)
    assert node_data(a)["c"] == {**b_vals, **a_vals}, "a keeps its overlapping keys and takes b's others"
    assert node_data(b)["c"] == {**a_vals, **b_vals}, "b keeps its overlapping keys and takes a's others"


def entries_before(node: NodeProc, pos: tuple[int, int, int] | None) -> int:
    """Data entries of the node's WAL before the daemon position ``pos`` (None: none), counted in its archive: the
    daemon reads archived segments only, so everything before its position is there."""
    if pos is None:
        return 0
    n = 0
    for ptr, rec in WalReader([node.dir / "wal" / "archive"]):
        if (ptr.segment, ptr.offset) >= pos[:2]:
            if (ptr.segment, ptr.offset) == pos[:2] and type(rec) is DataRecord:
                n += pos[2]
            break
        if type(rec) is DataRecord:
            n += len(rec.entries)
    return n


def assert_converged(a: NodeProc, b: NodeProc) -> None:
    """Both stopped: equal key by key, and every entry of A (and nothing else) was applied on B."""
    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    assert (diff["load"]["only_a"], diff["load"]["only_b"], diff["load"]["different"]) == (0, 0, 0)
    data = node_data(a)
    assert len(data["load"]) > 1000 and node_data(b) == data
    a_local, a_repl = split_entries(a)
    b_local, b_repl = split_entries(b)
    assert a_repl == [] and b_local == []
    # Re-sent batches may replay a put and its remove (no tombstones), so B may hold an entry more than once.
    assert {origin(e) for e in b_repl} == {e.version for e in a_local}


def test_daemon_sigkilled_mid_stream_loses_nothing(tmp_path: Path, procs: Procs) -> None:
    """The replicating daemon SIGKILLed three times while the target was applying entries the daemon had not committed,
    and restarted each time, leaves the target equal to the source, every re-sent entry counted exactly once more."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=1000, seconds=20, keyspace=3000, remove_pct=20, seed=31)
    # Small requests, one at a time: the backlog a restarted daemon finds takes it a while to send.
    daemon = DaemonProc(procs, tmp_path, a, b, max_batch_size=16, max_in_flight=1)
    pos: tuple[int, int, int] | None = None
    processed = 0.0
    resent = mid_stream = attempts = 0
    while mid_stream < 3:
        attempts += 1
        assert a.load_written() is None, f"the load ended after {attempts - 1} kills, {mid_stream} mid-stream"
        daemon.start()
        before = processed
        wait_for(lambda: daemon.check_running() or b.processed() > before, 60, "b to apply entries", interval=0.02)
        # Freeze the daemon, then kill it only if b has applied entries beyond its committed position: a stopped
        # daemon cannot commit, so the kill lands mid-stream by construction, however loaded the machine is.
        deadline = time.monotonic() + 120
        while True:
            daemon.pause()
            if int(b.processed() - processed) > entries_before(a, committed(a)) - entries_before(a, pos):
                break
            assert time.monotonic() < deadline, "b never applied entries the daemon had not committed"
            daemon.resume()
            seen = b.processed()
            wait_for(lambda: daemon.check_running() or b.processed() > seen, 60, "b to apply more", interval=0.01)
        daemon.kill()
        wait_for(lambda: b.connections() == 0, 30, "b to finish the killed daemon's last request")
        new_pos, now = committed(a), b.processed()
        # Entries b took a decision on in this run beyond those up to the committed position: sent again next run.
        excess = int(now - processed) - (entries_before(a, new_pos) - entries_before(a, pos))
        assert excess > 0
        mid_stream += 1
        resent += excess
        pos, processed = new_pos, now
    assert mid_stream == 3, f"{mid_stream} of {attempts} kills came while b applied uncommitted entries"
    daemon.start()
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    received = b.received()
    stop_all(daemon, a, b)

    assert_converged(a, b)
    a_local = split_entries(a)[0]
    assert sum(received[r] for r in RULES) == len(a_local) + resent
    assert (received["local"], received["field"], received["unresolved"]) == (0, 0, 0)


def test_target_killed_daemon_gives_up_after_retry_timeout_then_recovers(tmp_path: Path, procs: Procs) -> None:
    """With the target node SIGKILLed mid-stream, the daemon logs consumer_retrying warnings and exits 4 within
    retry_timeout_s plus a margin with one error line naming the target; both restarted, the target converges."""
    retry_timeout_s = 5.0
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=1000, seconds=8, keyspace=3000, remove_pct=20, seed=41)
    daemon = DaemonProc(procs, tmp_path, a, b, retry_timeout_s=retry_timeout_s, connect_timeout_ms=1000)
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.kill()
    killed_at = time.monotonic()
    rc = daemon.wait(retry_timeout_s + 30)
    took = time.monotonic() - killed_at
    assert rc == 4, _tail(daemon.err)
    assert took <= retry_timeout_s + 10, f"exited {took:.1f} s after the target died"
    retries = daemon.events("consumer_retrying")
    assert len(retries) >= 3, _tail(daemon.err)
    assert all(e["level"] == "warning" and b.target in e["error"] for e in retries)
    assert [e["attempt"] for e in retries] == list(range(1, len(retries) + 1))
    failing = [e["failing_for_s"] for e in retries]
    assert failing == sorted(failing) and failing[-1] <= retry_timeout_s
    errors = error_lines(daemon.err)
    assert len(errors) == 1 and daemon.err.read_text().splitlines()[-1] == errors[0]
    assert b.target in errors[0] and f"retry_timeout_s = {retry_timeout_s:g}" in errors[0], errors[0]
    match = re.search(r"failing for ([0-9.]+) s", errors[0])
    assert match and float(match.group(1)) >= retry_timeout_s, errors[0]

    b.start()  # same config, same port
    daemon.start()  # as systemd restarts a failed unit
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    stop_all(daemon, a, b)
    assert_converged(a, b)


def test_bad_peers_are_refused_and_a_restarted_target_is_rejoined(tmp_path: Path, procs: Procs) -> None:
    """A node process refuses a daemon with a wrong token (exit 4 at once, no retries) and garbage frames, counting
    each refusal, keeps serving a good daemon, and once SIGTERMed and restarted mid-stream is rejoined by that daemon
    (retrying, not exiting) until it equals the source."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=800, seconds=8, keyspace=2000, remove_pct=20, seed=51)
    wrong = write_token(tmp_path / "wrong.token", "wrong-" + TOKEN)
    bad = DaemonProc(procs, tmp_path, a, b, token_file=wrong, name="a-to-b-wrong-token")
    bad.start()
    assert bad.wait(60) == 4, _tail(bad.err)
    errors = error_lines(bad.err)
    assert len(errors) == 1 and "token refused" in errors[0] and b.target in errors[0], _tail(bad.err)
    assert bad.events("consumer_retrying") == []

    http = exchange(b.repl_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # read as a frame of ~1.2 GB
    assert [type(f) for f in http] == [Error] and http[0].fatal and "over the limit" in http[0].message
    junk = exchange(b.repl_port, encode_frame(Hello(TOKEN)) + struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    assert [type(f) for f in junk] == [Welcome, Error] and "undecodable" in junk[1].message
    samples = b.samples()
    refused = {r: b.metric("cdcd_replication_refused_total", samples, reason=r) for r in ("token", "frame", "tls")}
    assert refused == {"token": 1, "frame": 2, "tls": 0}
    assert b.processed() == 0

    daemon = DaemonProc(procs, tmp_path, a, b)
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.stop()  # SIGTERM while the daemon sends: a clean close
    wait_for(lambda: daemon.check_running() or daemon.events("consumer_retrying"), 60, "the daemon to retry")
    b.start()
    wait_caught_up((a, daemon))
    assert len(daemon.events("replication_connected")) == 2, "connected, then reconnected once b was back"
    rc, live = node_diff(a, b)
    assert rc == 0, live
    stop_all(daemon, a, b)
    assert_converged(a, b)


def test_sigterm_while_the_target_is_down_stops_at_once(tmp_path: Path, procs: Procs) -> None:
    """SIGTERM while the daemon retries a dead target stops it within seconds with exit 0; the unconfirmed batch is
    sent by the next run."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=500, seconds=6, keyspace=2000, remove_pct=20, seed=61)
    daemon = DaemonProc(procs, tmp_path, a, b, retry_timeout_s=30)
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.kill()
    wait_for(lambda: daemon.check_running() or daemon.events("consumer_retrying"), 30, "the daemon to retry")
    t0 = time.monotonic()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    rc = daemon.proc.wait(60)
    took = time.monotonic() - t0
    assert (rc, error_lines(daemon.err)) == (0, []), f"exit {rc} after {took:.1f} s"
    assert took < 10, f"took {took:.1f} s"
    b.start()
    daemon.start()
    wait_caught_up((a, daemon))
    for p in (daemon, a, b):
        p.stop()
    assert_converged(a, b)
