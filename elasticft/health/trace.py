"""Reading (and writing) GPU telemetry traces: eft's CSV format and nvidia-smi's.

Both formats become a stream of ``GpuSample``. The format is recognised from the
header line. Parsing is lazy, so a multi-day trace is never held in memory, and a
malformed row raises ``TraceError`` naming the file and line when it is reached.
docs/health.md describes both formats.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

from elasticft.health import prometheus
from elasticft.health.sample import GpuSample


class TraceError(ValueError):
    """A trace file cannot be read; the message starts with ``FILE:LINE:``."""


# eft's own format: one row per GPU per sample, these columns in any order.
# timestamp and gpu are required; a missing column means the field is missing.
EFT_COLUMNS = (
    "timestamp", "node", "gpu", "uuid", "temperature_c", "memory_used_mib",
    "memory_total_mib", "power_w", "power_limit_w", "utilization_pct", "ecc_corrected",
    "ecc_uncorrected", "rows_pending", "throttle_reasons", "xids", "sm_clock_mhz",
    "mem_clock_mhz", "temp_slowdown_c", "temp_shutdown_c",
)

# nvidia-smi --query-gpu names (header without its " [unit]") -> GpuSample field.
# Columns not listed here are ignored, so any --query-gpu list that includes
# timestamp and index can be replayed.
NVSMI_COLUMNS = {
    "timestamp": "timestamp",
    "index": "gpu",
    "uuid": "uuid",
    "temperature.gpu": "temperature_c",
    "power.draw": "power_w",
    "power.draw.instant": "power_w",
    "power.draw.average": "power_w",
    "power.limit": "power_limit_w",
    "enforced.power.limit": "power_limit_w",
    "utilization.gpu": "utilization_pct",
    "memory.used": "memory_used_mib",
    "memory.total": "memory_total_mib",
    "ecc.errors.corrected.volatile.total": "ecc_corrected",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected",
    "retired_pages.pending": "rows_pending",
    "remapped_rows.pending": "rows_pending",
    "clocks_throttle_reasons.active": "throttle_reasons",
    "clocks_event_reasons.active": "throttle_reasons",
    "clocks.sm": "sm_clock_mhz",
    "clocks.current.sm": "sm_clock_mhz",
    "clocks.mem": "mem_clock_mhz",
    "clocks.current.memory": "mem_clock_mhz",
}

NVSMI_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"

_NUMBER = re.compile(r"^([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(W|MiB|%|MHz|C)?$")
_FLOAT_FIELDS = {
    "temperature_c", "memory_used_mib", "memory_total_mib", "power_w", "power_limit_w",
    "utilization_pct", "sm_clock_mhz", "mem_clock_mhz", "temp_slowdown_c", "temp_shutdown_c",
}
_INT_FIELDS = {"ecc_corrected", "ecc_uncorrected"}


def is_missing(text: str) -> bool:
    """Empty, N/A, or any bracketed nvidia-smi remark such as [N/A] or [Unknown Error]."""
    text = text.strip()
    return not text or text == "N/A" or (text.startswith("[") and text.endswith("]"))


def parse_float(text: str) -> float:
    match = _NUMBER.match(text.strip())
    if not match:
        raise ValueError(f"expected a number, got {text!r}")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def parse_count(text: str) -> int:
    value = parse_float(text)
    if value < 0 or value != int(value):
        raise ValueError(f"expected a count, got {text!r}")
    return int(value)


def parse_flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "pending"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(f"expected yes/no, got {text!r}")


def parse_mask(text: str) -> int:
    """A bit mask, decimal or ``0x`` hexadecimal as nvidia-smi prints it."""
    text = text.strip()
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        raise ValueError(f"expected a bit mask such as 0x0000000000000004, got {text!r}") from None


def parse_xids(text: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"[;\s]+", text.strip()) if p]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected Xid numbers separated by ';', got {text!r}") from None


def parse_time(text: str) -> float:
    """Seconds since the epoch, ISO 8601, or nvidia-smi's ``2024/05/01 12:00:00.123``.

    Times without a zone are read as UTC: replay only uses their differences.
    """
    text = text.strip()
    try:
        return parse_float(text)
    except ValueError:
        pass
    for parse in (datetime.fromisoformat, lambda t: datetime.strptime(t, NVSMI_TIME_FORMAT)):
        try:
            moment = parse(text)
        except ValueError:
            continue
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    raise ValueError(f"expected a timestamp (epoch seconds, ISO 8601 or {NVSMI_TIME_FORMAT}), got {text!r}")


def _field_parser(name: str) -> Callable[[str], object]:
    if name in _FLOAT_FIELDS:
        return parse_float
    if name in _INT_FIELDS:
        return parse_count
    if name == "rows_pending":
        return parse_flag
    if name == "throttle_reasons":
        return parse_mask
    if name == "gpu":
        return parse_count
    if name == "xids":
        return parse_xids
    if name == "timestamp":
        return parse_time
    return str.strip


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines that are not blank and not ``#`` comments."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{number}: not a text file (invalid UTF-8)") from None
            if number == 1:
                line = line.lstrip("\ufeff")  # a byte-order mark from a spreadsheet
            if line.strip() and not line.lstrip().startswith("#"):
                yield number, line


def _columns(header: list[str], path: Path, line: int) -> tuple[str, list[str | None]]:
    """The format name and, per column, the GpuSample field it fills (None: ignored)."""
    names = [re.sub(r"\s*\[.*\]$", "", h.strip()).lower() for h in header]
    if "index" in names or any(n in NVSMI_COLUMNS and "." in n for n in names):
        fields = [NVSMI_COLUMNS.get(n) for n in names]
        required = {"timestamp": "timestamp", "gpu": "index"}
        kind = "nvidia-smi"
    else:
        unknown = [n for n in names if n not in EFT_COLUMNS]
        if unknown:
            raise TraceError(
                f"{path}:{line}: unknown column {unknown[0]!r}; expected a header line of eft "
                f"columns ({','.join(EFT_COLUMNS)}) or nvidia-smi --format=csv output "
                "(with its header: not csv,noheader)"
            )
        fields = list(names)
        required = {"timestamp": "timestamp", "gpu": "gpu"}
        kind = "eft"
    for field_name, column in required.items():
        if field_name not in fields:
            raise TraceError(f"{path}:{line}: {kind} trace without a {column!r} column")
    duplicates = {f for f in fields if f and f != "rows_pending" and fields.count(f) > 1}
    if duplicates:
        raise TraceError(f"{path}:{line}: two columns give {sorted(duplicates)[0]!r}")
    return kind, fields


def read_trace(path: str | Path, node: str | None = None) -> Iterator[GpuSample]:
    """Yield the samples of a trace in file order.

    ``node`` names the node of every sample; without it an eft trace's ``node``
    column is used, and the file's stem where there is none.
    """
    path = Path(path)
    default_node = node or path.stem
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceError(f"{path}:1: empty trace (no header line)")
    header_line, header_text = first
    if prometheus.looks_like_prometheus(header_text):
        try:
            yield from prometheus.read_prometheus(path, itertools.chain([first], lines), node)
        except prometheus.DumpError as exc:
            raise TraceError(str(exc)) from None
        return
    header = next(csv.reader([header_text], skipinitialspace=True))
    kind, fields = _columns(header, path, header_line)
    parsers = [_field_parser(f) if f else None for f in fields]
    last_time: dict[tuple[str, int], float] = {}
    for number, text in lines:
        row = next(csv.reader(io.StringIO(text), skipinitialspace=True), [])
        if len(row) != len(fields):
            raise TraceError(f"{path}:{number}: expected {len(fields)} fields, got {len(row)}")
        values: dict[str, object] = {}
        for field_name, parse, cell in zip(fields, parsers, row):
            if field_name is None or is_missing(cell):
                continue
            try:
                value = parse(cell)
            except ValueError as exc:
                raise TraceError(f"{path}:{number}: column {field_name!r}: {exc}") from None
            if field_name == "rows_pending":  # nvidia-smi may give retired and remapped
                value = bool(value) or bool(values.get("rows_pending"))
            values[field_name] = value
        for required in ("timestamp", "gpu"):
            if required not in values:
                raise TraceError(f"{path}:{number}: missing {required}")
        if node is not None or "node" not in values:
            values["node"] = default_node
        sample = GpuSample(**values)
        previous = last_time.get(sample.key)
        if previous is not None and sample.timestamp < previous:
            raise TraceError(f"{path}:{number}: timestamp goes backwards for GPU {sample.gpu}")
        last_time[sample.key] = sample.timestamp
        yield sample


def batches(samples: Iterable[GpuSample]) -> Iterator[list[GpuSample]]:
    """Group consecutive samples into rounds: a round ends when a GPU repeats."""
    batch: list[GpuSample] = []
    seen: set[tuple[str, int]] = set()
    try:
        for sample in samples:
            if sample.key in seen:
                yield batch
                batch, seen = [], set()
            batch.append(sample)
            seen.add(sample.key)
    except TraceError:
        if batch:  # the rows before a bad one are good: hand them out first
            yield batch
        raise
    if batch:
        yield batch


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ";".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.3f}"
    return str(value)


def write_trace(
    path: str | Path,
    samples: Iterable[GpuSample],
    columns: Iterable[str] = EFT_COLUMNS,
    comments: Iterable[str] = (),
) -> None:
    """Write samples in eft's format, with the given columns and leading ``#`` comments."""
    columns = list(columns)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        for comment in comments:
            handle.write(f"# {comment}\n")
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(columns)
        for sample in samples:
            writer.writerow([_cell(getattr(sample, c)) for c in columns])
