"""The rich frame of ``eft top``: header, GPUs, checkpoints, events.

Risk colours: green below 0.5, yellow below the threshold, red at or above it.
Rows whose last sample is older than ``--stale-after`` are dimmed; lost nodes are
listed in red above the GPUs. When the GPUs do not fit the terminal, the riskiest
are drawn and a caption says how many were left out; when the columns do not fit
its width, the least telling columns are left out (see ``COLUMNS``).

Everything from etcd goes into ``Text`` objects, never into markup strings, so a
node called ``[bold]`` is printed as such.
"""

from __future__ import annotations

from typing import Callable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from elasticft.tui import text as fmt
from elasticft.tui.view import GpuRow, LostRow, View, fit

LEVEL_STYLE = {"ok": "green", "warn": "yellow", "high": "bold red"}
STATE_STYLE = {
    "training": "bold green",
    "rendezvous": "bold yellow",
    "restarting": "bold yellow",
    "checkpointing": "bold cyan",
    "stopped": "bold red",
}
BAR_WIDTH = 8
NODE_WIDTH = 24  # longer node names are cut with an ellipsis
PANEL_CHROME = 4  # a panel's borders and padding
COLUMN_GAP = 3  # padding on both sides of a cell and the box's blank separator


def risk_cell(row: GpuRow) -> Text:
    filled = min(BAR_WIDTH, int(round(row.risk * BAR_WIDTH)))
    style = LEVEL_STYLE[row.level]
    cell = Text()
    cell.append("█" * filled, style=style)
    cell.append("░" * (BAR_WIDTH - filled), style="dim")
    cell.append(f" {row.risk:.2f}", style=style)
    return cell


def _factor_cell(row: GpuRow) -> Text:
    return Text(fmt.factor(row), style="bold red" if row.critical else "")


# (header, justify, cell) in display order, and the order in which columns are
# dropped when the terminal is too narrow: the last of DROP_ORDER goes first.
COLUMNS: list[tuple[str, str, Callable[[GpuRow], Text | str]]] = [
    ("node", "left", lambda r: r.node),
    ("gpu", "right", lambda r: str(r.gpu)),
    ("risk", "left", risk_cell),
    ("temp", "right", fmt.temperature),
    ("trend", "left", fmt.trend),
    ("mem", "right", fmt.memory),
    ("power", "right", fmt.power),
    ("util", "right", fmt.utilization),
    ("ecc c/u", "right", fmt.ecc),
    ("xid", "right", fmt.xids),
    ("factor", "left", _factor_cell),
    ("age", "right", fmt.age),
]
DROP_ORDER = ["node", "gpu", "risk", "factor", "age", "temp", "trend", "xid", "mem", "util", "ecc c/u", "power"]


def _columns_that_fit(rows: list[GpuRow], width: int | None) -> list[int]:
    """Indices of the columns to draw within ``width`` characters (None: all)."""
    if width is None:
        return list(range(len(COLUMNS)))
    widths = {}
    for name, _, cell in COLUMNS:
        values = [cell(r) for r in rows]
        widest = max([len(v.plain if isinstance(v, Text) else v) for v in values] + [len(name)])
        widths[name] = min(widest, NODE_WIDTH) + COLUMN_GAP
    chosen, used = set(), -COLUMN_GAP  # no gap after the last column
    for name in DROP_ORDER:
        if used + widths[name] > width and chosen:
            break
        chosen.add(name)
        used += widths[name]
    return [i for i, (name, _, _) in enumerate(COLUMNS) if name in chosen]


def header_panel(view: View) -> Panel:
    h = view.header
    lines = Text()
    lines.append(h.state.upper(), style=STATE_STYLE.get(h.state, "bold"))
    lines.append("  " + fmt.header_line(h))
    lines.append(f"\n{h.detail} · threshold {h.threshold:g}", style="dim")
    if h.watch_error:
        lines.append(f"\netcd watch broken, retrying: {h.watch_error}", style="bold red")
    return Panel(lines, title=Text(f"eft top · run {h.run_id}"), title_align="left", box=box.ROUNDED)


def _lost_text(row: LostRow) -> Text:
    line = Text("LOST ", style="bold red", no_wrap=True, overflow="ellipsis")  # one line each: fit counts lines
    line.append(fmt.lost_line(row), style="red")
    return line


def gpu_panel(view: View, limit: int | None, width: int | None = None) -> Panel:
    lost, gpus, hidden = fit(view, limit)
    order = "grouped by node" if view.sort == "node" else "riskiest first"
    title = Text(f"GPUs · {len(view.gpus)} reporting · {order}")
    caption = None
    if hidden:
        caption = Text(f"{hidden} more row{'s' if hidden != 1 else ''} hidden (the lowest risk); "
                       "a taller terminal or --max-rows shows them", style="italic")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, caption=caption, caption_justify="left",
                  padding=(0, 1), pad_edge=False)
    shown = _columns_that_fit(gpus or view.gpus, None if width is None else width - PANEL_CHROME)
    for i in shown:
        name, justify, _ = COLUMNS[i]
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",
                         max_width=NODE_WIDTH if name == "node" else None)
    previous_node = None
    for row in gpus:
        cells = [COLUMNS[i][2](row) for i in shown]
        cells = [c if isinstance(c, Text) else Text(c) for c in cells]
        if view.sort == "node" and row.node == previous_node and COLUMNS[shown[0]][0] == "node":
            cells[0] = Text("")  # grouped: name each node once, on its first row
        previous_node = row.node
        table.add_row(*cells, style="dim" if row.stale else None)
    parts: list[RenderableType] = [_lost_text(row) for row in lost]
    parts.append(table if view.gpus else Text("no GPU health records", style="dim"))
    return Panel(Group(*parts), title=title, title_align="left", box=box.ROUNDED)


def checkpoints_panel(view: View) -> Panel:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="ellipsis", no_wrap=True)
    for label, line in fmt.checkpoint_lines(view.checkpoints):
        grid.add_row(Text(label), Text(line))
    return Panel(grid, title="checkpoints", title_align="left", box=box.ROUNDED)


def events_panel(view: View) -> Panel:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True, style="dim")
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="ellipsis", no_wrap=True)
    for event in view.events:
        grid.add_row(Text(f"{fmt.duration(event.age_s)} ago"), Text(event.kind), Text(event.text))
    if not view.events:
        grid.add_row("", "", Text("no events yet"))
    return Panel(grid, title="events (newest first)", title_align="left", box=box.ROUNDED)


def frame(view: View, limit: int | None = None, width: int | None = None) -> RenderableType:
    """The whole dashboard: at most ``limit`` lost-node and GPU rows (None: all), the
    GPU columns that fit ``width`` (None: all)."""
    if not view.exists:
        return Panel(Text(f"no run {view.header.run_id!r} in etcd yet; waiting for it to appear", style="yellow"),
                     title=Text(f"eft top · run {view.header.run_id}"), title_align="left", box=box.ROUNDED)
    return Group(header_panel(view), gpu_panel(view, limit, width), checkpoints_panel(view), events_panel(view))


def rows_that_fit(console: Console, view: View) -> int:
    """How many lost-node and GPU rows fit the console's height next to everything else."""
    rows = len(view.lost) + len(view.gpus)
    # The frame with no rows drawn: headers, panels and the "hidden" caption.
    fixed = len(console.render_lines(frame(view, 0, console.width), console.options, pad=False))
    room = console.size.height - fixed - 1  # Live keeps the cursor on the line below
    if rows <= room + 1:  # everything fits, and then there is no caption
        return rows
    return max(1, room)
