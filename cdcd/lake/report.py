"""The tables ``cdcd lake show / verify / history`` and ``cdcd demo`` print (stdout is the result)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from cdcd.lake.ops import LakeInfo
from cdcd.lake.printable import printable
from cdcd.lake.verify import CacheCheck


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


DEMO_QUERY = "SELECT count(*) AS keys, min(seq) AS first_seq, max(seq) AS last_seq FROM load"
"""The typed query ``make run`` ends with: the demo's cache ``load`` by its columns, no JSON functions."""


def print_demo_ending(
    spark: Any, lake: Path, checks: list[CacheCheck], since: float, query: str = DEMO_QUERY
) -> None:
    """``make run``'s last lines: where the lake is, the cut its tables are read at, a Spark SQL query
    over the typed cache tables (views registered in ``spark``, at that cut) and its result, then
    one summary line (``verified: N keys, OK in S s``: S seconds since ``since``, a monotonic time)."""
    from cdcd.lake.cuts import latest_cut
    from cdcd.lake.readers import register_spark
    from cdcd.lake.sql import Result, write_result

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
