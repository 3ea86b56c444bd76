"""A torch_dist save whose only stall is a copy of the state into host memory.

megatron-core can split a ``dist_checkpointing.save`` into a plan (on the caller's thread,
with a few small collectives), a write (anywhere) and a finalization (a collective that
makes rank 0 write ``.metadata``): ``save(..., async_sharded_save=True)`` returns the write
and the finalization as an ``AsyncRequest``. Megatron-LM forks a process for the write
and checks with an all-reduce every iteration whether all ranks are done.

``Snapshot`` does the same with less: it copies every tensor of the state into host
memory (``host_copy.py``: device-to-host on a GPU, into pinned buffers; a copy on the CPU,
since training updates the parameters in place; buffers reused across snapshots), so the
write can run on a plain thread, from tensors nobody else touches, while training goes
on. The copy runs on the training path, or beside the next iteration's forward and
backward (``overlap``): then the plan runs while it copies, the write starts once it is
complete, and the loop calls ``wait_copy`` before its update. Whether every rank's write
is done is part of the hook's vote (``memory.py``), so the finalization costs no
collective of its own. The files are ordinary torch_dist files:
``dist_checkpointing.load`` reads them at any TP×PP×DP.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elasticft.contract.memory import ITEMS_SUFFIX
from elasticft.contract.run_dir import write_atomically
from elasticft.worker.host_copy import HostCopier, HostCopy

__all__ = ["HostCopier", "SaveRequest", "Snapshot", "in_process_results_queue", "save_strategy"]

log = logging.getLogger(__name__)


def in_process_results_queue() -> None:
    """Hand torch_dist's write results back through a plain queue, for every save of this process.

    megatron-core otherwise creates the queue from a spawn-method multiprocessing
    Manager at the first save of each process: a new interpreter that re-imports
    ``__main__`` and costs seconds, at the first save after every (re)start. Writes
    that run in this process (ours, and a synchronous torch_dist save) need no more than
    a plain queue; a save written by a forked or spawned process (Megatron-LM's
    ``--async-save``) does, so a process that makes those must not call this.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = _InProcessQueue()


class _InProcessQueue(queue.Queue):
    """A plain queue where megatron-core's would come from a Manager: Megatron-Bridge's cleanup
    after a failed run shuts that queue's ``_manager`` down (here: nothing to shut down)."""

    class _NoManager:
        def shutdown(self) -> None:
            pass

    _manager = _NoManager()


@contextlib.contextmanager
def _plain_results_queue():
    """A plain queue for the writes planned inside (ours run on threads of this process),
    whatever queue the process's other saves use."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    shared, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = shared


@dataclass
class SaveRequest:
    """What a snapshot writes: the sharded state and more of ``dist_checkpointing.save``'s
    keyword arguments (Megatron-LM's ``content_metadata``, for one)."""

    state: dict
    options: dict = field(default_factory=dict)


class Snapshot:
    """One rank's share of one checkpoint being written in the background.

    ``start`` copies (or starts the copy), plans and starts the write; ``wait_copy`` is
    the loop's wait before it changes the state; ``done`` and ``failed`` say where the
    write is; ``finalize`` must run on every rank at the same point (it is a collective).
    """

    def __init__(self, iteration: int, path: Path, request, started: float, stall: float, nbytes: int,
                 copying: HostCopy, record_items: bool = False):
        self.iteration = iteration
        self.path = path
        self._items_dir = path if record_items else None
        self.stall = stall  # seconds the training loop waited: start (the copy too, unless overlapped) + wait_copy
        self.waited = 0.0  # of which in wait_copy
        self.bytes = nbytes
        self.copying = copying
        self._request = request
        self._started = started
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name=f"eft-snapshot-{iteration}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, iteration: int, path: Path, state: dict | SaveRequest, copier: HostCopier, strategy,
              validate: bool, overlap: bool = False, record_items: bool = False) -> Snapshot:
        """Copy ``state`` into host memory (``overlap``: start the copy), plan the save on
        this thread (collectives: every rank, the loop's thread) and start the write;
        ``record_items``: write down where each storage item lies in each file (``write_in_this_thread``)."""
        from megatron.core import dist_checkpointing

        started = time.perf_counter()
        request = state if isinstance(state, SaveRequest) else SaveRequest(state)
        host_state, copying = copier.start(request.state, overlap=overlap)
        try:
            path.mkdir(parents=True, exist_ok=True)
            with _plain_results_queue():
                request = dist_checkpointing.save(host_state, str(path), sharded_strategy=strategy,
                                                  validate_access_integrity=validate, async_sharded_save=True,
                                                  **_in_process_writer(), **request.options)
        except BaseException:
            copying.wait()  # no copy goes on into buffers the next snapshot refills
            raise
        return cls(iteration, path, request, started, time.perf_counter() - started, copier.bytes, copying,
                   record_items)

    def wait_copy(self) -> float:
        """The loop, before it changes the state in place: wait until the copy is complete;
        the seconds it waited (a stall, counted in ``stall``)."""
        waited = self.copying.wait()
        self.stall += waited
        self.waited += waited
        return waited

    def _write(self) -> None:
        try:
            self.copying.wait()  # the files are written from full buffers
            if self.copying.error is not None:
                raise self.copying.error
            if self._request.async_fn is not None:  # None: nothing of this rank's to write
                write_in_this_thread(self._request, self._items_dir)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote, raised by nobody
            self._error = exc
            log.warning("memory snapshot of iteration %d failed on this rank: %s", self.iteration, exc)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return self.done and self._error is not None

    def wait(self) -> None:
        self._thread.join()

    def finalize(self) -> tuple[float, bool]:
        """Every rank, at the same iteration, once every rank's write is done: rank 0 writes
        ``.metadata`` and ``metadata.json``. Returns the seconds since ``start`` and whether
        this rank's part succeeded.

        A write that failed on any rank fails the first step on every rank (megatron-core
        broadcasts it), so all drop the snapshot alike. A later step that fails on rank 0
        (metadata.json) still meets the others in the barrier they are waiting in.
        """
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        first, *rest = self._request.finalize_fns
        try:
            first()  # the write results: a failure on any rank raises on every rank
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the snapshot is lost, training is not
            log.warning("memory snapshot of iteration %d: finalization failed: %s", self.iteration, exc)
            return time.perf_counter() - self._started, False
        ok = True
        for finalize in rest:  # rank 0 writes metadata.json, then every rank meets in a barrier
            try:
                finalize()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                ok = False
                log.warning("snapshot of iteration %d: finalization failed: %s", self.iteration, exc)
                torch.distributed.barrier()  # the one this rank skipped; the others wait in it
        return time.perf_counter() - self._started, ok


@functools.cache
def _in_process_writer() -> dict:
    """megatron-core >= 0.17 writes through NVRx's writer unless told ``async_strategy="mcore"``
    (its own, thread-based one; NVRx need not be installed); older ones have only their own."""
    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


def write_in_this_thread(request, items_dir: Path | None = None) -> None:
    """Run an ``AsyncRequest``'s write on the calling thread, without the process megatron forks.

    megatron-core's write function forks a process per file. From a training process that
    is costly twice over: the fork copies the page tables of a process holding the whole
    model, and until the child exits every page the training loop writes to (parameters,
    optimizer state, the next snapshot's buffers) takes a copy-on-write fault. Our tensors
    are already private host copies, so the same per-file writer runs here instead, and
    its results reach the queue the finalization reads in the shape the forking function
    gives them. Any other write function (a megatron-core that changed) runs as it is.

    With ``items_dir``, each file's storage items' byte ranges go beside it as ``<file>.items``:
    the node agent then checks the file in chunks whose edges are the items' (a restarting rank
    reads whole items, so it reads exactly its items' chunks; ``elasticft.memckpt.chunks``).
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fn = request.async_fn
    forking = getattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", None)
    if not (isinstance(fn, functools.partial) and fn.func is forking
            and len(fn.args) == 2 and len(request.async_fn_args) == 3):
        _write_threaded(fn, request.async_fn_args, items_dir)
        return
    transform_list, use_msc = fn.args
    _rank, buckets, results_queue = request.async_fn_args
    local: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()  # the writer marks each bucket done on it

    def write(index: int, bucket) -> None:
        done.put(index)
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, local, done, use_fsync=False,
                                                   use_msc=use_msc)

    # One thread per file: the bytes go out in file.write calls, which release the GIL.
    with ThreadPoolExecutor(max_workers=len(buckets), thread_name_prefix="eft-snapshot-write") as pool:
        list(pool.map(write, range(len(buckets)), buckets))
    results: dict | BaseException = {}
    for _ in buckets:
        index, written = local.get()
        if isinstance(written, BaseException):
            results = written
            break
        results[index] = written
    if items_dir is not None and isinstance(results, dict):
        write_item_layouts(items_dir, [r for written in results.values() for r in written])
    results_queue.put(results)


def _write_threaded(fn, args, items_dir: Path | None) -> None:
    """megatron-core >= 0.17's own writer, which already runs threads in this process. Its
    arguments are (rank, buckets, results queue), as the forking one's: with ``items_dir``, its
    results pass through a queue of ours on their way, for the items' layouts."""
    if items_dir is None or len(args) != 3 or not hasattr(args[2], "put"):
        fn(*args)
        return
    rank, buckets, results_queue = args
    local: queue.Queue = queue.Queue()
    fn(rank, buckets, local)
    results = local.get_nowait()
    if isinstance(results, dict):
        write_item_layouts(items_dir, [r for written in results.values() for r in written])
    results_queue.put(results)


def write_item_layouts(folder: Path, write_results) -> None:
    """``<file>.items`` for each file the write results name: ``{"items": [[offset, length], ...]}``."""
    from elasticft import torch_seam

    items: dict[str, list[list[int]]] = {}
    for result in write_results:
        name, offset, length = torch_seam.storage_location(result.storage_data)
        items.setdefault(name, []).append([offset, length])
    for name, ranges in items.items():
        write_atomically(folder / (name + ITEMS_SUFFIX), json.dumps({"items": sorted(ranges)}))


def save_strategy():
    """torch_dist with one file per rank, the plan cached across snapshots of one structure."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
    )

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1, cached_metadata=True)
