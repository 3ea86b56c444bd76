"""This rank's own work in a step of Megatron-LM's loop, for straggler detection.

In synchronous training every rank's wall step time is the slowest rank's: the others
wait for it in the next collective. What tells the straggler apart is the time a rank
spends on work that waits for nobody. In Megatron's pipeline schedules that is each
micro batch's ``forward_step`` and ``backward_step`` (``megatron.core.pipeline_parallel.
schedules``): the pipeline's sends and receives, and the data-parallel gradient reduction
(``finalize_model_grads``), run between them. Tensor-parallel all-reduces run inside
them, so ranks of one tensor-parallel group (one node, as a rule) share their slowest
member's time; nodes are still told apart, which is what the agent acts on.

On the CPU a block is timed with the clock. On a GPU the work runs asynchronously, so each
block records a pair of CUDA events and the step's total is read once, at the step's end
(Megatron has already synchronised the device for the step's grad norm by then): no
synchronisation per micro batch.
"""

from __future__ import annotations

import contextlib
import time


class StepWork:
    """Sums the timed blocks of the step in progress; ``take()`` at the step's end."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._events: list = []  # (start, end) CUDA event pairs of this step's blocks
        self._blocks = 0

    @contextlib.contextmanager
    def block(self):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
                self._blocks += 1
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds += time.perf_counter() - started
            self._blocks += 1

    def take(self) -> float | None:
        """The step's work in seconds (None: no block ran), and a fresh start for the next."""
        if not self._blocks:
            return None
        seconds = self._seconds
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
        self._seconds, self._events, self._blocks = 0.0, [], 0
        return seconds
