"""``cdcd top``'s screen: a pure function from the latest snapshot (and its rates) to a rich renderable."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cdcd.top.snapshot import LakeFigures, Rates, Snapshot, daemon_lag_segments, one_line

MAX_METRIC_ROWS = 12
"""Consumer and problem rows shown at most (the JSON has them all)."""
FIRST_FIGURES = (
    "cdcd_lake_table_version",
    "cdcd_lake_rows_written_total",
    "cdcd_lake_files_per_partition_max",
    "cdcd_lake_last_maintenance_timestamp_seconds",
    "cdcd_lake_lag_seconds",
    "cdcd_kafka_transactions_total",
    "cdcd_kafka_sent_events_total",
    "cdcd_kafka_last_commit_timestamp_seconds",
)
"""The consumer's figures shown first, whatever else it exports."""
LAKE_SHOWN = (
    "cdcd_lake_table_version",
    "cdcd_lake_files_per_partition_max",
    "cdcd_lake_last_maintenance_timestamp_seconds",
    "cdcd_lake_last_maintenance_duration_seconds",
    "cdcd_lake_maintenance_duration_seconds_count",
    "cdcd_lake_maintenance_duration_seconds_sum",
)
"""The lake's samples the Consumer panel shows as its first lines (``_lake_rows``), not again as raw samples
(the runs' histogram too: its last run is what the lines show; the JSON keeps every sample)."""


def _clock(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    try:
        return datetime.fromtimestamp(unix_s, UTC).strftime("%H:%M:%S")
    except (OverflowError, ValueError, OSError):  # NaN, or a year datetime has no room for
        return f"{unix_s:.6g} (not a time)"


def _plain(text: str) -> Text:
    """A string a source gave, as text shown as it is: never rich markup (``[/]`` would raise), never a
    terminal escape."""
    return Text(one_line(text))


def _num(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def duration(seconds: float | None) -> str:
    """A run's duration: hundredths under 10 s (a compaction of a quiet lake), whole seconds above."""
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:,.0f} s"


def _maintenance(at_unix_s: float | None, seconds: float | None) -> str:
    """When a scheduled run last ended and how long it took; ``not yet`` before the first success."""
    if at_unix_s is None:
        return "not yet"
    return f"{_clock(at_unix_s)} UTC, took {duration(seconds)}"


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
        return Panel(Text(snap.sources.get("control_socket", "-"), style="red"), title="Node: not answering")
    t = _kv_table(len("realtime buffer"))
    t.add_row("writes", _writes(one_line(n.writes)))
    t.add_row("WAL position", _plain(n.wal_position))
    t.add_row(
        "WAL rate",
        f"{_bytes(rates.wal_bytes_per_s if rates else None, per_s=True)}  "
        f"{_num(rates.node_entries_per_s if rates else None, ' entries/s')}  "
        f"{_num(rates.wal_segments_per_s if rates else None, ' seg/s', 2)}",
    )
    t.add_row("cdc", _plain(n.cdc))
    t.add_row("delivering", Text(one_line(f"{n.delivering} (since {since})"), style="bold cyan"))
    t.add_row("realtime", _plain(n.realtime_mode))
    used, limit = n.buffer_used_bytes, n.buffer_max_bytes
    pct = f" ({100 * used / limit:.0f}%)" if used is not None and limit else ""
    t.add_row("realtime buffer", f"{_bytes(used)} of {_bytes(limit)}{pct}, max {_bytes(n.buffer_max_used_bytes)}")
    stops = ", ".join(f"{k}: {v}" for k, v in sorted(n.realtime_stops.items())) or "none"
    t.add_row("realtime stops", _plain(stops))
    if n.delivering == "node":
        t.add_row("realtime lag", f"{_num(n.lag_segments, ' seg')}  {_num(n.lag_ms, ' ms')}")
    return Panel(t, title=_plain(f"Node {n.node_id}"))


def _daemon_panel(snap: Snapshot, rates: Rates | None) -> Panel:
    d = snap.daemon
    if d is None:
        return Panel(Text(snap.sources.get("daemon_state", "-"), style="red"), title="Daemon: state unreadable")
    t = _kv_table(len("position"))
    t.add_row("process", Text(f"pid {d.pid}", style="green") if d.pid else Text("not running", style="yellow"))
    t.add_row("mode", _plain(d.mode + (" (never committed)" if d.fresh else "")))
    t.add_row("position", _plain(d.position or "- (starts at the oldest link)"))
    t.add_row("lag", f"{_num(daemon_lag_segments(snap), ' seg')}  {_num(d.lag_seconds, ' s', 2)}")
    t.add_row(
        "rate",
        f"{_num(rates.daemon_events_per_s if rates else None, ' events/s')}  "
        f"{_num(rates.daemon_segments_per_s if rates else None, ' seg/s', 2)}",
    )
    links = f"{d.backlog_segments} seg" + (f" ({d.first_link}..{d.last_link})" if d.backlog_segments else "")
    t.add_row("backlog", links)
    t.add_row("commits", _plain(f"{d.commits:,} (last {d.updated or '-'})"))
    t.add_row("consumer", _plain(d.consumer_kind or "- (no --config)"))
    return Panel(t, title="Daemon")


STATE_STYLES = {"delivering": "green", "retrying": "yellow", "stopped": "bold red", "invalidated": "bold red"}


def _consumers_panel(snap: Snapshot, rates: Rates | None) -> Panel | None:
    """One row per consumer of the daemon: who delivers it, its state (and why not delivering), position, lag
    and rate. None when the daemon's state lists none (unreadable, or a daemon of an older release)."""
    if not snap.consumers:
        return None
    t = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold", expand=True)
    for col in ("consumer", "kind", "by", "state", "position", "lag"):
        t.add_column(col, no_wrap=True, overflow="ellipsis")
    t.add_column("rate", no_wrap=True, justify="right")
    t.add_column("why", overflow="ellipsis", no_wrap=True, ratio=1)
    per_s = rates.consumer_events_per_s if rates else {}
    for c in snap.consumers:
        lag = f"{_num(c.lag_segments, ' seg')} {_bytes(c.lag_bytes)} {_num(c.lag_seconds, ' s', 1)}"
        t.add_row(
            _plain(c.name + (" *" if c.realtime else "")),
            _plain(c.kind or "-"),
            _plain(c.delivered_by),
            Text(one_line(c.state), style=STATE_STYLES.get(c.state, "")),
            _plain(c.position or "-"),
            lag,
            _num(per_s.get(c.name), "/s"),
            _plain(c.why),
        )
    return Panel(t, title="Consumers (* the node's realtime worker stands in for it)")


def _first(item: tuple[str, float]) -> tuple[int, str]:
    """Sort key: the figures ``FIRST_FIGURES`` names first (in that order), then the rest by name."""
    base = item[0].partition("{")[0]
    return next((i for i, name in enumerate(FIRST_FIGURES) if base == name), len(FIRST_FIGURES)), item[0]


def _value(name: str, value: float) -> str:
    if name.partition("{")[0].endswith("_timestamp_seconds"):
        return f"{_clock(value)} UTC" if value else "never"
    return f"{value:,.6g}"


def _lake_rows(lake: LakeFigures) -> list[tuple[str, str]]:
    return [
        ("lake table version", _num(lake.table_version)),
        ("files per partition (max)", _num(lake.files_per_partition_max)),
        ("last compaction", _maintenance(lake.last_compaction_unix_s, lake.last_compaction_seconds)),
        ("last optimize", _maintenance(lake.last_optimize_unix_s, lake.last_optimize_seconds)),
        ("last vacuum", _maintenance(lake.last_vacuum_unix_s, lake.last_vacuum_seconds)),
    ]


def _consumer_panel(snap: Snapshot) -> Panel:
    """The consumer's metrics; a lake's main figures first, in words (its maintenance as clock and duration)."""
    if snap.lake is None:
        return _metrics_panel("Consumer", snap.consumer, "no consumer metrics (daemon_metrics above)")
    rest = {k: v for k, v in snap.consumer.items() if k.partition("{")[0] not in LAKE_SHOWN}
    return _metrics_panel("Consumer", rest, "", lead=_lake_rows(snap.lake))


def _metrics_panel(title: str, samples: dict[str, float], empty: str, lead: Sequence[tuple[str, str]] = ()) -> Panel:
    """``lead``: rows shown before the samples (label, value)."""
    if not samples and not lead:
        return Panel(Text(empty, style="dim"), title=title)
    rows = sorted(samples.items(), key=_first)
    shown = rows[:MAX_METRIC_ROWS]
    values = [text for _, text in lead] + [_value(name, value) for name, value in shown]
    # The values keep their width and the names take what is left, cut if they must: a long sample name
    # would otherwise squeeze the values (a compaction's duration cut to "took …").
    t = Table.grid(padding=(0, 2), expand=True)
    t.add_column(overflow="ellipsis", no_wrap=True, ratio=1)
    t.add_column(justify="right", no_wrap=True, width=max(map(len, values)))
    for label, text in lead:
        t.add_row(Text(label, style="bold"), text)
    for name, value in shown:
        t.add_row(_plain(name), _value(name, value), style="red" if title == "Problems" and value else None)
    if len(rows) > MAX_METRIC_ROWS:
        t.add_row(f"... {len(rows) - MAX_METRIC_ROWS} more (--once --json shows all)", "")
    return Panel(t, title=title)


def _problems_panel(snap: Snapshot) -> Panel:
    """A source's bad answer (one line each, first), then the retry, stall and dead-letter samples."""
    metrics = _metrics_panel("Problems", snap.problems, "no retries, stalls or dead letters reported")
    if not snap.source_problems:
        return metrics
    lines = [Text(one_line(line), style="bold red", no_wrap=True, overflow="ellipsis") for line in snap.source_problems]
    return Panel(Group(*lines, metrics.renderable) if snap.problems else Group(*lines), title="Problems")


def _header(snap: Snapshot, node_dir: str, interval_ms: int, title: str, keys: str) -> Text:
    text = Text()
    text.append(title, style="bold")
    text.append(f"  {node_dir}  {_clock(snap.taken_unix_s)} UTC  every {interval_ms} ms  {keys}\n")
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


Parts = tuple[Text, Panel, Panel, Panel | None, Panel, Panel]
"""Header, node, daemon, consumers (None: none listed), consumer metrics and problems."""


class _Screen:
    """The layout for the terminal's width at draw time (side by side, or stacked when narrow); the
    consumers' rows, when there are any, between the node and daemon and the metrics."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        header, node, daemon, consumers, consumer, problems = self.parts
        rows = []
        if consumers is not None:
            table = consumers.renderable
            # Borders and the header row around one row per consumer.
            rows = [Layout(consumers, size=(table.row_count if isinstance(table, Table) else 1) + 3)]
        layout = Layout()
        if options.max_width >= WIDE_COLUMNS:
            layout.split_column(
                Layout(header, size=3), Layout(name="main", size=PANEL_ROWS), *rows, Layout(name="figures")
            )
            layout["main"].split_row(Layout(node), Layout(daemon))
            layout["figures"].split_row(Layout(consumer), Layout(problems))
        else:
            layout.split_column(
                Layout(header, size=4),
                Layout(node, size=PANEL_ROWS),
                Layout(daemon, size=PANEL_ROWS - 1),
                *rows,
                Layout(consumer),
                Layout(problems),
            )
        yield layout


def _panels(
    snap: Snapshot, rates: Rates | None, node_dir: str, since: str, interval_ms: int, *, title: str, keys: str
) -> Parts:
    """Header, node, daemon, consumers (None: none listed), consumer metrics and problems: what both forms
    of the screen show."""
    return (
        _header(snap, node_dir, interval_ms, title, keys),
        _node_panel(snap, rates, since),
        _daemon_panel(snap, rates),
        _consumers_panel(snap, rates),
        _consumer_panel(snap),
        _problems_panel(snap),
    )


def render(
    snap: Snapshot,
    rates: Rates | None,
    *,
    node_dir: str,
    since: str,
    interval_ms: int,
    title: str = "cdcd top",
    keys: str = "q: quit",
) -> RenderableType:
    """The whole screen. ``since``: when the current deliverer was first seen delivering; ``title`` and
    ``keys`` head it (``make run`` shows the same screen under its own name)."""
    return _Screen(_panels(snap, rates, node_dir, since, interval_ms, title=title, keys=keys))


def render_once(snap: Snapshot, rates: Rates | None, *, node_dir: str, since: str, interval_ms: int) -> Group:
    """The same panels stacked, for a plain-text print (no full-screen layout to fill)."""
    parts = _panels(snap, rates, node_dir, since, interval_ms, title="cdcd top", keys="q: quit")
    return Group(*(part for part in parts if part is not None))


# --- one line of the same figures (make run and make run-cluster when stdout is not a terminal) ------
def _problems_text(problems: dict[str, float]) -> str:
    if not problems:
        return "none"
    return ", ".join(f"{k.partition('{')[0].removeprefix('cdcd_')} {v:,.6g}" for k, v in sorted(problems.items()))


def figures(snap: Snapshot, rates: Rates | None) -> dict[str, str]:
    """The view's main figures as short texts, column by column: ``status_line`` and ``cluster_table``."""
    n, d, c = snap.node, snap.daemon, snap.consumer
    out: dict[str, str] = {}
    if n is None:
        out["WAL"] = "node not answering"
    else:
        out["WAL"] = one_line(n.wal_position)
        out["WAL rate"] = (
            f"{_bytes(rates.wal_bytes_per_s if rates else None, per_s=True)} "
            f"{_num(rates.node_entries_per_s if rates else None, ' entries/s')}"
        )
        out["delivering"] = one_line(n.delivering + ("" if n.cdc == "on" else f" (cdc {n.cdc})"))
    if d is None:
        out["daemon"] = "state unreadable"
    else:
        out["daemon"] = one_line(d.position or "-")
        out["lag"] = f"{_num(daemon_lag_segments(snap), ' seg')} {_num(d.lag_seconds, ' s', 1)}"
        out["rate"] = _num(rates.daemon_events_per_s if rates else None, " events/s")
        out["backlog"] = f"{d.backlog_segments} seg"
        out["last commit"] = _clock(d.last_commit_unix_s or None)  # 0: none yet
    lake = snap.lake
    if lake is not None:
        out["lake"] = f"v{_num(lake.table_version)}"
        out["rows"] = _num(lake.rows_written or 0)
        out["files/part"] = _num(lake.files_per_partition_max)
        compacted = lake.last_compaction_unix_s
        out["compacted"] = f"{_clock(compacted)} ({duration(lake.last_compaction_seconds)})" if compacted else "not yet"
    elif "cdcd_kafka_transactions_total" in c:
        out["kafka txns"] = _num(c["cdcd_kafka_transactions_total"])
        out["sent"] = _num(sum(v for k, v in c.items() if k.startswith("cdcd_kafka_sent_events_total")))
    if len(snap.consumers) > 1:
        out["consumers"] = ", ".join(one_line(f"{c.name} {c.state}") for c in snap.consumers)
    out["problems"] = _problems_text(snap.problems)
    if snap.source_problems:
        bad = ", ".join(line.partition(":")[0] for line in snap.source_problems)
        out["problems"] = f"bad answers from {bad}" + ("" if out["problems"] == "none" else f"; {out['problems']}")
    return out


def status_line(snap: Snapshot, rates: Rates | None) -> str:
    """The main figures on one plain line (no colours, no panels)."""
    return "  ".join(f"{k} {v}" for k, v in figures(snap, rates).items())


def cluster_table(rows: list[tuple[str, Snapshot, Rates | None]]) -> Table:
    """One row of the main figures per node (``make run-cluster`` on a terminal)."""
    cells = [(name, figures(snap, r)) for name, snap, r in rows]
    columns = [k for k in dict.fromkeys(k for _, f in cells for k in f) if k != "problems"] + ["problems"]
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    table.add_column("node", no_wrap=True)
    for col in columns:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    for name, f in cells:
        row = [Text(f.get(col, ""), style="red" if col == "problems" and f[col] != "none" else "") for col in columns]
        table.add_row(name, *row)
    return table
