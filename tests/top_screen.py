"""Reading what ``eft top`` drew: GPU rows from its text, colours from rich's recording console."""

from __future__ import annotations

import io
import re

from rich.console import Console

from elasticft.tui import View, frame

ROW = re.compile(r"^│ ([\w-]+)?\s+(\d+)\s+[█░]{8} (\d\.\d\d)")
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def gpu_rows(output: str) -> list[tuple[str, int, float]]:
    """(node, gpu, risk) of every GPU row, in the order drawn; a blank node repeats the one above."""
    rows, node = [], None
    for line in output.splitlines():
        match = ROW.match(line)
        if match:
            node = match.group(1) or node
            rows.append((node, int(match.group(2)), float(match.group(3))))
    return rows


def styles(console: Console) -> list[list[tuple[str, set[str]]]]:
    """Each printed line as (character, SGR codes in force), as the terminal gets them."""
    lines = []
    for line in console.export_text(styles=True).splitlines():
        chars, codes, pos = [], set(), 0
        for match in SGR.finditer(line):
            chars.extend((c, codes) for c in line[pos:match.start()])
            codes = set(match.group(1).split(";")) - {"0", ""}
            pos = match.end()
        chars.extend((c, codes) for c in line[pos:])
        lines.append(chars)
    return lines


def codes_at(lines, row_prefix: str, text: str) -> set[str]:
    """The SGR codes of ``text`` on the GPU row that starts with ``row_prefix``."""
    for chars in lines:
        plain = "".join(c for c, _ in chars)
        if plain.startswith("│ " + row_prefix):
            return chars[plain.index(text, len(row_prefix) + 2)][1]
    raise AssertionError(f"no row {row_prefix!r}")


def record(view: View) -> list:
    console = Console(record=True, force_terminal=True, color_system="standard", width=160, file=io.StringIO())
    console.print(frame(view, None, 160))
    return styles(console)
