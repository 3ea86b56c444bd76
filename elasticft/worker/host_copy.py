"""A sharded state dict's tensors copied into host memory: on the training path, or beside it.

A memory snapshot holds the state of one iteration; the copy into host memory is that
moment, and until it is complete nothing may change the tensors it reads.
``HostCopier.start`` puts a host buffer (reused from one snapshot to the next) in place of
every tensor of the state and starts filling them (``HostCopy``):

* blocking (``overlap=False``): the buffers are full when ``start`` returns;
* overlapped: on the CPU a thread copies; from a GPU the device-to-host copies are queued
  on a side stream, after the work the training thread had queued (iteration K's update),
  and an event marks their end, which a thread waits for. Meanwhile training runs the next
  iteration's forward and backward, which read the tensors but do not write them; the
  first thing that writes them (the optimizer's update) calls ``HostCopy.wait`` first.

What cannot wait for the copy: the plan of the save (``snapshot.py``) runs on the training
thread right after ``start``, and needs the buffers' shapes, not their data, except in two
places, handled here. Tensors outside a ShardedTensor go to ``common.pt`` during the plan:
they are copied at once. And megatron-core's plan clones a CPU tensor that is a view of a
larger storage (the chunks a ShardedTensorFactory makes, e.g. SwiGLU's): so factories are
built here, on the training tensors, and each resulting ShardedTensor gets a buffer of its
own, which is no view.
"""

from __future__ import annotations

import copy
import threading
import time

import torch

COPY_THREAD = "eft-snapshot-copy"


def copy_tensor(buffer: torch.Tensor, tensor: torch.Tensor, non_blocking: bool) -> None:
    """The lowest layer: one tensor into its host buffer (asynchronous from a GPU when
    ``non_blocking``). The tests slow it down here."""
    buffer.copy_(tensor, non_blocking=non_blocking)


def _mapping():
    from megatron.core.dist_checkpointing import mapping

    return mapping


class HostCopy:
    """The copy of one snapshot's tensors into their host buffers, running or done."""

    def __init__(self, overlapped: bool):
        self.overlapped = overlapped
        self.seconds: float | None = None  # from the start of the copy to its end
        self.error: BaseException | None = None
        self._complete = threading.Event()

    @property
    def done(self) -> bool:
        return self._complete.is_set()

    def wait(self) -> float:
        """Return once every buffer is filled (or the copy failed: ``error``); the seconds
        the caller waited."""
        if self._complete.is_set():
            return 0.0
        began = time.perf_counter()
        self._complete.wait()
        return time.perf_counter() - began

    def _run(self, began: float, host: list, device: list, queued, delay: float) -> None:
        """Fill the host buffers of ``host`` (CPU tensors) here and wait for the event
        ``queued`` that follows ``device``'s copies on the side stream; then the copy is
        complete. Never raises."""
        try:
            for buffer, tensor in host:
                copy_tensor(buffer, tensor, non_blocking=False)
            if queued is not None:
                queued.synchronize()
            if delay:  # --eft-inject copy_slow: a slow copy, for tests
                time.sleep(delay)
        except BaseException as exc:  # noqa: BLE001 - the snapshot fails; training does not
            self.error = exc
        finally:
            host.clear()  # the training tensors are no longer held
            device.clear()
            self.seconds = time.perf_counter() - began
            self._complete.set()


class HostCopier:
    """Host buffers for a sharded state dict's tensors, one per tensor slot, reused from one
    snapshot to the next.

    Reuse matters: writing into fresh memory costs a page fault per 4 KiB (about 1 GB/s on
    a VM), into memory touched before it is a memcpy; and on a GPU, pinned buffers are what
    make the device-to-host copy asynchronous and fast. A buffer is reused only once the
    snapshot that used it is finalized (one snapshot at a time), so no write reads a buffer
    that is being refilled.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}  # tensor slot (walk order) -> its host buffer
        self._stream = None  # the side stream of overlapped device-to-host copies, made once
        self.bytes = 0
        self.delay = 0.0  # seconds each copy takes longer (--eft-inject copy_slow)

    def copy(self, state: dict) -> dict:
        """A copy of ``state`` whose tensors (and sharded objects) training can no longer change."""
        host_state, copying = self.start(state, overlap=False)
        if copying.error is not None:
            raise copying.error
        return host_state

    def start(self, state: dict, overlap: bool) -> tuple[dict, HostCopy]:
        """``state`` with host buffers in place of its tensors, and their copy: complete
        when this returns unless ``overlap``."""
        began = time.perf_counter()
        self.bytes = 0
        slot = [0]
        host: list = []  # (buffer, CPU tensor)
        device: list = []  # (pinned buffer, GPU tensor)

        def buffer_for(t: torch.Tensor) -> torch.Tensor:
            self.bytes += t.numel() * t.element_size()
            slot[0] += 1
            gpu = t.device.type != "cpu"
            buf = self._buffers.get(slot[0])
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=gpu)
                self._buffers[slot[0]] = buf
            return buf

        def sharded(t: torch.Tensor) -> torch.Tensor:  # copied with the rest, maybe later
            t = t.detach()
            buf = buffer_for(t)
            (device if t.device.type != "cpu" else host).append((buf, t))
            return buf

        def now(t: torch.Tensor) -> torch.Tensor:  # read by the plan: copied before it
            t = t.detach()
            buf = buffer_for(t)
            copy_tensor(buf, t, non_blocking=False)
            return buf

        host_state = self._walk(state, sharded, now)
        copying = HostCopy(overlap)
        if not overlap:  # today's copy, on the training path
            if device:
                for buf, t in device:
                    copy_tensor(buf, t, non_blocking=True)
                torch.cuda.synchronize()  # the copies are complete before training touches the GPU tensors
            copying._run(began, host, [], None, self.delay)
            return host_state, copying
        queued = self._queue(device) if device else None
        threading.Thread(target=copying._run, args=(began, host, device, queued, self.delay),
                         name=COPY_THREAD, daemon=True).start()
        return host_state, copying

    def _queue(self, device: list):
        """Queue the device-to-host copies on the side stream, behind everything the
        training thread has queued so far (iteration K's update is part of it); the event
        that follows them."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for buf, t in device:
                copy_tensor(buf, t, non_blocking=True)
                # The caching allocator must not hand a freed source's memory to the training
                # stream before the side stream has read it (a state_fn may build temporaries).
                t.record_stream(stream)
        queued = torch.cuda.Event()
        queued.record(stream)
        return queued

    def _walk(self, value, sharded, now):
        mapping = _mapping()
        if isinstance(value, dict):
            return {k: self._walk(v, sharded, now) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, sharded, now) for v in value]
        if isinstance(value, mapping.ShardedTensorFactory):
            return self._walk(value.build(), sharded, now)  # what save() would build, from the training tensor
        if isinstance(value, mapping.ShardedTensor):
            leaf = copy.copy(value)
            leaf.data = sharded(value.data)
            return leaf
        if isinstance(value, mapping.ShardedObject):
            leaf = copy.copy(value)
            leaf.data = copy.deepcopy(value.data)
            return leaf
        if isinstance(value, torch.Tensor):
            return now(value)
        return copy.deepcopy(value)
