"""Progress heartbeats, the reading side: one JSON file per rank in the run directory.

Every rank keeps ``<run dir>/progress/<local rank>.json`` (``elasticft.worker.progress``
writes it); its node agent reads it for section timeouts (hang detection), straggler
scores and the silent-worker watchdog. The record and the sections are here so that
the writer and the readers agree on one definition.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticft.contract.json_object import json_object
from elasticft.contract.phases import LoadTier, stamps_from_json
from elasticft.contract.run_dir import PROGRESS_DIR

log = logging.getLogger(__name__)

# A rank is always in exactly one of these (see elasticft.worker.progress for when).
SECTIONS = ("setup", "step", "checkpointing", "other")
# The upper bounds (seconds) of the stall histogram a rank keeps per tier (``stall_buckets``): a
# step's wait for a background save runs from milliseconds to a full save's time. /metrics shows it.
STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def stall_bucket(seconds: float) -> int:
    """The index of the bucket ``seconds`` falls in (the last: above every bound)."""
    return bisect.bisect_left(STALL_BUCKETS, seconds)


def stall_counts(value: Any) -> dict[str, tuple[int, ...]]:
    """A record's ``stall_buckets``; a tier whose counts do not fit the bounds is dropped."""
    counts = {}
    for tier, values in (value.items() if isinstance(value, dict) else ()):
        if isinstance(values, list) and len(values) == len(STALL_BUCKETS) + 1 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            counts[str(tier)] = tuple(values)
    return counts


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's last heartbeat, as the agent reads it."""

    rank: int
    local_rank: int
    pid: int
    iteration: int | None  # the last iteration ``step()`` was called for
    section: str  # the section open now
    since: float  # unix time it opened
    time: float  # unix time of this heartbeat
    longest: dict[str, float] = field(default_factory=dict)  # section -> longest completed, seconds
    step_times: tuple[float, ...] = ()  # recent steps' work time (else wall time), oldest first
    dump_signal: int | None = None  # the signal that makes the rank print its stacks
    # What the process's time went to, for `eft report` (absent from older writers):
    started: float | None = None  # unix time the process started
    first_step: float | None = None  # unix time of its first step() (setup ends there)
    first_iteration: int | None = None  # the iteration of that first step()
    steps: int = 0  # completed steps
    totals: dict[str, float] = field(default_factory=dict)  # section -> seconds spent in it, closed ones
    stalls: dict[str, float] = field(default_factory=dict)  # tier -> seconds steps waited for background saves
    stall_buckets: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tier -> those waits per STALL_BUCKETS
    stop_reason: str | None = None  # the job agreed to save and exit for this (elasticft.worker.vote.SAVE_REASONS)
    # When the process's start phases ended (contract/phases.py: imports, process_group, load),
    # and what the load read: absent when the script has no eft hook or predates them.
    phases: dict[str, float] = field(default_factory=dict)
    loaded_from: LoadTier | None = None
    loaded_bytes: int | None = None

    @classmethod
    def from_json(cls, record: Any) -> "ProgressRecord":
        """Raises ValueError or TypeError on a malformed record."""
        record = json_object(record)
        if record.get("section") not in SECTIONS:
            raise ValueError(f"unknown section {record.get('section')!r}")
        iteration = record.get("iteration")
        dump = record.get("dump_signal")
        return cls(
            rank=int(record["rank"]),
            local_rank=int(record["local_rank"]),
            pid=int(record["pid"]),
            iteration=None if iteration is None else int(iteration),
            section=record["section"],
            since=float(record["since"]),
            time=float(record["time"]),
            longest={str(k): float(v) for k, v in dict(record.get("longest") or {}).items()},
            step_times=tuple(float(t) for t in record.get("step_times") or ()),
            dump_signal=None if dump is None else int(dump),
            started=_optional(record.get("started"), float),
            first_step=_optional(record.get("first_step"), float),
            first_iteration=_optional(record.get("first_iteration"), int),
            steps=int(record.get("steps") or 0),
            totals={str(k): float(v) for k, v in dict(record.get("totals") or {}).items()},
            stalls={str(k): float(v) for k, v in dict(record.get("stalls") or {}).items()},
            stall_buckets=stall_counts(record.get("stall_buckets")),
            stop_reason=_optional(record.get("stop_reason"), str),
            phases={str(k): v for k, v in stamps_from_json(record.get("phases")).items()},
            loaded_from=LoadTier(record["loaded_from"]) if record.get("loaded_from") in tuple(LoadTier) else None,
            loaded_bytes=_optional(record.get("loaded_bytes"), int),
        )


def _optional(value: Any, kind: type):
    return None if value is None else kind(value)


def progress_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / PROGRESS_DIR


def read_progress(run_dir: str | os.PathLike) -> dict[int, ProgressRecord]:
    """Every readable heartbeat in ``run_dir``, by local rank (malformed files skipped)."""
    records = {}
    try:
        names = os.listdir(progress_dir(run_dir))
    except FileNotFoundError:
        return records
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            record = ProgressRecord.from_json(json.loads((progress_dir(run_dir) / name).read_text()))
        except FileNotFoundError:
            continue  # replaced between listdir and read: the next read sees it
        except (ValueError, TypeError, KeyError) as exc:
            log.debug("skipping heartbeat %s: %s", name, exc)
            continue
        records[record.local_rank] = record
    return records


def reached(beats: dict[int, ProgressRecord]) -> int | None:
    """The highest iteration any of a node's workers got to (None: none stepped).

    A heartbeat is written at most every STEP_WRITE_INTERVAL, so a killed rank's can lag its
    last iterations while a peer's has them: how far a generation got is the most any says.
    The restore's ``redone`` and ``eft report``'s iterations lost both count from this.
    """
    return max((b.iteration for b in beats.values() if b.iteration is not None), default=None)


def saved_and_stopped(beats: dict[int, ProgressRecord]) -> bool:
    """Whether every worker of a node agreed to save and exit and got past that save (its last
    heartbeat names the reason and is out of ``checkpointing``). The job as a whole agreed: the
    other nodes' workers stop at the same save, so this node's going is a departure, not a loss
    to restart them for (a pod deleted, a node drained: it leaves before they have exited)."""
    return bool(beats) and all(b.stop_reason and b.section != "checkpointing" for b in beats.values())
