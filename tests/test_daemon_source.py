"""A daemon without a state of its own asks its node who delivers (cdcd/daemon/source.py): over the control
socket and in the metastorage where the node's config puts them (``node_config``), not at the defaults under
``node_dir``. Real nodes, real LMDB, a real ``cdcd run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd.config import ConfigError
from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.daemon.source import ask_node, node_caches
from cdcd.node.node import Node
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import read_jsonl, wal_events
from tests.support.writer import WRITER_NODE_SETTINGS, make_node


def node_toml(path: Path, node_dir: Path, **settings: str) -> Path:
    lines = [f'node_dir = "{node_dir}"', *(f'{k} = "{v}"' for k, v in settings.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_daemon_without_state_asks_the_socket_its_node_config_names(tmp_path: Path) -> None:
    """The node serves its control socket outside node_dir; the daemon (no state yet) reads the node's config,
    asks that socket (not the default under node_dir, where there is none), goes ACTIVE from the oldest link
    and delivers the WAL."""
    node_dir = tmp_path / "node"
    sock = tmp_path / "run" / "node-a.sock"
    sock.parent.mkdir()
    settings = {**WRITER_NODE_SETTINGS, "control_socket": str(sock)}
    make_node(node_dir, 2, 20, **settings)
    out = tmp_path / "out.jsonl"
    config = write_daemon_config(
        tmp_path / "cdcd.toml",
        node_dir,
        jsonl_consumer(out),
        node_config=str(node_toml(tmp_path / "node.toml", node_dir, control_socket=str(sock))),
    )
    with Node.open(node_dir, **settings):
        assert sock.exists() and not (node_dir / "control.sock").exists(), "the default would ask no socket"
        err = tmp_path / "run.err"
        proc = start_daemon(config, err)
        try:
            decided = wait_for(
                lambda: [e for e in log_events(err) if e["event"] == "daemon_state_from_node"], 60, "the decision"
            )
            expected = wal_events(node_dir)
            wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= len(expected), 60, "delivery")
        finally:
            assert stop_daemon(proc) == 0
    assert len(decided) == 1, decided
    assert decided[0]["source"] == f"control socket {sock}"
    assert decided[0]["mode"] == "ACTIVE" and decided[0]["start"] == "the oldest link"
    assert read_jsonl(out) == expected


def test_a_stopped_nodes_metastorage_and_caches_are_read_where_its_db_dir_is(tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    db = tmp_path / "elsewhere" / "db"
    make_node(node_dir, 1, 10, **WRITER_NODE_SETTINGS, db_dir=str(db))
    node_config = node_toml(tmp_path / "node.toml", node_dir, db_dir=str(db))
    config = DaemonConfig(node_dir=str(node_dir), node_config=str(node_config))
    answer = ask_node(config.node())
    assert answer is not None and not answer.realtime_on
    assert answer.source == f"metastorage {db / 'metastorage' / 'data.mdb'}"
    caches, source = node_caches(config.node())
    assert caches and source == f"node page store {db}"
    default = DaemonConfig(node_dir=str(node_dir)).node()
    assert ask_node(default) is None, "nothing at the default place"
    assert node_caches(default)[0] == {}


def test_a_node_config_that_is_missing_or_of_another_node_is_one_line(tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    missing = write_daemon_config(
        tmp_path / "a.toml", node_dir, jsonl_consumer(tmp_path / "o"), node_config="nope.toml"
    )
    with pytest.raises(ConfigError, match=rf"^{missing}: key 'node_config': nope.toml: config file not found$"):
        load_daemon_config(missing, environ={})
    other = node_toml(tmp_path / "node.toml", tmp_path / "other")
    wrong = write_daemon_config(tmp_path / "b.toml", node_dir, jsonl_consumer(tmp_path / "o"), node_config=str(other))
    with pytest.raises(ConfigError, match=rf"^{wrong}: key 'node_config': {other} configures node_dir .*other, not"):
        load_daemon_config(wrong, environ={})
