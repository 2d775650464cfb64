"""Every consumer of a daemon visible (issue 45): `cdcd top`, the labelled metrics, the alerts, `state show`'s and
the node's one spelling of who delivers, and `control realtime on|off` naming the consumer it switches. Real
daemon and node processes, their real metrics endpoints, promtool for the rules."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.fanout import OUTAGE, RULES, fanout_config, labelled, rule_case, sample, top_json
from tests.support.metrics import promtool
from tests.support.ports import free_port
from tests.support.procs import (
    CDCD,
    cdcd,
    child_env,
    log_events,
    start_daemon,
    state_show,
    stop_daemon,
    wait_for,
)
from tests.support.realtime import Rig
from tests.support.wal import archived_segments, cdc_links, wal_events
from tests.support.writer import make_node

__all__ = ["promtool"]  # fixture, used by name


def by_name(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in snap["consumers"]}


def test_top_and_metrics_show_a_consumer_retrying_then_invalidated_beside_one_delivering(tmp_path: Path) -> None:
    """A jsonl consumer and one whose target is down, with a max_retained_bytes cap: `cdcd top --once --json`
    lists both, the second retrying, then, once the node archived past its cap, invalidated with the line that
    says why; the labelled metrics say the same by value; with the daemon stopped, top still shows it
    invalidated (from its state) and the other stopped because no daemon runs."""
    (tmp_path / "outagesink.py").write_text(OUTAGE)
    node_dir = tmp_path / "node"
    next_tx = make_node(node_dir, segments=3, tx_per_segment=20)
    first_links = sum(p.stat().st_size for p in cdc_links(node_dir).values())
    cap = 2 * first_links
    down = tmp_path / "down"
    down.touch()
    port = free_port()
    config = fanout_config(
        tmp_path / "fanout.toml",
        node_dir,
        {
            "late": {
                "kind": "python",
                "class": "outagesink:Outage",
                "options": {"path": str(tmp_path / "late.jsonl"), "down": str(down)},
                "retry_timeout_s": 600,
                "max_retained_bytes": cap,
            }
        },
        default={"kind": "jsonl", "path": str(tmp_path / "live.jsonl")},
        metrics_address=f"127.0.0.1:{port}",
    )
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=child_env(tmp_path))
    try:

        def state_is(name: str, state: str) -> bool:
            assert proc.poll() is None, err.read_text()[-3000:]
            try:
                return sample(labelled(port), "cdcd_daemon_consumer_state", consumer=name, state=state) == 1
            except OSError:
                return False  # not serving yet

        wait_for(lambda: state_is("late", "retrying"), 60, "late retrying")
        end = (max(archived_segments(node_dir)) + 1, 0, 0)
        wait_for(lambda: tuple(state_show(config)["consumers"]["default"]["position_parts"]) == end, 60, "default")
        snap = top_json(node_dir, config)
        assert [c["name"] for c in snap["consumers"]] == ["default", "late"]
        default, late = by_name(snap)["default"], by_name(snap)["late"]
        assert (default["kind"], default["state"], default["why"], default["delivered_by"]) == (
            "jsonl",
            "delivering",
            "",
            "daemon",
        )
        assert default["realtime"] and not late["realtime"]
        assert default["position_parts"] == list(end) and default["lag_bytes"] == 0
        assert default["events_total"] == len(wal_events(node_dir))
        assert (late["kind"], late["state"]) == ("python", "retrying") and "consumer_retrying" in late["why"]
        # Its position: where the cache announcements left it, in the first link, which it holds with the rest.
        seg, offset, _ = late["position_parts"]
        assert seg == min(cdc_links(node_dir)) and late["events_total"] == 0
        assert late["lag_bytes"] == first_links - offset
        samples = labelled(port)
        assert sample(samples, "cdcd_daemon_consumer_retained_bytes", consumer="late") == first_links
        assert sample(samples, "cdcd_daemon_consumer_retained_bytes", consumer="default") == 0
        assert sample(samples, "cdcd_daemon_consumer_max_retained_bytes", consumer="late") == cap
        assert sample(samples, "cdcd_daemon_consumer_max_retained_bytes", consumer="default") == 0

        # The node archives on while late's target stays down: past its cap it is invalidated, mid-retry.
        make_node(node_dir, segments=6, tx_per_segment=20, first_tx=next_tx)
        wait_for(lambda: state_is("late", "invalidated"), 60, "late invalidated")
        samples = labelled(port)
        for name, state in (("late", "invalidated"), ("default", "delivering")):
            for each in ("delivering", "retrying", "stopped", "invalidated"):
                got = sample(samples, "cdcd_daemon_consumer_state", consumer=name, state=each)
                assert got == (1.0 if each == state else 0.0), (name, each, got)
        assert sample(samples, "cdcd_daemon_consumer_up", consumer="late") == 0
        assert sample(samples, "cdcd_daemon_consumer_up", consumer="default") == 1
        assert sample(samples, "cdcd_daemon_consumer_invalidations_total", consumer="late") == 1
        assert sample(samples, "cdcd_daemon_consumer_invalidations_total", consumer="default") is None
        assert sample(samples, "cdcd_daemon_consumer_retained_bytes", consumer="late") == 0
        end = (max(archived_segments(node_dir)) + 1, 0, 0)
        wait_for(lambda: tuple(state_show(config)["consumers"]["default"]["position_parts"]) == end, 60, "default")
        snap = top_json(node_dir, config)
        late = by_name(snap)["late"]
        assert late["state"] == "invalidated" and late["lag_bytes"] == 0
        assert "consumer late invalidated" in late["why"] and f"max_retained_bytes = {cap}" in late["why"]
        assert by_name(snap)["default"]["state"] == "delivering"
        text = subprocess.run(
            [*CDCD, "top", "--node-dir", str(node_dir), "--config", str(config), "--once"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**child_env(), "COLUMNS": "200"},
        )
        assert text.returncode == 0 and text.stderr == "", text.stderr
        lines = text.stdout.splitlines()
        late_row = next(line for line in lines if " late " in line and " python " in line)
        default_row = next(line for line in lines if " default * " in line and " jsonl " in line)
        assert "invalidated" in late_row and "delivering" in default_row, text.stdout
    finally:
        code = stop_daemon(proc)
    assert code == 7, err.read_text()[-3000:]
    assert [e["consumer"] for e in log_events(err) if e.get("event") == "consumer_invalidated"] == ["late"]
    after = by_name(top_json(node_dir, config))
    assert after["late"]["state"] == "invalidated" and "max_retained_bytes" in after["late"]["why"]
    assert (after["default"]["state"], after["default"]["why"]) == ("stopped", "daemon not running")


def test_a_daemon_of_one_consumer_shows_it_as_default(tmp_path: Path) -> None:
    """A daemon of one `[consumer]`: top lists one consumer, `default`, delivering, caught up, every event
    counted; `state show` says who delivers it once (`delivered_by`) and keeps the deprecated spellings."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=3, tx_per_segment=20)
    port = free_port()
    config = write_daemon_config(
        tmp_path / "cdcd.toml",
        node_dir,
        jsonl_consumer(tmp_path / "out.jsonl"),
        metrics_address=f"127.0.0.1:{port}",
        check_interval_ms=50,
    )
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    end = [max(archived_segments(node_dir)) + 1, 0, 0]
    try:
        wait_for(lambda: state_show(config)["position_parts"] == end, 60, "the daemon at the end")
        (one,) = top_json(node_dir, config)["consumers"]
        show = state_show(config)
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    assert (one["name"], one["kind"], one["state"], one["delivered_by"]) == ("default", "jsonl", "delivering", "daemon")
    assert one["position_parts"] == end and one["lag_bytes"] == 0 and one["realtime"]
    assert one["events_total"] == len(wal_events(node_dir))
    assert show["delivered_by"] == show["consumers"]["default"]["delivered_by"] == "daemon"
    assert (show["mode"], show["cdc_mode"]) == ("ACTIVE", "DAEMON_ACTIVE")  # deprecated, kept one release


def test_realtime_on_and_off_name_the_consumer_they_switch(tmp_path: Path) -> None:
    """The node's `[realtime_consumer]` names `lake`, one of two consumers of the daemon: `control realtime on`
    and `off` keep their one line on stdout and name `lake` on stderr; the node's status says per consumer who
    delivers it (the realtime worker for `lake` while on, the daemon for `default` throughout), as does
    `state show` once the daemon's lake consumer followed the hand-over."""
    rig = Rig(tmp_path, consumer={**jsonl_consumer(tmp_path / "node.jsonl"), "name": "lake"})
    try:
        rig.daemon_config = fanout_config(
            tmp_path / "fanout.toml",
            rig.node_dir,
            {"lake": jsonl_consumer(tmp_path / "lake.jsonl")},
            default=jsonl_consumer(tmp_path / "default.jsonl"),
            realtime_consumer="lake",
        )
        rig.start_node(pause_ms=30)
        rig.start_daemon()
        where = ["control", "--node-dir", str(rig.node_dir)]
        on = cdcd(*where, "cdc", "realtime", "on")
        assert on.returncode == 0 and on.stdout.strip() in ("realtime: try_start", "realtime: on"), on.stderr
        assert on.stderr.startswith("consumer lake: to the node's realtime worker;"), on.stderr
        wait_for(lambda: rig.status()["realtime"]["mode"] == "on", 60, "realtime on")
        consumers = rig.status()["consumers"]
        assert consumers["lake"]["delivered_by"] == "realtime" and consumers["lake"]["realtime_consumer"]
        assert consumers["default"]["delivered_by"] == "daemon" and not consumers["default"]["realtime_consumer"]
        shown = lambda: state_show(rig.daemon_config)["consumers"]  # noqa: E731
        wait_for(lambda: shown()["lake"]["delivered_by"] == "realtime", 60, "the daemon's lake consumer PASSIVE")
        assert shown()["default"]["delivered_by"] == "daemon"
        # The single-consumer keys describe the consumer the realtime worker hands over with, not `default`.
        assert rig.status()["daemon"]["mode"] == "PASSIVE"
        text = cdcd(*where, "status").stdout
        assert "consumer lake" in text and "realtime worker" in text, text
        off = cdcd(*where, "realtime", "off")
        assert off.returncode == 0 and off.stdout.strip() in ("realtime: off", "realtime: stopping"), off.stderr
        assert off.stderr.startswith("consumer lake: handed back to the daemon"), off.stderr
        wait_for(lambda: rig.status()["consumers"]["lake"]["delivered_by"] == "daemon", 60, "realtime off")
        wait_for(lambda: shown()["lake"]["delivered_by"] == "daemon", 60, "the daemon's lake consumer ACTIVE")
        as_json = json.loads(cdcd(*where, "status", "--json").stdout)
        assert {n: c["delivered_by"] for n, c in as_json["consumers"].items()} == {
            "default": "daemon",
            "lake": "daemon",
        }
        assert as_json["delivering"] == "daemon" and as_json["cdc_mode"] == "DAEMON_ACTIVE"  # deprecated, kept
    finally:
        rig.close()


def test_a_realtime_consumer_name_that_is_no_name_is_refused(tmp_path: Path) -> None:
    node = tmp_path / "node.toml"
    node.write_text(f'node_dir = "{tmp_path / "n"}"\n[realtime_consumer]\nkind = "null"\nname = "a b"\n')
    res = cdcd("node", "run", "--config", str(node))
    assert res.returncode == 2, res.stderr
    assert "realtime_consumer.name" in res.stderr and "'a b'" in res.stderr, res.stderr


D1 = {"instance": "d1", "job": "cdcd-daemon"}


def sel(name: str, **labels: str) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in {**D1, **labels}.items()) + "}"


def states(consumer: str, *timeline: tuple[str, int]) -> dict[str, str]:
    """cdcd_daemon_consumer_state series of ``consumer``: each (state, minutes) in turn, 1 for the state held."""
    out = {}
    for each in ("delivering", "retrying", "stopped", "invalidated"):
        out[sel("cdcd_daemon_consumer_state", consumer=consumer, state=each)] = " ".join(
            f"{1 if state == each else 0}x{minutes - 1}" for state, minutes in timeline
        )
    return out


CASES = [
    # late is invalidated at minute 10; default delivers throughout: fires at once, for late only
    rule_case(
        "CdcdConsumerInvalidated",
        {
            **states("late", ("delivering", 5), ("retrying", 5), ("invalidated", 20)),
            **states("default", ("delivering", 30)),
        },
        fires=["10m", "25m"],
        quiet=["9m"],
        labels={**D1, "consumer": "late", "state": "invalidated", "severity": "critical"},
    ),
    rule_case(
        "CdcdConsumerStopped",
        {**states("broken", ("delivering", 10), ("stopped", 20)), **states("default", ("delivering", 30))},
        fires=["11m", "25m"],
        quiet=["9m", "10m"],
        labels={**D1, "consumer": "broken", "state": "stopped", "severity": "critical"},
    ),
    # kafka 300 s behind from minute 10 on; the lake keeps up
    rule_case(
        "CdcdConsumerLagHigh",
        {
            sel("cdcd_daemon_consumer_lag_seconds", consumer="kafka"): "1x10 300x20",
            sel("cdcd_daemon_consumer_lag_seconds", consumer="lake"): "1x30",
        },
        fires=["16m", "25m"],
        quiet=["10m", "15m"],
        labels={**D1, "consumer": "kafka", "severity": "warning"},
        value="5m 0s",
    ),
    # kafka commits every minute for 10 minutes, then never again while it holds links; lake commits on and on
    rule_case(
        "CdcdConsumerStuck",
        {
            sel("cdcd_daemon_consumer_retained_bytes", consumer="kafka"): "1000x40",
            sel("cdcd_daemon_consumer_last_commit_timestamp_seconds", consumer="kafka"): "0+60x10 600x30",
            sel("cdcd_daemon_consumer_retained_bytes", consumer="lake"): "1000x40",
            sel("cdcd_daemon_consumer_last_commit_timestamp_seconds", consumer="lake"): "0+60x40",
        },
        fires=["26m", "35m"],
        quiet=["5m", "20m"],
        labels={**D1, "consumer": "kafka", "severity": "critical"},
    ),
    # replica's links grow to 90% of its cap; default has no cap (0) and holds more
    rule_case(
        "CdcdConsumerRetainedNearCap",
        {
            sel("cdcd_daemon_consumer_retained_bytes", consumer="replica"): "100+100x8 900x20",
            sel("cdcd_daemon_consumer_max_retained_bytes", consumer="replica"): "1000x30",
            sel("cdcd_daemon_consumer_retained_bytes", consumer="default"): "5000x30",
            sel("cdcd_daemon_consumer_max_retained_bytes", consumer="default"): "0x30",
        },
        fires=["13m", "25m"],
        quiet=["7m", "11m"],
        labels={**D1, "consumer": "replica", "severity": "warning"},
    ),
]


def test_the_consumer_alerts_fire_per_consumer_and_name_it(promtool: str, tmp_path: Path) -> None:
    """`promtool test rules`: each consumer alert fires for the consumer in trouble (its name in the labels and
    the text), after its `for:`, and not for the healthy consumer beside it."""
    test = tmp_path / "rules-test.yml"
    test.write_text(json.dumps({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": CASES}))
    res = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
