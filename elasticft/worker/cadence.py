"""When the ranks vote: at iterations every rank can name without asking anyone.

A vote is a job-wide exchange whose time grows with the job (``tree_max.py``: 2·⌈log2 N⌉
hops; a gloo ring all_reduce would be 2·(N−1)). So the votes get a budget,
``--eft-vote-budget``, a share of training time (1 %): while a vote costs less than that
share of a step, the ranks vote every iteration, as they always did; where it costs more
(a huge job, very short steps), every k-th iteration, k the smallest that keeps within the
budget. Each vote agrees k for the next (the MIN over the ranks of their own estimates,
from their measured vote and step times), so the next vote is the same iteration on every
rank. Besides, every rank votes

* where the loop saves or stops on its own (Megatron's ``--save-interval``,
  ``--non-persistent-save-interval`` and ``--exit-interval`` multiples, its last iteration
  ``train_iters``: the Megatron-LM mode reads them from Megatron's parsed arguments,
  ``megatron_seam.loop_ends``): a verdict of bad numbers must reach every rank before any of
  them saves. Where the loop saves at an iteration no rank voted at all the same (a signal's
  save, the exit duration's, a final save), its save wrapper has the ranks vote first
  (``Hook.vote_held``);
* wherever a ballot has state in flight (a snapshot or a save being written) or the
  numbers check re-runs a bad iteration (``Ballot.needs_vote``).

Everything a rank sees between votes (a request, a signal, a switch, bad numbers) is held
until the next one: a wait of at most k iterations, about vote time / budget (0.1 s for a
1 ms vote). ``--eft-vote-budget 0`` votes every iteration whatever it costs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable

# The cadence slot holds CAP - k, so that the vote's MAX is the smallest k any rank proposed.
CAP = 1 << 40
MAX_EVERY = 1 << 20  # iterations between two votes at most, whatever the figures
KEPT = 16  # recent step and vote times a rank's estimate is the median of


class VoteCadence:
    """Which iterations are vote iterations; the same answer on every rank."""

    def __init__(self, budget: float, every: tuple[int | None, ...] = (), last: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.budget = budget
        self.every = tuple(n for n in every if n and n > 0)  # the loop's own save and exit intervals
        self.last = last  # the loop's last iteration, if known
        self.next_vote: int | None = None  # agreed at the last vote; None: vote at the next step
        self._clock = clock
        self._last_step: float | None = None
        self._steps: deque[float] = deque(maxlen=KEPT)
        self._votes: deque[float] = deque(maxlen=KEPT)

    def tick(self) -> None:
        """One step is done (called at every ``hook.step``): time it."""
        now = self._clock()
        if self._last_step is not None:
            self._steps.append(now - self._last_step)
        self._last_step = now

    def voted(self, seconds: float) -> None:
        """A vote took ``seconds`` on this rank."""
        self._votes.append(seconds)

    def due(self, iteration: int) -> bool:
        """Whether every rank votes at ``iteration`` (ballots and re-runs aside)."""
        if self.budget <= 0 or self.next_vote is None or iteration >= self.next_vote or iteration == self.last:
            return True
        return any(iteration % n == 0 for n in self.every)

    def proposal(self) -> int:
        """This rank's slot: CAP minus the iterations it would train until the next vote."""
        return CAP - self.every_k()

    def settle(self, iteration: int, agreed: int) -> None:
        """The job's slot, agreed at ``iteration``: the next vote's iteration."""
        self.next_vote = iteration + max(1, CAP - agreed) if agreed else iteration + 1

    def every_k(self) -> int:
        """This rank's estimate of k, from its recent vote and step times."""
        if self.budget <= 0 or not self._steps or not self._votes:
            return 1
        return votes_every(statistics.median(self._votes), statistics.median(self._steps), self.budget)


def votes_every(vote: float, step: float, budget: float) -> int:
    """The smallest k for which a vote of ``vote`` seconds every k steps of ``step`` seconds
    takes at most ``budget`` of the time (0: no budget, every step)."""
    if budget <= 0:
        return 1
    if step <= 0:
        return MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(vote / (budget * step))))
