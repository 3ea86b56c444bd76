"""The optional labels sidecar of a trace: ``<trace>.labels.json`` next to ``<trace>``.

A trace labels itself (``evaluate.derive_failures``); the sidecar is for what it
cannot show — a GPU that vanished without a row of missing metrics, a job that died
of OOM while the GPU kept answering — and for GPUs not to be counted::

    {"mode": "sudden_fall_off",
     "failures": [{"gpu": 0, "time": "2024-05-01T12:50:00Z", "node": "node-a", "mode": "..."}],
     "ignore": [{"gpu": 3}]}

Every key is optional; ``node`` may be left out where the trace has one node; ``time``
is anything a trace's timestamp column accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

from elasticft.health.evaluate import Failure, LabelError, Labels
from elasticft.health.trace import parse_time

SUFFIX = ".labels.json"


def sidecar_path(trace: Path) -> Path:
    return trace.with_name(trace.name + SUFFIX)


def _gpu_ref(entry: object, where: str) -> tuple[str | None, int]:
    if not isinstance(entry, dict):
        raise LabelError(f"{where}: expected an object such as {{\"gpu\": 0}}, got {entry!r}")
    gpu, node = entry.get("gpu"), entry.get("node")
    if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
        raise LabelError(f"{where}: 'gpu': expected a GPU index, got {gpu!r}")
    if node is not None and not isinstance(node, str):
        raise LabelError(f"{where}: 'node': expected a name, got {node!r}")
    return node, gpu


def _text(data: dict, key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise LabelError(f"{where}: {key!r}: expected text, got {value!r}")
    return value


def _list(data: dict, key: str, where: str) -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise LabelError(f"{where}: {key!r}: expected a list, got {value!r}")
    return value


def parse_labels(data: object, where: str) -> Labels:
    """Labels from a sidecar's decoded JSON; ``where`` starts every error message."""
    if not isinstance(data, dict):
        raise LabelError(f"{where}: expected a JSON object")
    unknown = sorted(set(data) - {"mode", "failures", "ignore"})
    if unknown:
        raise LabelError(f"{where}: unknown key {unknown[0]!r} (expected mode, failures, ignore)")
    failures = []
    for n, entry in enumerate(_list(data, "failures", where)):
        at = f"{where}: failures[{n}]"
        node, gpu = _gpu_ref(entry, at)
        if "time" not in entry:
            raise LabelError(f"{at}: missing 'time'")
        try:
            time = parse_time(str(entry["time"]).replace("Z", "+00:00"))
        except ValueError as exc:
            raise LabelError(f"{at}: 'time': {exc}") from None
        failures.append(Failure(node, gpu, time, _text(entry, "mode", at)))
    ignored = tuple(_gpu_ref(entry, f"{where}: ignore[{n}]") for n, entry in enumerate(_list(data, "ignore", where)))
    return Labels(tuple(failures), ignored, _text(data, "mode", where))


def read_labels(trace: Path) -> Labels | None:
    """The sidecar's labels, None where the trace has no sidecar."""
    path = sidecar_path(trace)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise LabelError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise LabelError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    return parse_labels(data, str(path))
