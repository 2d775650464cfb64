"""Odd entries in the CDC dir under the name of the segment the node archives next never kill the
node's WAL: a symlink (dangling or not) or a special file is replaced by the real link, loudly; a
directory is left alone and the segment is not linked (a gap the daemon reports), loudly."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog
from prometheus_client import REGISTRY

from cdcd.node import Node
from cdcd.wal.segment import segment_path


def _skipped() -> float:
    return REGISTRY.get_sample_value("cdcd_node_cdc_links_skipped_total") or 0.0


def _next_link(node: Node) -> Path:
    return segment_path(node.config.cdc_path, node._wal.position.segment)


def test_symlinks_and_fifos_in_the_way_are_replaced(tmp_path: Path) -> None:
    with Node.open(tmp_path / "n", wal_force_archive_timeout_ms=0) as node:
        c = node.cache("c")
        for i, plant in enumerate(("dangling", "to_segment", "fifo")):
            c.put(i, "v")
            link = _next_link(node)
            archived = segment_path(node.config.archive_path, node._wal.position.segment)
            if plant == "dangling":
                link.symlink_to(tmp_path / "nowhere")
            elif plant == "to_segment":
                link.symlink_to(node.config.wal_path / link.name)  # the active segment itself
            else:
                os.mkfifo(link)
            with structlog.testing.capture_logs() as logs:
                node.force_archive()
            st = os.lstat(link)
            assert stat.S_ISREG(st.st_mode) and os.path.samestat(st, os.stat(archived)), plant
            assert [e["was"] for e in logs if e["event"] == "cdc_link_replaced"] == [
                "symlink" if plant != "fifo" else "special file"
            ]
        c.put("after", "still writing")
        node.flush()
    with Node.open(tmp_path / "n") as node:
        assert node.cache("c").get("after") == "still writing"


def test_a_directory_in_the_way_is_a_gap_not_a_dead_wal(tmp_path: Path) -> None:
    with Node.open(tmp_path / "n", wal_force_archive_timeout_ms=0) as node:
        c = node.cache("c")
        c.put(1, "v")
        link = _next_link(node)
        segment = node._wal.position.segment
        link.mkdir()
        (link / "keep").write_text("someone's data")
        before = _skipped()
        with structlog.testing.capture_logs() as logs:
            node.force_archive()
        assert _skipped() == before + 1
        assert segment in node._wal._archiver.skipped_links
        skipped = [e for e in logs if e["event"] == "cdc_link_skipped"]
        assert len(skipped) == 1 and skipped[0]["reason"] == "cdc_dir_entry_in_the_way"
        assert skipped[0]["path"] == str(link) and skipped[0]["log_level"] == "error"
        assert (link / "keep").read_text() == "someone's data"
        # The WAL lives on: more writes, the next segment is linked as usual.
        c.put(2, "v")
        node.force_archive()
        assert segment_path(node.config.cdc_path, segment + 1).is_file()
    with Node.open(tmp_path / "n") as node:
        assert node.cache("c").get(2) == "v"
