"""The tables ``cdcd lake show / verify / history`` and ``cdcd demo`` print (stdout is the result)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from cdcd.lake.maintenance.compact import CompactResult
from cdcd.lake.maintenance.ops import DEFAULT_RETAIN_HOURS, LakeInfo, Vacuumed
from cdcd.lake.printable import printable
from cdcd.lake.reading.verify import CacheCheck
from cdcd.lake.typed.layout import BadTable


def print_show(info: LakeInfo) -> None:
    click.echo(f"lake {info.lake}")
    click.echo(f"{'table':<8} {'version':>8} {'files':>7} {'rows':>12}  {'last commit':<29} operation")
    for t in info.tables:
        last = t.last_commit or "-"
        click.echo(f"{t.name:<8} {t.version:>8} {t.files:>7} {t.rows:>12,}  {last:<29} {t.last_operation or '-'}")
    for t in info.tables:
        for app, version in t.app_transactions.items():
            click.echo(f"{t.name} app transaction {printable(app)}: {version}")
    if info.state_behind is not None:
        where = "never compacted" if info.compacted_to < 0 else f"changes version {info.compacted_to}"
        click.echo(f"state reflects {where}{' (behind: run lake compact)' if info.state_behind else ' (current)'}")
    by_cache: dict[str, dict[str, int]] = {}
    for t in info.tables:
        for cache, n in t.rows_per_cache.items():
            by_cache.setdefault(cache, {})[t.name] = n
    click.echo(f"{'cache':<24} {'change rows':>12} {'state rows':>11}")
    for cache in sorted(by_cache):
        rows = by_cache[cache]
        changes, state = rows.get("changes"), rows.get("state")
        click.echo(
            f"{printable(cache):<24} {'-' if changes is None else f'{changes:,}':>12} "
            f"{'-' if state is None else f'{state:,}':>11}"
        )


def print_verify(checks: Iterable[CacheCheck]) -> None:
    click.echo(f"{'cache':<16} {'node rows':>10} {'lake rows':>10}  {'node checksum':<18} {'lake checksum':<18} result")
    for c in checks:
        click.echo(
            f"{printable(c.cache):<16} {c.node_rows:>10,} {c.lake_rows:>10,}  {c.node_checksum:<18x} "
            f"{c.lake_checksum:<18x} {'OK' if c.ok else 'MISMATCH'}"
        )


def verify_summary(checks: list[CacheCheck]) -> str:
    """One line: ``verified: N keys, OK`` or how many caches differ."""
    keys = sum(c.lake_rows for c in checks)
    bad = [c for c in checks if not c.ok]
    if not bad:
        return f"verified: {keys:,} keys, OK"
    return f"verified: {keys:,} keys, MISMATCH in {len(bad)} of {len(checks)} caches"


def print_history(table: str, rows: list[dict[str, Any]]) -> None:
    click.echo(f"{'table':<8} {'version':>8}  {'time':<29} {'operation':<18} details")
    for r in rows:
        metrics = r["metrics"]
        added = metrics.get("num_added_rows", metrics.get("numOutputRows"))
        txn = r["parameters"].get("txn") if isinstance(r["parameters"], dict) else None
        details = []
        if added is not None:
            details.append(f"rows added {added}")
        if txn:
            details.append(f"txn {txn}")
        if r["engine"]:
            details.append(str(r["engine"]))
        when, op = r["time"] or "-", r["operation"] or "-"
        click.echo(f"{table:<8} {r['version']:>8}  {when:<29} {op:<18} {', '.join(details)}")


def byte_size(n: int) -> str:
    """``512 B``, ``3.4 MiB``: a size for people (binary units, one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def compact_summary(result: CompactResult) -> str:
    """``cdcd lake compact``'s line: state's rows upserted and deleted, from Delta's MERGE metrics."""
    if not result.did_work:
        line = f"nothing new to compact: state reflects changes version {result.to_version}"
        return "\n".join([line, *(skipped_line(bad) for bad in result.skipped)])
    idle = result.keys - result.upserted - result.deleted
    line = (
        f"state version {result.state_version} (changes versions {result.from_version}..{result.to_version}): "
        f"{result.upserted:,} rows upserted ({result.inserted:,} new, {result.updated:,} updated), "
        f"{result.deleted:,} deleted"
    )
    if idle:
        line += f", {idle:,} changes without effect (a delete of an absent key, or older than state's row)"
    line = f"{line}; {len(result.tables)} typed tables, {result.rescued:,} fields rescued"
    return "\n".join([line, *(skipped_line(bad) for bad in result.skipped)])


def skipped_line(bad: BadTable) -> str:
    return f"skipped: {bad.line()}"


def optimize_line(table: str, metrics: dict[str, Any]) -> str:
    removed, added = metrics.get("numFilesRemoved") or 0, metrics.get("numFilesAdded") or 0
    considered = metrics.get("totalConsideredFiles") or 0
    if not removed:
        return f"{table}: nothing to optimize: {considered:,} files, already compact"
    return f"{table}: {removed:,} small files rewritten as {added:,} ({considered:,} files considered)"


def vacuum_line(table: str, done: Vacuumed, retain_hours: float) -> str:
    if not done.deleted_files:
        return f"{table}: nothing to delete (retention {retain_hours:g} h); {done.files_left:,} data files"
    return (
        f"{table}: deleted {done.deleted_files:,} data files ({byte_size(done.deleted_bytes)}) no snapshot of the "
        f"last {retain_hours:g} h needs; {done.files_left:,} data files left"
    )


def retention_check_off(retain_hours: float) -> str:
    """What ``lake vacuum --force`` says before it deletes anything."""
    return (
        f"--force: the retention check is off for this run: files replaced more than {retain_hours:g} h ago are "
        f"deleted, below the {DEFAULT_RETAIN_HOURS:g} h Delta keeps by default"
    )


DEMO_QUERY = "SELECT count(*) AS keys, min(seq) AS first_seq, max(seq) AS last_seq FROM load"
"""The typed query ``make run`` ends with: the demo's cache ``load`` by its columns, no JSON functions."""


def print_demo_ending(spark: Any, lake: Path, checks: list[CacheCheck], since: float, query: str = DEMO_QUERY) -> None:
    """``make run``'s last lines: where the lake is, the cut its tables are read at, a Spark SQL query
    over the typed cache tables (views registered in ``spark``, at that cut) and its result, then
    one summary line (``verified: N keys, OK in S s``: S seconds since ``since``, a monotonic time)."""
    from cdcd.lake.cuts import latest_cut
    from cdcd.lake.reading.readers import register_spark
    from cdcd.lake.reading.sql import Result, write_result

    cut = latest_cut(lake)
    click.echo(f"lake: {lake.resolve()}")
    if cut is not None:
        click.echo(f"tables at the cut of changes version {cut.changes_version} (cdcd lake cut --lake {lake})")
        session = spark.newSession()  # the views stay out of the caller's session
        register_spark(session, lake, cut)
        click.echo(f"spark.sql> {query}")
        frame = session.sql(query)
        out = io.StringIO()
        write_result(Result(list(frame.columns), iter([tuple(r) for r in frame.collect()])), out, "table")
        click.echo(out.getvalue(), nl=False)
    click.echo(f"{verify_summary(checks)}; stopped in {time.monotonic() - since:.0f} s")
