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
    lines += [f"{k} = {_toml_value(v)}" for k, v in consumer.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def jsonl_consumer(path: Path) -> dict[str, Any]:
    return {"kind": "jsonl", "path": str(path)}
