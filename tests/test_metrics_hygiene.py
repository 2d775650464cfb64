"""Each process exports only its own metric families, in a form `promtool check metrics` accepts; the shipped
alert rules pass `promtool check rules`, and rules and dashboard name only metrics cdcd exports (issue 13 item 5).

promtool comes from Debian's prometheus package, installed by scripts/ensure-promtool.sh (CI runs it too).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cdcd import metrics
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.metrics import CONFIG, promtool, scrape_text, try_samples
from tests.support.ports import free_port
from tests.support.procs import child_env, error_lines, run_daemon_until_exit, start_daemon, stop_daemon, wait_for
from tests.support.writer import make_node

ROOT = Path(__file__).resolve().parent.parent
__all__ = ["promtool"]  # fixture, used by name
# Every registry cdcd defines, found rather than listed (a new group cannot be forgotten here).
GROUPS = {
    name.lower(): reg
    for name, reg in vars(metrics).items()
    if isinstance(reg, CollectorRegistry) and reg is not metrics.REGISTRY  # the default: process and GC figures
}


def cdcd_families(text: str) -> set[str]:
    """cdcd family names of a scrape (the text format shows ``_created`` samples as families of their own)."""
    names = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("cdcd_")}
    return {n for n in names if not n.endswith("_created")}


def group_names(*groups: str) -> set[str]:
    """Every sample name the groups can export (labelled families have no samples before first use)."""
    names: set[str] = set()
    for group in groups:
        for family in GROUPS[group].collect():
            base = family.name
            names |= {base, *(base + s for s in ("_total", "_created", "_bucket", "_count", "_sum"))}
    return names


def promtool_check_metrics(promtool: str, text: str) -> None:
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_node_and_daemon_export_only_their_own_families_and_pass_promtool(tmp_path: Path, promtool: str) -> None:
    """A writing `cdcd node run` serves cdcd_node_* families only (no daemon, lake or replication series, no
    last-commit timestamp at 0); a delivering `cdcd run` serves cdcd_daemon_* only; promtool accepts both scrapes."""
    node_dir = tmp_path / "node"
    node_port, daemon_port = free_port(), free_port()
    node_cfg = tmp_path / "node.toml"
    node_cfg.write_text(
        f'node_dir = "{node_dir}"\nmetrics_address = "127.0.0.1:{node_port}"\n'
        "wal_force_archive_timeout_ms = 100\nwal_segment_size_bytes = 65536\n"
    )
    node_log = (tmp_path / "node.log").open("wb")
    node = subprocess.Popen(
        [sys.executable, "-m", "cdcd", "node", "run", "--config", str(node_cfg), "--load-rate", "300"],
        stdout=node_log,
        stderr=node_log,
        env=child_env(),
    )
    daemon = None
    try:
        wait_for(
            lambda: (m := try_samples(node_port)) and m.get("cdcd_node_cdc_links_total", 0) >= 2, 120, "node links"
        )
        config = write_daemon_config(
            tmp_path / "cdcd.toml",
            node_dir,
            jsonl_consumer(tmp_path / "out.jsonl"),
            metrics_address=f"127.0.0.1:{daemon_port}",
        )
        daemon = start_daemon(config, tmp_path / "run.err")
        wait_for(
            lambda: (m := try_samples(daemon_port)) and m.get("cdcd_daemon_events_total", 0) > 0, 120, "deliveries"
        )
        node_text, daemon_text = scrape_text(node_port), scrape_text(daemon_port)
    finally:
        if daemon is not None:
            assert stop_daemon(daemon) == 0
        node.terminate()
        assert node.wait(60) == 0

    node_families, daemon_families = cdcd_families(node_text), cdcd_families(daemon_text)
    assert node_families and all(n.startswith("cdcd_node_") for n in node_families), sorted(node_families)
    assert daemon_families and all(n.startswith("cdcd_daemon_") for n in daemon_families), sorted(daemon_families)
    assert {f.name for f in metrics.NODE.collect()} == node_families
    assert {f.name for f in metrics.DAEMON.collect()} == daemon_families
    assert "cdcd_node_realtime_lag_seconds" in node_families
    promtool_check_metrics(promtool, node_text)
    promtool_check_metrics(promtool, daemon_text)


def expr_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bcdcd_[a-z0-9_]+", expr))


def test_alert_rules_pass_promtool_and_name_exported_metrics(promtool: str) -> None:
    """`promtool check rules` accepts config/prometheus-alerts.yml; its rules cover lag, stall, realtime stops,
    mode flapping, skipped links and replication rejects, and every cdcd metric they use exists."""
    rules = CONFIG / "prometheus-alerts.yml"
    res = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    text = rules.read_text()
    for alert in (
        "CdcdDaemonLagHigh",
        "CdcdDaemonStalled",
        "CdcdRealtimeStopped",
        "CdcdModeFlapping",
        "CdcdCdcLinksSkipped",
        "CdcdReplicationRejected",
        "CdcdConsumerRetrying",
        "CdcdDeadLetters",
    ):
        assert f"alert: {alert}\n" in text, alert
    used = expr_metric_names("\n".join(line for line in text.splitlines() if "expr:" in line))
    assert used and used <= group_names(*GROUPS), sorted(used - group_names(*GROUPS))


RETRYING_RULE_TEST = """
rule_files: [{rules}]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      # healthy for a minute, then a retry step every 15 s (an outage), then healthy again
      - series: 'cdcd_daemon_consumer_retries_total{{instance="d1", job="cdcd-daemon"}}'
        values: '0 0 0 0 0 1+1x12 13x20'
    alert_rule_test:
      - {{eval_time: 1m, alertname: CdcdConsumerRetrying, exp_alerts: []}}
      - {{eval_time: 2m, alertname: CdcdConsumerRetrying, exp_alerts: []}}
      - eval_time: 2m30s
        alertname: CdcdConsumerRetrying
        exp_alerts:
          - exp_labels: {{severity: warning, instance: d1, job: cdcd-daemon}}
            exp_annotations:
              summary: "cdcd consumer on d1 has been retrying a transient failure for over a minute"
              description: "{description}"
      - {{eval_time: 7m, alertname: CdcdConsumerRetrying, exp_alerts: []}}
"""


def test_consumer_retrying_alert_fires_after_a_minute_of_retries(promtool: str, tmp_path: Path) -> None:
    """`promtool test rules`: CdcdConsumerRetrying stays quiet for the first minute of retry steps, fires once
    they have gone on for a minute, and clears once they stop."""
    rules = CONFIG / "prometheus-alerts.yml"
    description = re.search(r"CdcdConsumerRetrying.*?description: \"(.*?)\"\n", rules.read_text(), re.S)
    assert description is not None
    test = tmp_path / "retrying-test.yml"
    test.write_text(RETRYING_RULE_TEST.format(rules=json.dumps(str(rules)), description=description.group(1)))
    res = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


DEAD_LETTERS_RULE_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # two dead letters of cache "orders" at minute 5, then none
      - series: 'cdcd_daemon_dead_letters_total{{instance="d1", job="cdcd-daemon", cache="orders"}}'
        values: '0 0 0 0 0 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2'
    alert_rule_test:
      - {{eval_time: 4m, alertname: CdcdDeadLetters, exp_alerts: []}}
      - eval_time: 6m
        alertname: CdcdDeadLetters
        exp_alerts:
          - exp_labels: {{severity: warning, instance: d1, job: cdcd-daemon, cache: orders}}
            exp_annotations:
              summary: "{summary}"
              description: "{description}"
      - {{eval_time: 20m, alertname: CdcdDeadLetters, exp_alerts: []}}
"""


def test_dead_letters_alert_fires_when_events_are_set_aside(promtool: str, tmp_path: Path) -> None:
    """`promtool test rules`: CdcdDeadLetters fires at once when a cache's events become dead letters, naming the
    cache, and clears ten minutes after the last one."""
    rules = CONFIG / "prometheus-alerts.yml"
    rule = re.search(r"CdcdDeadLetters.*?summary: \"(.*?)\"\n.*?description: \"(.*?)\"\n", rules.read_text(), re.S)
    assert rule is not None
    summary = rule.group(1).replace("{{ $labels.instance }}", "d1").replace("{{ $labels.cache }}", "orders")
    test = tmp_path / "dead-letters-test.yml"
    test.write_text(
        DEAD_LETTERS_RULE_TEST.format(
            rules=json.dumps(str(rules)), summary=summary.replace("{{ $value }}", "2"), description=rule.group(2)
        )
    )
    res = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_grafana_dashboard_queries_exported_metrics() -> None:
    """config/grafana-dashboard.json is a dashboard whose every query names metrics cdcd exports (no stale names
    such as the old cdcd_node_realtime_lag_ms)."""
    dashboard = json.loads((CONFIG / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = set().union(*map(expr_metric_names, exprs))
    assert used <= group_names(*GROUPS), sorted(used - group_names(*GROUPS))
    for wanted in (
        "cdcd_daemon_lag_seconds",
        "cdcd_daemon_segments_pending",
        "cdcd_node_realtime_lag_seconds_bucket",
        "cdcd_daemon_consumer_retries_total",
        "cdcd_daemon_dead_letters_total",
    ):
        assert wanted in used, wanted


def test_metrics_port_in_use_exits_2_naming_the_key(tmp_path: Path) -> None:
    """Two daemon instances configured with one metrics port: the second exits 2 (systemd does not restart it)
    with one line naming its config file and metrics_address."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_daemon_config(
            tmp_path / "cdcd.toml", node_dir, {"kind": "null"}, metrics_address=f"127.0.0.1:{port}"
        )
        err = tmp_path / "run.err"
        assert run_daemon_until_exit(config, err, timeout=60) == 2
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(
        f"cdcd: error: {config}: key 'metrics_address': cannot listen on 127.0.0.1:{port}:"
    ), lines


def test_the_docs_name_only_exported_metrics() -> None:
    """Every full metric name in README.md and docs/*.md is one cdcd exports (a family prefix such as
    ``cdcd_kafka_`` in prose is not a name, nor is a quoted JSON key such as the compaction mark's
    ``"cdcd_format"``); a renamed metric fails here, not on an operator's dashboard."""
    exported = group_names(*GROUPS)
    assert "cdcd_kafka_sent_events_total" in exported and "cdcd_node_wal_bytes_total" in exported
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"(?<!\")\bcdcd_[a-z0-9_]*[a-z0-9]\b(?![_\"])", doc.read_text()):
            if m.group(0) not in exported:
                line = doc.read_text().count("\n", 0, m.start()) + 1
                stale.append(f"{doc.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not stale, "\n".join(stale)
