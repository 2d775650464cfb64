"""Daemon TOML configs for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


# The lake sink compacts and optimizes on a schedule by default (a Spark session in the daemon): the
# config writers turn that off for a lake consumer that does not set its intervals (tests of landing);
# tests of maintenance set their own.
NO_MAINTENANCE: dict[str, Any] = {"compact_interval_s": 0.0, "optimize_interval_s": 0.0, "max_files_per_partition": 0}


def without_maintenance(consumer: dict[str, Any]) -> dict[str, Any]:
    return {**NO_MAINTENANCE, **consumer} if consumer.get("kind") == "lake" else consumer


def write_daemon_config(path: Path, node_dir: Path, consumer: dict[str, Any], **settings: Any) -> Path:
    """A daemon TOML config: quick polling, no metrics port, ``settings`` on top."""
    values: dict[str, Any] = {
        "node_dir": str(node_dir),
        "metrics_address": "",
        "lock_timeout_ms": 2000,
        "check_interval_ms": 50,
        "batch_max_delay_ms": 20,
        **settings,
    }
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    lines.append("[consumer]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in without_maintenance(consumer).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def jsonl_consumer(path: Path) -> dict[str, Any]:
    return {"kind": "jsonl", "path": str(path)}
