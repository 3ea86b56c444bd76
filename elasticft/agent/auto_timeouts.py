"""The section timeouts in force, and ``--eft-auto-timeouts``: learning them from the run.

Fixed timeouts must fit the slowest job anyone runs, so they catch a hang late: a 2 s
step under the default ``step=180`` hangs for three minutes before anyone acts. With
``--eft-auto-timeouts`` each section observed so far gets ``longest seen x factor``
(never below ``MIN_LEARNED``) instead; sections not yet observed keep the configured
value. The longest durations are kept job-wide in ``/eft/<run>/timeouts`` (merged by
every agent with a compare-and-swap) and in ``<checkpoint dir>/eft_timeouts.json``, so
the next run — a new run id, the same checkpoints — starts with what this one learned.

``learned_timeouts`` is the pure rule; ``SectionTimeouts`` holds the state and the I/O.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Mapping, Sequence

from elasticft.config import HangConfig
from elasticft.contract.argv import flag_value
from elasticft.contract.keys import RunKeys
from elasticft.contract.run_dir import write_atomically
from elasticft.store import EtcdClient, StoreError

log = logging.getLogger(__name__)

TIMEOUTS_FILE = "eft_timeouts.json"
# A learned timeout never goes below this: a toy step of 10 ms times 5 would make any
# pause of the OS a "hang".
MIN_LEARNED = 5.0
# Persist again only when a section's longest grew by more than this fraction: early
# steps set a new maximum almost every time, and each persist is an etcd write.
PERSIST_GROWTH = 0.1


def learned_timeouts(configured: Mapping[str, float], longest: Mapping[str, float], factor: float) -> dict[str, float]:
    """``configured`` with each section in ``longest`` replaced by longest x factor (>= MIN_LEARNED).

    A section configured as 0 (no limit) stays unlimited: the user turned it off.
    """
    out = dict(configured)
    for section, seconds in longest.items():
        if section in out and out[section] > 0:
            out[section] = max(seconds * factor, MIN_LEARNED)
    return out


def merge_longest(*maps: Mapping[str, float]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for m in maps:
        for section, seconds in m.items():
            merged[section] = max(merged.get(section, 0.0), float(seconds))
    return merged


def _parse(text: str | bytes, source: str) -> dict[str, float]:
    try:
        record = json.loads(text)
        return {str(k): float(v) for k, v in dict(record["longest"]).items() if float(v) > 0}
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring learned timeouts in %s: %s", source, exc)
        return {}


class SectionTimeouts:
    """The timeouts this node enforces; with ``auto`` on, they follow what the run observes.

    ``load_dir``/``save_dir``: the checkpoint directories the worker loads from and saves
    to (Megatron's ``--load`` and ``--save``), where the learned values are read and kept.
    """

    def __init__(self, config: HangConfig, client: EtcdClient | None = None, keys: RunKeys | None = None,
                 load_dir: str | None = None, save_dir: str | None = None):
        self.configured = config.section_timeouts()
        self.auto = config.auto_timeouts
        self.factor = config.timeout_factor
        self._client = client
        self._keys = keys
        self._load_dir = load_dir
        self._save_dir = save_dir
        self.longest: dict[str, float] = {}
        self._persisted: dict[str, float] = {}

    @classmethod
    def for_worker(cls, config: HangConfig, argv: Sequence[str], client=None, keys=None) -> "SectionTimeouts":
        save = flag_value(argv, "--save")
        return cls(config, client, keys, load_dir=flag_value(argv, "--load") or save, save_dir=save)

    @property
    def current(self) -> dict[str, float]:
        return learned_timeouts(self.configured, self.longest, self.factor) if self.auto else dict(self.configured)

    def load(self) -> str | None:
        """Start from what this run (etcd) or the previous one (checkpoint dir) learned; the source."""
        if not self.auto:
            return None
        found, source = {}, None
        if self._client is not None:
            try:
                kv = self._client.get(self._keys.timeouts)
            except StoreError as exc:
                log.warning("could not read learned timeouts from etcd: %s", exc)
                kv = None
            if kv is not None:
                found, source = _parse(kv.value, self._keys.timeouts), self._keys.timeouts
        for directory in (self._load_dir, self._save_dir):
            if found or not directory:
                continue
            path = Path(directory) / TIMEOUTS_FILE
            if path.is_file():
                found, source = _parse(path.read_text(), str(path)), str(path)
        self.longest = merge_longest(self.longest, found)
        self._persisted = dict(self.longest)
        if found:
            log.info("section timeouts learned before, from %s: %s", source, self.describe())
        return source if found else None

    def observe(self, longest: Mapping[str, float]) -> bool:
        """Take in the workers' longest sections; True when it is worth persisting."""
        if not self.auto:
            return False
        self.longest = merge_longest(self.longest, {k: v for k, v in longest.items() if k in self.configured})
        return any(
            seconds > self._persisted.get(section, 0.0) * (1 + PERSIST_GROWTH)
            for section, seconds in self.longest.items()
        )

    def persist(self) -> None:
        """Merge into ``/eft/<run>/timeouts`` and write ``<save dir>/eft_timeouts.json``."""
        if not self.auto or not self.longest:
            return
        if self._client is not None:
            try:
                self.longest = self._merge_into_etcd()
            except StoreError as exc:
                log.warning("could not store learned timeouts in etcd: %s", exc)
        if self._save_dir:
            try:
                Path(self._save_dir).mkdir(parents=True, exist_ok=True)
                write_atomically(Path(self._save_dir) / TIMEOUTS_FILE, self._record(), durable=True)
            except OSError as exc:
                log.warning("could not keep learned timeouts in %s: %s", self._save_dir, exc)
        self._persisted = dict(self.longest)
        log.info("section timeouts now %s", self.describe())

    def _merge_into_etcd(self) -> dict[str, float]:
        key = self._keys.timeouts

        def merged(stored: bytes | None) -> str:
            self.longest = merge_longest(self.longest, _parse(stored, key) if stored is not None else {})
            return self._record()

        self._client.update(key, merged)
        return self.longest

    def _record(self) -> str:
        return json.dumps({"longest": self.longest, "factor": self.factor, "timeouts": self.current,
                           "updated": time.time()}, sort_keys=True)

    def describe(self) -> str:
        return ", ".join(f"{section}={seconds:.3g}s" if seconds else f"{section}=off"
                         for section, seconds in self.current.items())
