"""The alert rules of the lake, the Kafka sink and kafka-to-node (issue 31 item 5) under `promtool test
rules`: each fires on the series that should raise it and stays quiet on the healthy ones. The expected
annotations are the rule's own text with the labels filled in, so a rule whose text and labels disagree fails.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.support.metrics import CONFIG, promtool

__all__ = ["promtool"]  # fixture, used by name

RULES = CONFIG / "prometheus-alerts.yml"
D1 = {"instance": "d1", "job": "cdcd-daemon"}


def annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The alert's summary and description with ``{{ $labels.x }}`` filled in (the rules of this file use no $value)."""
    block = re.search(rf"- alert: {alert}\n(.*?)(?=\n      - alert: |\n  - name: |\Z)", RULES.read_text(), re.S)
    assert block is not None, alert
    out = {}
    for key in ("summary", "description"):
        m = re.search(rf'^\s+{key}: "(.*)"$', block.group(1), re.M)
        assert m is not None, (alert, key)
        out[key] = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda g: labels[g.group(1)], m.group(1))
    return out


def case(alert: str, series: dict[str, str], fires: list[str], quiet: list[str], labels: dict[str, str]) -> Any:
    """A promtool test: ``series`` (selector -> values, one per minute), the alert firing with ``labels``
    (the series' labels plus severity) at each time of ``fires`` and absent at each of ``quiet``."""
    expected = [{"exp_labels": labels, "exp_annotations": annotations(alert, labels)}]
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": t, "alertname": alert, "exp_alerts": expected} for t in fires]
        + [{"eval_time": t, "alertname": alert, "exp_alerts": []} for t in quiet],
    }


def sel(name: str, **labels: str) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in {**D1, **labels}.items()) + "}"


CASES = [
    # 10 minutes at 60 s, then 20 at 400 s: fires once 10 minutes over 300 s
    case(
        "CdcdLakeLagHigh",
        {sel("cdcd_lake_lag_seconds"): "60x10 400x20"},
        fires=["21m", "29m"],
        quiet=["5m", "15m"],
        labels={**D1, "severity": "warning"},
    ),
    # one failed landing at minute 5, none after: fires within 10 minutes of it, then clears
    case(
        "CdcdLakeCommitFailures",
        {sel("cdcd_lake_commit_failures_total"): "0x5 1x30"},
        fires=["6m", "14m"],
        quiet=["4m", "20m"],
        labels={**D1, "severity": "warning"},
    ),
    # compact fails at minute 5; optimize never does
    case(
        "CdcdLakeMaintenanceFailing",
        {
            sel("cdcd_lake_maintenance_failures_total", task="compact"): "0x5 1x60",
            sel("cdcd_lake_maintenance_failures_total", task="optimize"): "0x65",
        },
        fires=["6m", "30m"],
        quiet=["4m", "40m"],
        labels={**D1, "task": "compact", "severity": "warning"},
    ),
    # compaction skips cache b's table from minute 5 on (each run counts it), and never cache a's
    case(
        "CdcdLakeTypedTableSkipped",
        {
            sel("cdcd_lake_typed_table_failures_total", cache="b"): "0x5 1+1x10 11x50",
            sel("cdcd_lake_typed_table_failures_total", cache="a"): "0x65",
        },
        fires=["6m", "30m"],
        quiet=["4m", "60m"],
        labels={**D1, "cache": "b", "severity": "warning"},
    ),
    # optimize succeeds every minute for 30 minutes (its timestamp moves), then never again
    case(
        "CdcdLakeMaintenanceNotRun",
        {sel("cdcd_lake_last_maintenance_timestamp_seconds", task="optimize"): "0+60x30 1800x70"},
        fires=["96m"],
        quiet=["30m", "85m"],
        labels={**D1, "task": "optimize", "severity": "warning"},
    ),
    # the vacuum succeeds every 70 minutes (an hour, its jitter and its run): no "not run" alert between its runs
    case(
        "CdcdLakeMaintenanceNotRun",
        {sel("cdcd_lake_last_maintenance_timestamp_seconds", task="vacuum"): "0x69 4200x69 8400x69 12600x69"},
        fires=[],
        quiet=["68m", "138m", "208m"],
        labels={**D1, "task": "vacuum", "severity": "warning"},
    ),
    # the vacuum runs at minute 60, then never again: fires once four hours have passed since, for 5 minutes
    case(
        "CdcdLakeVacuumNotRun",
        {sel("cdcd_lake_last_maintenance_timestamp_seconds", task="vacuum"): "0x59 3600x300"},
        fires=["306m", "340m"],
        quiet=["119m", "299m"],
        labels={**D1, "task": "vacuum", "severity": "warning"},
    ),
    # 15 small files a partition, then 25 for good: fires after 30 minutes over 20 (full-size files, 40 of
    # them beside, do not count)
    case(
        "CdcdLakeTooManyFiles",
        {
            sel("cdcd_lake_small_files_per_partition_max"): "15x10 25x40",
            sel("cdcd_lake_files_per_partition_max"): "55x10 65x40",
        },
        fires=["41m"],
        quiet=["9m", "30m"],
        labels={**D1, "severity": "warning"},
    ),
    # commits wait a tenth of the time for 20 minutes, then 0.9 s of every second, then none again
    case(
        "CdcdLakeBackPressured",
        {sel("cdcd_lake_files_bound_wait_seconds_total"): "0+6x20 120+54x30 1740x30"},
        fires=["40m", "50m"],
        quiet=["19m", "30m", "65m"],
        labels={**D1, "severity": "warning"},
    ),
    # the log after each cleanup: 3,000 files, then 25,000 for good (compaction stopped): fires after 30 minutes
    case(
        "CdcdLakeLogLong",
        {sel("cdcd_lake_log_files", table="changes"): "3000x10 25000x40"},
        fires=["41m"],
        quiet=["9m", "30m"],
        labels={**D1, "table": "changes", "severity": "warning"},
    ),
    case(
        "CdcdKafkaTransactionAborts",
        {sel("cdcd_kafka_transaction_aborts_total"): "0x5 2x30"},
        fires=["6m", "19m"],
        quiet=["4m", "25m"],
        labels={**D1, "severity": "warning"},
    ),
    # kafka-to-node: healthy (reads and commits) for 10 minutes, then reads the same batch again and again
    # (restarts) while its last committed batch ages
    case(
        "CdcdKafkaToNodeStalled",
        {
            sel("cdcd_kafka_to_node_events_received_total", job="k2n"): "0+100x10 1000+100x30",
            sel("cdcd_kafka_to_node_last_batch_timestamp_seconds", job="k2n"): "0+60x10 600x30",
        },
        fires=["26m", "35m"],
        quiet=["5m", "15m", "20m"],
        labels={"instance": "d1", "job": "k2n", "severity": "critical"},
    ),
    case(
        "CdcdKafkaToNodeRejected",
        {sel("cdcd_kafka_to_node_events_rejected_total", job="k2n"): "0x5 3x30"},
        fires=["6m"],
        quiet=["4m", "25m"],
        labels={"instance": "d1", "job": "k2n", "severity": "warning"},
    ),
]


def test_lake_kafka_and_kafka_to_node_alerts_fire_and_stay_quiet(promtool: str, tmp_path: Path) -> None:
    """`promtool test rules`: every new alert fires on its failing series (after its `for:`) and not before,
    nor on the healthy series, nor once the trouble is over."""
    test = tmp_path / "rules-test.yml"
    test.write_text(json.dumps({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": CASES}))
    res = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


NEW_METRICS = (
    "cdcd_lake_lag_seconds",
    "cdcd_lake_commit_failures_total",
    "cdcd_lake_maintenance_failures_total",
    "cdcd_lake_typed_table_failures_total",
    "cdcd_lake_last_maintenance_timestamp_seconds",
    "cdcd_lake_small_files_per_partition_max",
    "cdcd_lake_files_bound_wait_seconds_total",
    "cdcd_lake_log_files",
    "cdcd_kafka_transaction_aborts_total",
    "cdcd_kafka_to_node_events_received_total",
    "cdcd_kafka_to_node_last_batch_timestamp_seconds",
    "cdcd_kafka_to_node_events_rejected_total",
)


def test_every_lake_kafka_and_kafka_to_node_figure_has_a_panel_and_an_alert() -> None:
    dashboard = json.loads((CONFIG / "grafana-dashboard.json").read_text())
    panels = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    exprs = " ".join(line for line in RULES.read_text().splitlines() if "expr:" in line)
    for name in NEW_METRICS:
        assert re.search(rf"\b{name}\b", panels), f"no dashboard panel queries {name}"
        assert re.search(rf"\b{name}\b", exprs), f"no alert rule uses {name}"
    assert re.search(r"\bcdcd_kafka_retries_total\b", panels)
    # All files, full-size ones included, grow with the data: a panel beside the small files' count, no alert.
    assert re.search(r"\bcdcd_lake_files_per_partition_max\b", panels)
