"""bench/gpu_check.sh's one result file: a markdown table of every step, from what the steps left.

    python bench/gpu_check_table.py OUT

Reads OUT/steps.tsv (the shell's: step id, title, state, seconds; state is ok, failed:RC,
timeout:SECONDS or skipped:WHY), each step's rows (OUT/rows/ID.jsonl, written by
bench/gpu_check_steps.py; OUT/rows/ID.txt, one line of figures from the shell) and blocks
(OUT/details/*.md), and writes OUT/gpu_check.md. Rewritten after every step, so a run cut short
still leaves the table of what it did. Plain Python: it runs before eft is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def why_failed(log: Path) -> str:
    """The step's own last word: its SystemExit message, else the last line it printed."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.exists() else []
    for line in reversed(lines):
        if line.startswith(("SystemExit", "AssertionError", "gpu_check:")) or "Error:" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def step_rows(out: Path, sid: str, title: str, state: str, seconds: str) -> list[list[str]]:
    kind, _, detail = state.partition(":")
    if kind == "skipped":
        return [[title, f"skipped ({detail})", "", ""]]
    rows = []
    jsonl, text = out / "rows" / f"{sid}.jsonl", out / "rows" / f"{sid}.txt"
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            row = json.loads(line)
            rows.append([row["step"], row["result"], row["figures"], str(row["seconds"])])
    elif kind == "ok":
        figures = text.read_text().strip() if text.exists() else ""
        rows.append([title, "ok", figures, seconds])
    if kind == "failed":
        rows.append([title, f"FAILED (exit {detail})", why_failed(out / "steps" / f"{sid}.log"), seconds])
    elif kind == "timeout":
        rows.append([title, f"FAILED (timeout after {detail} s)", why_failed(out / "steps" / f"{sid}.log"), seconds])
    return rows


def main() -> int:
    out = Path(sys.argv[1])
    header = (out / "header.txt").read_text().strip() if (out / "header.txt").exists() else ""
    lines = ["# eft GPU check", "", header, "",
             "| step | result | key figures | seconds |", "| --- | --- | --- | --- |"]
    steps = out / "steps.tsv"
    for line in steps.read_text().splitlines() if steps.exists() else []:
        sid, title, state, seconds = line.split("\t")
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in step_rows(out, sid, title, state, seconds)]
    details = sorted((out / "details").glob("*.md")) if (out / "details").exists() else []
    if details:
        lines += ["", "## Details", ""] + [d.read_text() for d in details]
    lines.append(f"\nThe raw log: {out.name}/gpu_check.log (each step's own: {out.name}/steps/).")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
