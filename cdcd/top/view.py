"""``cdcd top``'s screen: a pure function from the latest snapshot (and its rates) to a rich renderable."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
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


def _kv_table(label_width: int) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True, min_width=label_width)
    table.add_column(no_wrap=True, overflow="ellipsis")
    return table


def _writes(writes: str) -> Text:
    style = "green" if writes == "ok" else "yellow" if writes.startswith("waiting") else "bold red"
    return Text(writes, style=style)


def _node_panel(snap: Snapshot, rates: Rates | None, since: str) -> Panel:
    n = snap.node
    if n is None:
        return Panel(Text(snap.sources["control_socket"], style="red"), title="Node: not answering")
    t = _kv_table(len("realtime buffer"))
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
    t = _kv_table(len("position"))
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
    t.add_row("consumer", d.consumer_kind or "- (no --config)")
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


WIDE_COLUMNS = 120
"""From this width on, node and daemon (and consumer and problems) sit side by side."""
PANEL_ROWS = 12
"""Node and daemon panels: their rows and borders."""


class _Screen:
    """The layout for the terminal's width at draw time (side by side, or stacked when narrow)."""

    def __init__(self, header: Text, node: Panel, daemon: Panel, consumer: Panel, problems: Panel) -> None:
        self.parts = (header, node, daemon, consumer, problems)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        header, node, daemon, consumer, problems = self.parts
        layout = Layout()
        if options.max_width >= WIDE_COLUMNS:
            layout.split_column(Layout(header, size=3), Layout(name="main", size=PANEL_ROWS), Layout(name="figures"))
            layout["main"].split_row(Layout(node), Layout(daemon))
            layout["figures"].split_row(Layout(consumer), Layout(problems))
        else:
            layout.split_column(
                Layout(header, size=4),
                Layout(node, size=PANEL_ROWS),
                Layout(daemon, size=PANEL_ROWS - 1),
                Layout(consumer),
                Layout(problems),
            )
        yield layout


def _panels(
    snap: Snapshot, rates: Rates | None, node_dir: str, since: str, interval_ms: int
) -> tuple[Text, Panel, Panel, Panel, Panel]:
    """Header, node, daemon, consumer and problems: what both forms of the screen show."""
    return (
        _header(snap, node_dir, interval_ms),
        _node_panel(snap, rates, since),
        _daemon_panel(snap, rates),
        _metrics_panel("Consumer", snap.consumer, "no consumer metrics (daemon_metrics above)"),
        _metrics_panel("Problems", snap.problems, "no retries, stalls or dead letters reported"),
    )


def render(snap: Snapshot, rates: Rates | None, *, node_dir: str, since: str, interval_ms: int) -> RenderableType:
    """The whole screen. ``since``: when the current deliverer was first seen delivering."""
    return _Screen(*_panels(snap, rates, node_dir, since, interval_ms))


def render_once(snap: Snapshot, rates: Rates | None, *, node_dir: str, since: str, interval_ms: int) -> Group:
    """The same panels stacked, for a plain-text print (no full-screen layout to fill)."""
    return Group(*_panels(snap, rates, node_dir, since, interval_ms))
