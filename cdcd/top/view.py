"""``cdcd top``'s screen: a pure function from the latest snapshot (and its rates) to a rich renderable."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Group, RenderableType
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cdcd.top.snapshot import Rates, Snapshot, daemon_lag_segments

MAX_METRIC_ROWS = 12
"""Consumer and problem rows shown at most (the JSON has them all)."""


def _clock(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return datetime.fromtimestamp(unix_s, UTC).strftime("%H:%M:%S")


def _num(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _bytes(value: float | None, per_s: bool = False) -> str:
    if value is None:
        return "-"
    suffix = "/s" if per_s else ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}{suffix}" if unit == "B" else f"{value:,.1f} {unit}{suffix}"
        value /= 1024
    return "-"  # unreachable: the loop returns at GiB


def _kv_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=True)
    return table


def _writes(writes: str) -> Text:
    style = "green" if writes == "ok" else "yellow" if writes.startswith("waiting") else "bold red"
    return Text(writes, style=style)


def _node_panel(snap: Snapshot, rates: Rates | None, since: str) -> Panel:
    n = snap.node
    if n is None:
        return Panel(Text(snap.sources["control_socket"], style="red"), title="Node: not answering")
    t = _kv_table()
    t.add_row("writes", _writes(n.writes))
    t.add_row("WAL position", n.wal_position)
    t.add_row(
        "WAL rate",
        f"{_bytes(rates.wal_bytes_per_s if rates else None, per_s=True)}  "
        f"{_num(rates.node_entries_per_s if rates else None, ' entries/s')}  "
        f"{_num(rates.wal_segments_per_s if rates else None, ' seg/s', 2)}",
    )
    t.add_row("cdc", n.cdc)
    t.add_row("delivering", Text(f"{n.delivering} (since {since})", style="bold cyan"))
    t.add_row("realtime", n.realtime_mode)
    used, limit = n.buffer_used_bytes, n.buffer_max_bytes
    pct = f" ({100 * used / limit:.0f}%)" if used is not None and limit else ""
    t.add_row("realtime buffer", f"{_bytes(used)} of {_bytes(limit)}{pct}, max {_bytes(n.buffer_max_used_bytes)}")
    stops = ", ".join(f"{k}: {v}" for k, v in sorted(n.realtime_stops.items())) or "none"
    t.add_row("realtime stops", stops)
    if n.delivering == "node":
        t.add_row("realtime lag", f"{_num(n.lag_segments, ' seg')}  {_num(n.lag_ms, ' ms')}")
    return Panel(t, title=f"Node {n.node_id}")


def _daemon_panel(snap: Snapshot, rates: Rates | None) -> Panel:
    d = snap.daemon
    if d is None:
        return Panel(Text(snap.sources["daemon_state"], style="red"), title="Daemon: state unreadable")
    t = _kv_table()
    t.add_row("process", Text(f"pid {d.pid}", style="green") if d.pid else Text("not running", style="yellow"))
    t.add_row("mode", d.mode + (" (never committed)" if d.fresh else ""))
    t.add_row("position", d.position or "- (starts at the oldest link)")
    t.add_row("lag", f"{_num(daemon_lag_segments(snap), ' seg')}  {_num(d.lag_seconds, ' s', 2)}")
    t.add_row(
        "rate",
        f"{_num(rates.daemon_events_per_s if rates else None, ' events/s')}  "
        f"{_num(rates.daemon_segments_per_s if rates else None, ' seg/s', 2)}",
    )
    links = f"{d.backlog_segments} seg" + (f" ({d.first_link}..{d.last_link})" if d.backlog_segments else "")
    t.add_row("backlog", links)
    t.add_row("commits", f"{d.commits:,} (last {d.updated or '-'})")
    t.add_row("consumer", d.consumer_kind)
    return Panel(t, title="Daemon")


def _metrics_panel(title: str, samples: dict[str, float], empty: str) -> Panel:
    if not samples:
        return Panel(Text(empty, style="dim"), title=title)
    t = Table.grid(padding=(0, 2))
    t.add_column(overflow="ellipsis", no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    rows = sorted(samples.items())
    for name, value in rows[:MAX_METRIC_ROWS]:
        t.add_row(name, f"{value:,.6g}", style="red" if title == "Problems" and value else None)
    if len(rows) > MAX_METRIC_ROWS:
        t.add_row(f"... {len(rows) - MAX_METRIC_ROWS} more (--once --json shows all)", "")
    return Panel(t, title=title)


def _header(snap: Snapshot, node_dir: str, interval_ms: int) -> Text:
    text = Text()
    text.append("cdcd top", style="bold")
    text.append(f"  {node_dir}  {_clock(snap.taken_unix_s)} UTC  every {interval_ms} ms  q: quit\n")
    for name, state in snap.sources.items():
        style = "green" if state == "ok" else "dim" if state == "off" else "yellow"
        text.append(f"{name}: ", style="bold")
        text.append(state if len(state) < 60 else state[:57] + "...", style=style)
        text.append("  ")
    return text


def render(snap: Snapshot, rates: Rates | None, *, node_dir: str, since: str, interval_ms: int) -> RenderableType:
    """The whole screen. ``since``: when the current deliverer was first seen delivering."""
    layout = Layout()
    layout.split_column(
        Layout(_header(snap, node_dir, interval_ms), name="header", size=3),
        Layout(name="main", size=12),
        Layout(name="figures"),
    )
    layout["main"].split_row(Layout(_node_panel(snap, rates, since)), Layout(_daemon_panel(snap, rates)))
    layout["figures"].split_row(
        Layout(_metrics_panel("Consumer", snap.consumer, "no consumer metrics (daemon_metrics above)")),
        Layout(_metrics_panel("Problems", snap.problems, "no retries, stalls or dead letters reported")),
    )
    return layout


def render_once(snap: Snapshot, rates: Rates | None, *, node_dir: str, since: str, interval_ms: int) -> Group:
    """The same panels stacked, for a plain-text print (no full-screen layout to fill)."""
    return Group(
        _header(snap, node_dir, interval_ms),
        _node_panel(snap, rates, since),
        _daemon_panel(snap, rates),
        _metrics_panel("Consumer", snap.consumer, "no consumer metrics (daemon_metrics above)"),
        _metrics_panel("Problems", snap.problems, "no retries, stalls or dead letters reported"),
    )
