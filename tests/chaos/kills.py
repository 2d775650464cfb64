"""Scenario 1: SIGKILL of the daemon, of the node (archive mode), of the node while its realtime consumer delivers,
and of either one around realtime switches, at random moments (a fifth of them during the process's start-up).

Each episode is a fresh node dir: a node process writing ~20k entries/s into 64 KiB segments and a daemon process,
the victim SIGKILLed and restarted several times, then everything stopped cleanly and checked against the WAL with
``tests.support.chaos.check_exact`` (each side's file split into runs at its kills: every run a contiguous stretch
of that side's share, every restart beginning exactly at the position committed before the kill, together exactly
the WAL). For the lake episodes the change log, read with pyarrow, must hold every WAL entry exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tests.support.chaos import (
    ChaosRig,
    Ctx,
    Result,
    check,
    check_exact,
    check_lake_clean,
    lake_delivery,
    rig,
)
from tests.support.procs import wait_for
from tests.support.realtime import expected_shares, read_runs
from tests.support.wal import wal_events

EARLY_KILL = 0.2
"""Share of kills that hit the process during its start-up (recovery, state loading, link clean-up)."""


def _kill_and_restart(ctx: Ctx, res: Result, r: ChaosRig, victim: str) -> None:
    early = ctx.rng.random() < EARLY_KILL
    if victim == "node" and (r.tmp / "consumer.busy").exists():
        res.details["node_kills_inside_on_events"] = res.details.get("node_kills_inside_on_events", 0) + 1
    if early:
        res.details["kills_during_startup"] = res.details.get("kills_during_startup", 0) + 1
    res.runs += 2 if early else 1
    if victim == "daemon":
        r.kill_daemon()
        if early:
            r.spawn_daemon()
            time.sleep(ctx.rng.uniform(0.0, 0.4))
            r.kill_daemon()
        r.start_daemon()
    else:
        r.kill_node()
        (r.tmp / "consumer.busy").unlink(missing_ok=True)  # left behind by a kill inside on_events
        first = 100_000 * r.node_runs
        if early:
            r.spawn_node(first_tx=first)
            time.sleep(ctx.rng.uniform(0.0, 0.5))
            r.kill_node()
            first = 100_000 * r.node_runs
        r.start_node(first_tx=first)


def _wait_daemon_share(r: ChaosRig, timeout: float = 90) -> None:
    """Until the daemon's file holds every entry the WAL's markers give it (after the node stopped)."""
    _, daemon_exp, _ = expected_shares(r.node_dir)
    want = {tuple(e["pos"]) for e in daemon_exp}

    def done() -> bool:
        check(r.daemon is not None and r.daemon.poll() is None, f"the daemon died: {r.tail(r.daemon_err)}")
        got = {tuple(e["pos"]) for run in read_runs(r.daemon_out, r.daemon_cuts) for e in run}
        return want <= got

    wait_for(done, timeout, "the daemon to deliver its share", interval=0.3)


def episode(
    ctx: Ctx,
    res: Result,
    label: str,
    *,
    kills: int,
    victims: Sequence[str],
    realtime: bool = False,
    node_consumer: dict[str, Any] | None = None,
    lake: bool = False,
    switches: bool = False,
) -> None:
    tmp = ctx.episode_dir(label)
    daemon_consumer = None
    lake_path = tmp / "lake"
    if lake:
        daemon_consumer = {"kind": "lake", "lake_path": str(lake_path), "writer": "deltalake"}
    consumer = node_consumer
    if consumer is not None and "options" in consumer:
        options = {**consumer["options"], "path": str(tmp / "node.jsonl"), "busy_flag": str(tmp / "consumer.busy")}
        consumer = {**consumer, "options": options}
    with rig(tmp, realtime_cdc=realtime, consumer=consumer, daemon_consumer=daemon_consumer) as r:
        r.write_every = ctx.pick(4, 10)  # ~8k / ~20k entries/s
        r.start_node(pause_ms=20)
        r.start_daemon()
        r.wait_mode("on" if realtime else "off", "PASSIVE" if realtime else "ACTIVE")
        kinds: dict[str, int] = {}
        for _ in range(kills):
            time.sleep(ctx.rng.uniform(0.05, 0.9))
            if switches and ctx.rng.random() < 0.4:
                mode = r.status()["realtime"]["mode"]
                r.control("realtime", "off" if mode == "on" else "on")  # answers at once (off: within 2 s)
                time.sleep(ctx.rng.uniform(0.0, 0.3))
            choice = ctx.rng.choice(list(victims))
            for victim in ("node", "daemon") if choice == "both" else (choice,):
                _kill_and_restart(ctx, res, r, victim)
            kinds[choice] = kinds.get(choice, 0) + 1
        time.sleep(0.5)
        r.stop_node()
        if lake:
            r.wait_daemon_caught_up(timeout=120)
        else:
            _wait_daemon_share(r)
        r.stop_daemon()
        ctx.log(f"{label}: {kills} kills {kinds}, node runs {r.node_runs}, daemon runs {r.daemon_runs}")
        if lake:
            expected = wal_events(r.node_dir)
            d = lake_delivery(lake_path, expected)
            res.add(d)
            d.check_clean(f"{label} lake")
            check_lake_clean(lake_path, expected)
        else:
            d = r.delivery()
            res.add(d)
            d.check_clean(label)
            check_exact(r)
        check(d.written > 1000, f"{label}: only {d.written} entries written")


def _episodes(ctx: Ctx, res: Result, total: int, per_episode: int, **kw: Any) -> None:
    done = 0
    k = 0
    while done < total:
        n = min(per_episode, total - done)
        episode(ctx, res, f"ep{k}", kills=n, **kw)
        done += n
        k += 1
    startup = res.details.get("kills_during_startup", 0)
    note = f"{res.runs} SIGKILLs in {k} episodes ({startup} of them during a restarted process's start-up)"
    if "node_kills_inside_on_events" in res.details or kw.get("realtime"):
        note += f"; {res.details.get('node_kills_inside_on_events', 0)} node kills inside the consumer's on_events"
    res.notes.append(note)


def kill_daemon(ctx: Ctx, res: Result) -> None:
    """SIGKILL `cdcd run` (JSON lines) while the node writes."""
    _episodes(ctx, res, ctx.pick(4, 30), ctx.pick(4, 10), victims=["daemon"])


def kill_daemon_lake(ctx: Ctx, res: Result) -> None:
    """SIGKILL `cdcd run` with the lake sink (deltalake writer) while the node writes: zero duplicates in the lake."""
    res.duplicates_must_be_zero = True
    _episodes(ctx, res, ctx.pick(3, 15), ctx.pick(3, 8), victims=["daemon"], lake=True)


def kill_node(ctx: Ctx, res: Result) -> None:
    """SIGKILL the node (archive mode) while it writes; the daemon follows."""
    _episodes(ctx, res, ctx.pick(4, 30), ctx.pick(4, 10), victims=["node"])


def kill_node_realtime(ctx: Ctx, res: Result) -> None:
    """SIGKILL the node in realtime mode while its (slow) consumer delivers; the daemon stays PASSIVE."""
    consumer = {"kind": "python", "class": "chaos_sinks:SlowJsonl", "options": {"path": "", "delay_ms": 10}}
    _episodes(ctx, res, ctx.pick(4, 30), ctx.pick(4, 10), victims=["node"], realtime=True, node_consumer=consumer)


def kill_mixed(ctx: Ctx, res: Result) -> None:
    """SIGKILL the node, the daemon or both around `realtime on/off` switches."""
    consumer = {"kind": "python", "class": "chaos_sinks:SlowJsonl", "options": {"path": "", "delay_ms": 5}}
    _episodes(
        ctx,
        res,
        ctx.pick(3, 15),
        ctx.pick(3, 8),
        victims=["node", "daemon", "both"],
        realtime=True,
        node_consumer=consumer,
        switches=True,
    )
