"""The numbers check: roll back an iteration whose loss is NaN or spikes, re-run it, judge.

The hook owns one ``NumericsGuard`` and feeds it each rank's ``loss`` and ``grad_norm``
from ``hook.step``. Each rank judges its own numbers against its own window at every
iteration; a bad iteration is held until the ranks' next vote (``cadence.py``: before any
save or snapshot), where six more int64s make every rank see the same job-wide numbers
(``loss_rules``: the MAX of the values' bits) and the earliest bad iteration any rank
holds, so every rank reaches the same verdict with no collective of its own:

* good: the loss joins the spike window;
* bad (NaN/Inf, or a spike): the workers stop without saving (the state is bad) and
  leave ``ROLLBACK_FILE``; their agents restart them from the newest good state (the
  memory tier's snapshot when there is one, else the newest complete checkpoint), and
  the iteration is re-run and judged (``loss_rules.rerun_cause``): good now → a
  ``transient_fault``, go on; the same numbers → ``data_skipped``, roll back again and
  skip that step (``hook.skips``); other bad numbers → the hardware, roll back again.
* a node implicated in ``--eft-suspect-after`` faults is ``node_suspect``; its agent
  raises its GPUs' risk to 1.0 and, with ``--eft-suspect-action exclude``, leaves.

What the job learned (``NumericsState``) survives the restart in each node's run
directory and is agreed once when the workers start. docs/numerics.md is the user's side.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from elasticft.config import NumericsConfig, from_env
from elasticft.contract.events import EventKind
from elasticft.contract.numerics import (
    NUMERICS_FILE,
    ROLLBACK_FILE,
    Cause,
    NumericFault,
    NumericKind,
    NumericsState,
    wire_float,
)
from elasticft.contract.run_dir import OutboxKind, WorkerEnv, write_atomically
from elasticft.worker.cadence import CAP
from elasticft.worker.loss_rules import finite, from_bits, judge, rerun_cause, spike_level, to_bits
from elasticft.worker.relay import Outbox

log = logging.getLogger(__name__)

# This guard's slots in the hook's vote; FIRST holds CAP - the bad iteration (MAX: the earliest).
LOSS, GRAD, BAD_HIGH, BAD_LOW, FIRST, LEVEL = range(6)


class NumericsGuard:
    """See the module's docstring. Made by the hook after it joined the group (a collective)."""

    width = 6

    def __init__(self, run_dir: str, group, outbox: Outbox | None, config: NumericsConfig | None = None):
        self.config = config or from_env(NumericsConfig)
        self._group = group
        self._outbox = outbox  # the group's rank 0 reports the verdicts
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._path = Path(run_dir) / NUMERICS_FILE
        self._keeper = int(os.environ.get("LOCAL_RANK", "0")) == 0  # writes the node's copy
        node = os.environ.get(WorkerEnv.NODE_ID, "") or f"group-rank-{os.environ.get('GROUP_RANK', '0')}"
        self.state, self._nodes = self._agree(node)
        self._held: list[int] | None = None  # the slots of the first bad iteration since the last vote
        self._seen: tuple[int, float | None, bool] | None = None  # the newest iteration: its loss, good here
        self._newest: list[int] = []  # the newest iteration's slots

    # -- start: one state for the whole job ------------------------------------------

    def _agree(self, node: str) -> tuple[NumericsState, list[str]]:
        """The newest state any node kept, and every rank's node (one all_gather)."""
        kept = self._read() if self._keeper else None
        everyone: list = [None] * self._world
        dist.all_gather_object(everyone, (node, kept), group=self._group)
        states = [state for _, state in everyone if state is not None]
        state = max(states, key=lambda s: (s.decisions, s.losses[-1][0] if s.losses else -1), default=NumericsState())
        return state, [n for n, _ in everyone]

    def _read(self) -> NumericsState | None:
        try:
            return NumericsState.from_json(self._path.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s (%s)", self._path, exc)
            return None

    def _keep(self) -> None:
        if self._keeper:
            write_atomically(self._path, self.state.to_json())

    # -- the vote ----------------------------------------------------------------------

    def skips(self, iteration: int) -> bool:
        """True when the step that makes ``iteration`` must not run: its batch is bad."""
        return iteration in self.state.skipped

    def needs_vote(self, iteration: int) -> bool:
        """The re-run of a bad iteration is judged where it happens (the same on every rank)."""
        pending = self.state.pending
        return pending is not None and pending.iteration == iteration

    def mine(self, iteration: int, loss: float | None, grad_norm: float | None) -> list[int]:
        """This rank's slots for a vote: its values' bits, its rank if its own loss is bad
        (the gradient norm is the job's: it names no rank), the iteration and the spike level
        it was judged by; the first bad iteration's while one is held."""
        self._trim(iteration)
        level = self._level(iteration)
        bad = not finite(loss) or (level is not None and loss is not None and loss > level)
        flags = [self._rank + 1, self._world - self._rank] if bad else [0, 0]
        slots = [to_bits(loss), to_bits(grad_norm), *flags, CAP - iteration, to_bits(level)]
        good = not bad and finite(grad_norm)
        if self._held is None and not good:
            self._held = slots
        self._seen = (iteration, loss, good)
        self._newest = slots
        return self._held or slots

    def again(self) -> list[int]:
        """This rank's slots for a vote on its newest iteration after the step went unvoted
        (``Hook.vote_held``): the held bad iteration's, else the newest's, whose good loss
        ``unvoted()`` put in the window already (the verdict does not put it in twice)."""
        self._seen = None
        return self._held or self._newest

    def unvoted(self) -> None:
        """No vote at the newest iteration: a good loss of this rank's joins its window."""
        if self._held is None:
            self._remember_mine()

    def _remember_mine(self) -> None:
        """This rank's own loss of its newest iteration joins its window, if it was good here."""
        iteration, loss, good = self._seen or (0, None, False)
        if good and loss is not None:
            self._remember(iteration, loss)

    def settle(self, iteration: int, agreed: list[int]) -> bool:
        """The job's numbers at the vote of ``iteration``; True when the workers must roll back."""
        self._held = None
        loss, grad_norm = from_bits(agreed[LOSS]), from_bits(agreed[GRAD])
        ranks = self._ranks(agreed)
        # Each rank judged its own loss by its own window: a spike is what some rank flagged.
        kind = judge(loss, grad_norm, None) or (NumericKind.SPIKE if agreed[BAD_HIGH] else None)
        pending = self.state.pending
        if pending is not None and pending.iteration == iteration:
            return self._judge_rerun(pending, kind, loss, grad_norm, ranks)
        if pending is not None and pending.iteration < iteration:  # the loop never showed us its re-run
            self._say("iteration %d was not re-run (resumed past it): its fault stays unexplained", pending.iteration)
            self.state.pending = None
        if kind is None:
            self._remember_mine()
            return False
        first = CAP - agreed[FIRST] if agreed[FIRST] else iteration
        fault = NumericFault(first, kind, loss, grad_norm, ranks, self._nodes_of(ranks), from_bits(agreed[LEVEL]))
        self.state.decisions += 1
        self.state.pending = fault
        return self._roll_back(fault, Cause.UNKNOWN)

    def _ranks(self, agreed: list[int]) -> tuple[int, ...]:
        if not agreed[BAD_HIGH]:
            return ()
        low, high = self._world - agreed[BAD_LOW], agreed[BAD_HIGH] - 1
        return (low,) if low == high else (low, high)

    def _nodes_of(self, ranks: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self._nodes[r] for r in ranks if 0 <= r < len(self._nodes)))

    def _level(self, iteration: int) -> float | None:
        pending = self.state.pending
        if pending is not None and pending.iteration == iteration:
            return pending.level  # the re-run is judged by the rule the first run was
        c = self.config
        losses = [loss for _, loss in self.state.losses[-c.spike_window:]]
        return spike_level(losses, c.spike_mads, c.spike_min_rise, c.spike_min_history)

    def _trim(self, iteration: int) -> None:
        """Forget losses of iterations at or after ``iteration``: a restart went back before them."""
        losses = self.state.losses
        if losses and losses[-1][0] >= iteration:
            self.state.losses = [(i, loss) for i, loss in losses if i < iteration]

    def _remember(self, iteration: int, loss: float) -> None:
        self.state.losses = (self.state.losses + [(iteration, loss)])[-self.config.spike_window:]
        if iteration % self.config.spike_window == 0:  # a crash restart finds the window (a write: ~0.1 ms)
            self._keep()

    # -- verdicts ----------------------------------------------------------------------

    def _judge_rerun(self, first: NumericFault, kind, loss, grad_norm, ranks) -> bool:
        cause = rerun_cause(first, kind, loss, grad_norm, self.config.rerun_tolerance)
        state = self.state
        state.decisions += 1
        if cause is None:
            state.pending = None
            self._implicate(first.nodes)
            self._report(EventKind.TRANSIENT_FAULT, iteration=first.iteration, fault=first.kind.value,
                         ranks=list(first.ranks), nodes=list(first.nodes), attempts=first.attempt,
                         loss=wire_float(first.loss), rerun_loss=wire_float(loss))
            self._say("iteration %d re-run is good: a transient fault (%s, rank(s) %s)", first.iteration,
                      first.kind, list(first.ranks) or "unknown")
            self._remember_mine()
            self._keep()
            return False
        if cause is Cause.DATA:
            state.pending = None
            state.skipped = sorted(set(state.skipped) | {first.iteration})
            self._report(EventKind.DATA_SKIPPED, iteration=first.iteration, fault=first.kind.value,
                         loss=wire_float(loss), grad_norm=wire_float(grad_norm))
            return self._roll_back(first, cause)
        nodes = tuple(dict.fromkeys(first.nodes + self._nodes_of(ranks)))
        self._implicate(nodes)
        state.pending = NumericFault(first.iteration, kind, loss, grad_norm, ranks, nodes, first.level,
                                     first.attempt + 1)
        return self._roll_back(state.pending, cause)

    def _roll_back(self, fault: NumericFault, cause: Cause) -> bool:
        """Stop without saving; the re-run judges ``state.pending`` (None: the data, skipped)."""
        fields = fault.to_dict()
        fields["fault"] = fields.pop("kind")  # an event's "kind" is its own
        self._report(EventKind.ROLLBACK, cause=cause.value, **fields)
        self._say("iteration %d: %s (loss %s, grad norm %s, rank(s) %s): rolling back (%s)", fault.iteration,
                  fault.kind, fault.loss, fault.grad_norm, list(fault.ranks) or "unknown", cause)
        self._keep()
        if self._keeper:
            write_atomically(self._path.with_name(ROLLBACK_FILE), json.dumps({"cause": cause.value, **fault.to_dict()}))
        return True

    def _implicate(self, nodes: tuple[str, ...]) -> None:
        state = self.state
        for node in nodes:
            state.implicated[node] = state.implicated.get(node, 0) + 1
            if state.implicated[node] >= self.config.suspect_after and node not in state.suspects:
                state.suspects.append(node)
                self._report(EventKind.NODE_SUSPECT, node=node, faults=state.implicated[node],
                             action=self.config.suspect_action)
                self._say("node %s implicated in %d numeric faults: suspect", node, state.implicated[node])

    def _say(self, *args) -> None:
        """Log a verdict once for the job (every rank reaches it)."""
        if self._outbox is not None:
            log.warning(*args)

    def _report(self, event: EventKind, **fields) -> None:
        if self._outbox is not None:
            self._outbox.send({"type": OutboxKind.NUMERICS, "event": event.value, **fields})
