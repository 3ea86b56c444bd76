"""Assembling a memory checkpoint for a restart: every file of an iteration in one directory.

Before the workers start, each agent builds ``restore/iter_K`` for the newest iterations the
survivors can complete (two that are ready, so that one that does not load still leaves a choice;
one it could not build is removed and the next older one tried).
A file this node holds is checked against the index's crc32 and hard-linked (same tmpfs: no
copy); any other file is fetched from an alive holder, trying each in turn. A file no holder
can deliver intact makes that candidate not ready; the workers then take the next one, or
the newest disk checkpoint, and the event log says which and why.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from elasticft.contract.events import EventKind
from elasticft.contract.memory import RestoreCandidate
from elasticft.memckpt.index import CompleteIteration, FileSource
from elasticft.memckpt.node_dir import NodeDir, crc32_of, iter_name
from elasticft.memckpt.transfer import TransferError, fetch

log = logging.getLogger(__name__)

MAX_CANDIDATES = 2
FETCH_THREADS = 8  # enough to fill a NIC with a few peers, few enough not to swamp one holder


class _Failed(Exception):
    pass


def _local_copy(node_dir: NodeDir, node_id: str, iteration: int, src: FileSource) -> Path | None:
    if src.origin == node_id:
        part = node_dir.own_part(iteration)
        return part / src.name if part is not None else None
    return node_dir.held_part(src.origin, iteration) / src.name


def _place(node_dir: NodeDir, node_id: str, run_id: str, iteration: int, src: FileSource, dest: Path,
           timeout: float) -> None:
    """Put one verified file at ``dest``: a hard link of a local copy, else a download; _Failed names why."""
    tried = []
    if any(h == node_id for h, _ in src.holders):
        local = _local_copy(node_dir, node_id, iteration, src)
        try:
            if local is None or crc32_of(local) != src.crc:
                raise OSError("checksum mismatch against the index" if local is not None else "missing")
            os.link(local, dest)
            return
        except OSError as exc:
            tried.append(f"this node: {exc.strerror or exc}")
    for holder, address in src.holders:
        if holder == node_id:
            continue
        try:
            fetch(address, run_id, src.origin, iteration, src.name, dest, src.crc, timeout)
            return
        except TransferError as exc:
            tried.append(f"{holder}: {exc}")
    raise _Failed(f"{src.name} of {src.origin}: " + ("; ".join(tried) or "no alive holder"))


def assemble(node_dir: NodeDir, node_id: str, run_id: str, complete: CompleteIteration,
             timeout: float = 60.0) -> RestoreCandidate:
    """Build ``restore/iter_K`` for one complete iteration; never raises (a failure is a not-ready candidate)."""
    dest = node_dir.restore / iter_name(complete.iteration)
    try:
        dest.mkdir(parents=True)
        sources = list(complete.files.values())
        with ThreadPoolExecutor(max_workers=max(1, min(FETCH_THREADS, len(sources))),
                                thread_name_prefix="eft-mem-fetch") as pool:
            futures = [pool.submit(_place, node_dir, node_id, run_id, complete.iteration, s, dest / s.name, timeout)
                       for s in sources]
            errors = []
            for future in futures:
                try:
                    future.result()
                except (_Failed, OSError) as exc:
                    errors.append(str(exc))
        if errors:
            raise _Failed("; ".join(errors))
    except (_Failed, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        return RestoreCandidate(complete.iteration, "", False, str(exc))
    return RestoreCandidate(complete.iteration, str(dest), True)


def assemble_candidates(node_dir: NodeDir, node_id: str, run_id: str, complete: list[CompleteIteration],
                        record: Callable[..., None], timeout: float = 60.0) -> list[RestoreCandidate]:
    """Assemble complete iterations, newest first, until MAX_CANDIDATES are ready; record a fallback for
    each that failed (the older restorable one a node kept is then still tried)."""
    candidates: list[RestoreCandidate] = []
    for c in complete:
        if sum(candidate.ready for candidate in candidates) >= MAX_CANDIDATES:
            break
        candidates.append(assemble(node_dir, node_id, run_id, c, timeout))
    for i, candidate in enumerate(candidates):
        if candidate.ready:
            continue
        later = next((c for c in candidates[i + 1:] if c.ready), None)
        then = f"iteration {later.iteration} from memory" if later else "the newest disk checkpoint"
        log.warning("memory checkpoint %d cannot be restored on %s (%s); falling back to %s",
                    candidate.iteration, node_id, candidate.why, then)
        record(EventKind.MEM_CKPT_FALLBACK, iteration=candidate.iteration, why=candidate.why, then=then)
    return candidates
