"""Preparing a memory checkpoint for a restart: where each file of an iteration can be read.

Before the workers start, each agent prepares ``restore/iter_K`` for the newest iterations the
survivors can complete (two that are ready, so that one that does not load still leaves a choice;
one it could not prepare is removed and the next older one tried). Only the checkpoint-wide
files (``.metadata``, ``common.pt``, ``metadata.json``: every rank reads them whole) are placed
there: a hard link of this node's copy or a download from an alive holder, either checked
against the index's crc32. A shard file is not moved at all: the candidate names where each one
can be read (this node's copy, hard-linked into the directory so that no pruning removes it
mid-load, then the other alive holders), its size, crc and chunk table, and each rank reads
only the byte ranges its load plan needs (``elasticft.worker.ranged_reads``), every chunk checked.
A checkpoint-wide file no holder can deliver intact makes that candidate not ready; the workers
then take the next one, or the newest disk checkpoint, and the event log says which and why.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from elasticft.contract.events import EventKind
from elasticft.contract.memory import CHUNKS_SUFFIX, MemPart, RangedFile, RestoreCandidate, is_shard_file
from elasticft.memckpt.index import CompleteIteration, FileSource
from elasticft.memckpt.node_dir import NodeDir, crc32_of, iter_name
from elasticft.memckpt.transfer import TransferError, fetch

log = logging.getLogger(__name__)

MAX_CANDIDATES = 2
FETCH_THREADS = 8  # enough to fill a NIC with a few peers, few enough not to swamp one holder


class _Failed(Exception):
    pass


def _local_copy(node_dir: NodeDir, node_id: str, iteration: int, src: FileSource) -> Path | None:
    """This node's copy of ``src``: of its own part, or held for the origin, as a holder the index
    lists or as a spare (a spare's extra copy is not listed: memckpt/placement.py); None: none."""
    if src.origin == node_id:
        part = node_dir.own_part(iteration)
        return part / src.name if part is not None else None
    held = node_dir.held_part(src.origin, iteration) / src.name
    return held if any(h == node_id for h, _ in src.holders) or held.is_file() else None


def _place(node_dir: NodeDir, node_id: str, run_id: str, iteration: int, src: FileSource, dest: Path,
           timeout: float) -> None:
    """Put one verified file at ``dest``: a hard link of a local copy, else a download; _Failed names why."""
    tried = []
    local = _local_copy(node_dir, node_id, iteration, src)
    if local is not None or any(h == node_id for h, _ in src.holders):
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
            fetch(address, run_id, src.origin, iteration, src.name, dest, src.crc, timeout, node=node_id)
            return
        except TransferError as exc:
            tried.append(f"{holder}: {exc}")
    raise _Failed(f"{src.name} of {src.origin}: " + ("; ".join(tried) or "no alive holder"))


def _ranged(node_dir: NodeDir, node_id: str, iteration: int, src: FileSource, part: MemPart | None,
            dest: Path) -> RangedFile:
    """Where the ranks read a shard file: this node's copy (linked into ``dest`` with its chunk table),
    then the other holders, starting at a different one for each reading node (the load spreads)."""
    chunks = part.files.get(src.name + CHUNKS_SUFFIX) if part is not None else None
    others = [[h, a] for h, a in src.holders if h != node_id]
    turn = zlib.crc32(f"{node_id}/{src.name}".encode()) % len(others) if others else 0
    entry = RangedFile(src.name, src.origin, src.size, src.crc, others[turn:] + others[:turn],
                       chunks=list(chunks) if chunks else None)
    local = _local_copy(node_dir, node_id, iteration, src)
    # A copy pruned meanwhile, or never received, is read from the holders; so is a missing table.
    names = [src.name, src.name + CHUNKS_SUFFIX] if chunks else [src.name]
    for name in names if local is not None else []:
        try:
            os.link(local.with_name(name), dest / name)
        except OSError as exc:
            log.warning("memory checkpoint %d: this node's copy of %s is not usable (%s): reading it from "
                        "its holders", iteration, name, exc.strerror or exc)
            break
        entry.local = True
    if not entry.local and not entry.holders:
        raise _Failed(f"{src.name} of {src.origin}: this node's copy is not usable and no other node holds one")
    return entry


def prepare(node_dir: NodeDir, node_id: str, run_id: str, complete: CompleteIteration,
            parts: dict[tuple[str, int], MemPart] | None = None, timeout: float = 60.0) -> RestoreCandidate:
    """Prepare ``restore/iter_K`` for one complete iteration; never raises (a failure is a not-ready candidate).

    ``parts`` ((origin, iteration) -> its index entry) name each shard file's chunk table."""
    dest = node_dir.restore / iter_name(complete.iteration)
    try:
        dest.mkdir(parents=True)
        whole = [s for s in complete.files.values() if not is_shard_file(s.name)]
        with ThreadPoolExecutor(max_workers=max(1, min(FETCH_THREADS, len(whole))),
                                thread_name_prefix="eft-mem-fetch") as pool:
            futures = [pool.submit(_place, node_dir, node_id, run_id, complete.iteration, s, dest / s.name, timeout)
                       for s in whole]
            errors = []
            for future in futures:
                try:
                    future.result()
                except (_Failed, OSError) as exc:
                    errors.append(str(exc))
        if errors:
            raise _Failed("; ".join(errors))
        files = {s.name: _ranged(node_dir, node_id, complete.iteration, s,
                                 (parts or {}).get((s.origin, complete.iteration)), dest)
                 for s in complete.files.values() if is_shard_file(s.name)}
    except (_Failed, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        return RestoreCandidate(complete.iteration, "", False, str(exc))
    return RestoreCandidate(complete.iteration, str(dest), True, files=files)


def prepare_candidates(node_dir: NodeDir, node_id: str, run_id: str, complete: list[CompleteIteration],
                       record: Callable[..., None], timeout: float = 60.0,
                       parts: list[MemPart] | None = None) -> list[RestoreCandidate]:
    """Prepare complete iterations, newest first, until MAX_CANDIDATES are ready; record a fallback for
    each that failed (the older restorable one a node kept is then still tried)."""
    by_key = {(p.node, p.iteration): p for p in parts or []}
    candidates: list[RestoreCandidate] = []
    for c in complete:
        if sum(candidate.ready for candidate in candidates) >= MAX_CANDIDATES:
            break
        candidates.append(prepare(node_dir, node_id, run_id, c, by_key, timeout))
    for i, candidate in enumerate(candidates):
        if candidate.ready:
            continue
        later = next((c for c in candidates[i + 1:] if c.ready), None)
        then = f"iteration {later.iteration} from memory" if later else "the newest disk checkpoint"
        log.warning("memory checkpoint %d cannot be restored on %s (%s); falling back to %s",
                    candidate.iteration, node_id, candidate.why, then)
        record(EventKind.MEM_CKPT_FALLBACK, iteration=candidate.iteration, why=candidate.why, then=then)
    return candidates
