"""Segments and states of another node (issue 13.2, 19.2): refused with one line, never delivered, never a
reason to delete a link. Real nodes written in-process, real ``cdcd run`` processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cdcd.node.identity import read_node_id
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import catch_up_and_stop, error_lines, log_events, run_daemon_until_exit, state_position
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import make_node


def only_error_line(err: Path) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, err.read_text()[-3000:]
    assert "Traceback" not in err.read_text()
    return lines[0]


def inodes(node_dir: Path) -> dict[int, int]:
    return {seg: p.stat().st_ino for seg, p in cdc_links(node_dir).items()}


def test_segment_of_another_node_stops_the_daemon_before_any_of_it_is_delivered(tmp_path: Path) -> None:
    """A segment copied from another node into the CDC dir, at the index this node writes next: exit 5 with one line
    naming the file and both node ids; nothing of it delivered, the position stays before it, no link deleted. The
    node's own segment with that index, once it is there, is delivered exactly."""
    a, b = tmp_path / "a", tmp_path / "b"
    out = tmp_path / "out.jsonl"
    n = make_node(a, segments=2, tx_per_segment=5)
    make_node(b, segments=4, tx_per_segment=7, first_tx=50_000)
    id_a, id_b = read_node_id(a), read_node_id(b)
    assert id_a is not None and id_b is not None and id_a != id_b
    config = write_daemon_config(tmp_path / "cdcd.toml", a, jsonl_consumer(out))
    catch_up_and_stop(config, tmp_path / "run1.err", (2, 0, 0))
    delivered = read_jsonl(out)
    assert delivered == wal_events(a)

    foreign = a / "cdc" / "0000000000000002.wal"
    shutil.copyfile(archived_segments(b)[2], foreign)
    err = tmp_path / "run2.err"
    assert run_daemon_until_exit(config, err) == 5
    assert only_error_line(err) == (
        f"cdcd: error: {foreign} at offset 0: segment of node {id_b}, not of this node {id_a} "
        "(copied from another node?)"
    )
    assert read_jsonl(out) == delivered, "nothing of the foreign segment was delivered"
    assert state_position(config) == (2, 0, 0)
    assert foreign.exists(), "the daemon never deletes what it did not consume"
    assert not [e for e in log_events(err) if e["event"] == "stale_link_deleted"]

    # The operator removes the copy; the node writes its real segment 2 (and 3): delivered exactly, once.
    foreign.unlink()
    make_node(a, segments=2, tx_per_segment=5, first_tx=n)
    catch_up_and_stop(config, tmp_path / "run3.err", (4, 0, 0))
    assert read_jsonl(out) == wal_events(a)


def test_foreign_segment_among_the_nodes_own_links_leaves_them_intact(tmp_path: Path) -> None:
    """A fresh daemon: the node's link 1 replaced by the other node's segment 1. Segment 0 is delivered, then exit 5;
    links 1 (the copy) and 2 (the node's own, unconsumed) stay, the position stops at 1:0. Putting the node's segment
    back (from its archive) delivers the whole WAL exactly."""
    a, b = tmp_path / "a", tmp_path / "b"
    out = tmp_path / "out.jsonl"
    make_node(a, segments=3, tx_per_segment=5)
    make_node(b, segments=3, tx_per_segment=5, first_tx=9_000)
    expected = wal_events(a)
    link1 = a / "cdc" / "0000000000000001.wal"
    link1.unlink()
    shutil.copyfile(archived_segments(b)[1], link1)
    own2 = inodes(a)[2]
    config = write_daemon_config(tmp_path / "cdcd.toml", a, jsonl_consumer(out))
    err = tmp_path / "run1.err"
    assert run_daemon_until_exit(config, err) == 5
    line = only_error_line(err)
    assert line.startswith(f"cdcd: error: {link1} at offset 0: segment of node {read_node_id(b)}, not of this node ")
    assert read_jsonl(out) == [e for e in expected if e["pos"][0] == 0]
    assert state_position(config) == (1, 0, 0)
    assert sorted(cdc_links(a)) == [1, 2] and inodes(a)[2] == own2

    link1.unlink()
    os.link(archived_segments(a)[1], link1)
    catch_up_and_stop(config, tmp_path / "run2.err", (3, 0, 0))
    assert read_jsonl(out) == expected


def test_segment_whose_header_names_another_index_stops_the_daemon(tmp_path: Path) -> None:
    """The node's own segment 2 under the name of segment 1: exit 5 naming the file and both indexes, nothing of it
    delivered, link 2 intact."""
    a = tmp_path / "a"
    out = tmp_path / "out.jsonl"
    make_node(a, segments=3, tx_per_segment=5)
    expected = wal_events(a)
    link1 = a / "cdc" / "0000000000000001.wal"
    link1.unlink()
    shutil.copyfile(archived_segments(a)[2], link1)
    config = write_daemon_config(tmp_path / "cdcd.toml", a, jsonl_consumer(out))
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == 5
    assert only_error_line(err) == f"cdcd: error: {link1} at offset 0: header says segment 2, file name says 1"
    assert read_jsonl(out) == [e for e in expected if e["pos"][0] == 0]
    assert state_position(config) == (1, 0, 0)
    assert sorted(cdc_links(a)) == [1, 2]


def test_without_a_node_id_file_the_first_segment_read_is_this_node(tmp_path: Path) -> None:
    """A node dir without ``node_id`` (written by an older node): the first segment the daemon reads names the node,
    and a later segment of another node is refused just the same."""
    a, b = tmp_path / "a", tmp_path / "b"
    out = tmp_path / "out.jsonl"
    make_node(a, segments=2, tx_per_segment=5)
    make_node(b, segments=3, tx_per_segment=5, first_tx=9_000)
    (a / "node_id").unlink()
    foreign = a / "cdc" / "0000000000000002.wal"
    shutil.copyfile(archived_segments(b)[2], foreign)
    config = write_daemon_config(tmp_path / "cdcd.toml", a, jsonl_consumer(out))
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == 5
    assert f"segment of node {read_node_id(b)}, not of this node " in only_error_line(err)
    assert read_jsonl(out) == wal_events(a)
    assert state_position(config) == (2, 0, 0)


def test_state_of_a_recreated_node_deletes_nothing(tmp_path: Path) -> None:
    """`state_dir` outside the node dir; the node dir is re-created (a new node id) with 6 segments. The daemon's old
    state (position 4:0) must not delete links 0..3 of the new node: exit 7, one line naming both ids and
    `cdcd state reset`, nothing delivered, every link intact. `state reset` then delivers the new node exactly."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=4, tx_per_segment=5)
    old_id = read_node_id(node_dir)
    config = write_daemon_config(
        tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), state_dir=str(tmp_path / "state")
    )
    catch_up_and_stop(config, tmp_path / "run1.err", (4, 0, 0))
    before = read_jsonl(out)
    shutil.rmtree(node_dir)
    make_node(node_dir, segments=6, tx_per_segment=5, first_tx=70_000)
    new_id = read_node_id(node_dir)
    links = inodes(node_dir)
    assert sorted(links) == list(range(6)) and new_id != old_id

    err = tmp_path / "run2.err"
    assert run_daemon_until_exit(config, err) == 7
    assert only_error_line(err) == (
        f"cdcd: error: {tmp_path / 'state' / 'data.mdb'}: daemon state of node {old_id}, but {node_dir} is node "
        f"{new_id} (node dir re-created, or state_dir of another node?); stop the daemon and run `cdcd state reset`"
    )
    assert inodes(node_dir) == links, "no link deleted"
    assert read_jsonl(out) == before
    assert not [e for e in log_events(err) if e["event"] == "stale_link_deleted"]

    from tests.support.procs import cdcd, state_show

    res = cdcd("state", "reset", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert state_show(config)["node_id"] == str(new_id)
    catch_up_and_stop(config, tmp_path / "run3.err", (6, 0, 0))
    assert read_jsonl(out) == before + wal_events(node_dir)


def test_damaged_node_id_file_is_one_line(tmp_path: Path) -> None:
    """A `node_id` file holding no id: exit 7, one line naming it, nothing delivered; the node rewrites it at open."""
    a = tmp_path / "a"
    out = tmp_path / "out.jsonl"
    make_node(a, segments=1, tx_per_segment=2)
    good = (a / "node_id").read_text()
    (a / "node_id").write_text("garbage\n")
    config = write_daemon_config(tmp_path / "cdcd.toml", a, jsonl_consumer(out))
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == 7
    assert only_error_line(err) == f"cdcd: error: {a / 'node_id'}: not a node id: 'garbage'"
    assert read_jsonl(out) == []
    make_node(a, segments=1, tx_per_segment=2, first_tx=2)
    assert (a / "node_id").read_text() == good
