"""Reading a record: every record eft keeps (in etcd or a run directory) is one JSON object."""

from __future__ import annotations

import json
from typing import Any


def json_object(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """``raw`` parsed (a dict passes as it is); ValueError when it is not a JSON object."""
    record = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record
