"""Daemons of several consumers as the observability tests drive them: their config, a consumer whose target is
down while a file exists, ``cdcd top --once --json``, labelled samples of a metrics endpoint, and promtool cases
for alert rules."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.lake import toml_value
from tests.support.metrics import CONFIG, scrape_text
from tests.support.procs import CDCD, child_env

SETTINGS: dict[str, Any] = {
    "metrics_address": "",
    "lock_timeout_ms": 5000,
    "check_interval_ms": 50,
    "batch_max_delay_ms": 20,
    "batch_max_events": 200,
    "read_chunk_records": 32,
}
RULES = CONFIG / "prometheus-alerts.yml"


def fanout_config(
    path: Path,
    node_dir: Path,
    consumers: dict[str, dict[str, Any]],
    *,
    default: dict[str, Any] | None = None,
    **kw: Any,
) -> Path:
    """A daemon config with ``[consumers.<name>]`` tables (and ``[consumer]`` if ``default``)."""
    values = {"node_dir": str(node_dir), **SETTINGS, **kw}
    lines = [f"{k} = {toml_value(v)}" for k, v in values.items()]
    if default is not None:
        lines.append("[consumer]")
        lines += [f"{k} = {toml_value(v)}" for k, v in default.items()]
    for name, table in consumers.items():
        lines.append(f"[consumers.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


OUTAGE = textwrap.dedent(
    """
    import os
    from cdcd.consumer import RetriableError
    from cdcd.sinks.jsonl import JsonlConsumer

    class Outage(JsonlConsumer):
        \"\"\"A jsonl file whose target is down (RetriableError) while the file ``down`` exists.\"\"\"

        def __init__(self, path: str, down: str) -> None:
            super().__init__(path)
            self.down = down

        def on_events(self, batch):
            if os.path.exists(self.down):
                raise RetriableError("target down")
            return super().on_events(batch)
    """
)
"""Module ``outagesink`` (write it into a dir on the daemon's PYTHONPATH): ``class = "outagesink:Outage"``."""

SLOW_CALLS = textwrap.dedent(
    """
    import json
    import time
    from cdcd.sinks.jsonl import JsonlConsumer

    class SlowCalls(JsonlConsumer):
        \"\"\"A jsonl file each of whose calls takes ``call_s`` more (a sleep: no CPU, no GIL), as a sink waiting on
        its target does; ``calls`` gets a line per call: when it began, its events, the commit time of its first.\"\"\"

        def __init__(self, path: str, calls: str, call_s: float) -> None:
            super().__init__(path, fsync=False)
            self.calls = calls
            self.call_s = call_s

        def on_events(self, batch):
            began_ns = time.time_ns()
            slices = batch.peek_slices()
            first_ns = slices[0].record.commit_ts_ns if slices else 0
            time.sleep(self.call_s)
            with open(self.calls, "a") as f:
                f.write(json.dumps({"began_ns": began_ns, "first_ns": first_ns, "events": len(batch)}) + "\\n")
            return super().on_events(batch)
    """
)
"""Module ``slowsink`` (write it into a dir on the daemon's PYTHONPATH): ``class = "slowsink:SlowCalls"``."""


def newest_commit_ns(path: Path) -> int:
    """The commit time of the newest entry in a jsonl file (0: none yet)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = [line for line in f.read().splitlines() if line.endswith(b"}")]
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["commit_ts_ns"])
        except (ValueError, KeyError):
            continue
    return 0


def top_json(node_dir: Path, config: Path, *extra: str) -> dict[str, Any]:
    """``cdcd top --once --json`` of ``node_dir`` and its daemon's ``config``: exit 0, nothing on stderr."""
    res = subprocess.run(
        [*CDCD, "top", "--node-dir", str(node_dir), "--config", str(config), "--once", "--json", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    return dict(json.loads(res.stdout))


def labelled(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics`` by (name, labels)."""
    out = {}
    for family in text_string_to_metric_families(scrape_text(port)):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = float(s.value)
    return out


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def rule_annotations(alert: str, labels: dict[str, str], value: str = "") -> dict[str, str]:
    """The alert's summary and description in RULES with ``{{ $labels.x }}`` filled in, and ``{{ $value ... }}``
    as ``value`` (as promtool renders it)."""
    block = re.search(rf"- alert: {alert}\n(.*?)(?=\n      - alert: |\n  - name: |\n  # |\Z)", RULES.read_text(), re.S)
    assert block is not None, alert
    out = {}
    for key in ("summary", "description"):
        m = re.search(rf'^\s+{key}: "(.*)"$', block.group(1), re.M)
        assert m is not None, (alert, key)
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda g: labels[g.group(1)], m.group(1))
        out[key] = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
    return out


def rule_case(
    alert: str, series: dict[str, str], fires: list[str], quiet: list[str], labels: dict[str, str], value: str = ""
) -> Any:
    """A promtool test: ``series`` (selector -> values, one per minute), the alert firing with ``labels`` (the
    series' labels plus severity) at each time of ``fires`` and absent at each of ``quiet``; ``value``: how its
    text shows ``$value`` there."""
    expected = [{"exp_labels": labels, "exp_annotations": rule_annotations(alert, labels, value)}]
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": t, "alertname": alert, "exp_alerts": expected} for t in fires]
        + [{"eval_time": t, "alertname": alert, "exp_alerts": []} for t in quiet],
    }
