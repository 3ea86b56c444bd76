"""The per-iteration hook: every rank learns, at the same iteration, whether to save and exit.

A distributed checkpoint is only valid if every rank saves the same iteration, but the
reasons to save arrive at one rank at a time: the agent of one node relays a request a
few milliseconds before another's, a preemption signal reaches one process, only rank 0
watches the switch files. So each rank turns what it saw into a few integers and a vote
(their MAX over the ranks, ``tree_max.py``) makes them the job's decision. The ranks vote
only at iterations every one of them can name (``cadence.py``: every iteration while votes
take under 1 % of training time, and where saves and ballots need them); what a rank sees
in between is held until then.

The vote itself (slots, ``Action``, request hashes) is ``vote.py``; the numbers check
that rides in it is ``numerics.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from elasticft.config import CheckpointConfig, NumericsConfig, from_env
from elasticft.contract.records import CheckpointRequest
from elasticft.contract.run_dir import OutboxKind, WorkerEnv
from elasticft.worker.cadence import VoteCadence
from elasticft.worker.gap import gap_filter
from elasticft.worker.numerics import NumericsGuard
from elasticft.worker.progress import ProgressWriter, process_started_at
from elasticft.worker.relay import Outbox, RequestFile
from elasticft.worker.signals import ExitSignals, exit_deadline, register_stack_dump, time_limit
from elasticft.worker.tree_max import group_max
from elasticft.worker.vote_group import hook_group
from elasticft.worker.vote import (  # noqa: F401 - Action and friends are the hook's API too
    CODE, DECISION_WIDTH, EXIT, FILTERED, HONOURED, NO_ACTION, REASON, ROLLBACK, SAVE, SAVE_REASONS, Action,
    Ballot, Layout, int_flag, request_hash, save_interval_from_argv, vote_device,
)

log = logging.getLogger(__name__)

class Hook:
    """Call ``step(iteration)`` on every rank every iteration, ``saved(...)`` after each save.

    It also keeps the rank's progress heartbeat for its agent (``progress.py``): the
    ``setup`` section runs from the process's start to the first ``step()``; wrap the rank's own work in
    ``compute()`` for straggler detection, other long phases in ``section(name)``, and
    call ``close()`` when training is over.

    ``save_interval``, ``exit_interval``, ``train_iters`` and ``non_persistent_save_interval`` are
    the loop's own (the ranks vote where it saves or stops on its own); the first three, unset (None),
    are read from Megatron-LM's flags in ``sys.argv`` (0: none). ``vote_held()`` before any other save.

    Inert (no action ever, no signal handlers, no heartbeat) when ``EFT_RUN_DIR`` is
    unset, which is how it runs under plain torchrun. Raises ``SystemExit(0)`` if the
    kill switch exists when it is created.
    """

    def __init__(
        self,
        save_interval: int | None = None,
        last_saved_iteration: int | None = None,
        group=None,
        exit_interval: int | None = None,
        train_iters: int | None = None,
        non_persistent_save_interval: int | None = None,
    ):
        self.save_interval = save_interval if save_interval is not None else save_interval_from_argv(sys.argv)
        self.last_saved_iteration = last_saved_iteration
        self.run_dir = os.environ.get(WorkerEnv.RUN_DIR, "")
        self._latest = NO_ACTION
        self.votes = 0  # the votes this rank took part in (cadence.py)
        self.numerics: NumericsGuard | None = None  # the numbers check (off when inert or --eft-numerics-check false)
        if self.inert:
            return
        self.config = from_env(CheckpointConfig)
        if self.config.kill_switch_present():
            log.warning("kill switch %s exists: exiting before training starts", self.config.kill_switch)
            raise SystemExit(0)
        self._group = hook_group(group)  # a collective where it makes the vote's own group
        self._device = vote_device(self._group)
        self._leader = dist.get_rank(self._group) == 0
        self._requests = RequestFile(self.run_dir)
        self._outbox = Outbox(self.run_dir) if self._leader else None
        self._signals = ExitSignals(self.config.signals())
        self._deadline = exit_deadline(self.config)
        self._slurm_deadline = time_limit()
        self._seen: set[int] = set()  # requests this rank has read
        self._covered: set[int] = set()  # requests a save of the job covered
        self._filtered: dict[int, tuple[int, int | None]] = {}  # dropped: (iteration, last saved)
        self._remove_save_switch = False
        self._auto_checkpointing = False
        self._held: CheckpointRequest | None = None  # read since the last vote, not yet voted on
        # The loop's own exits and last iteration (votes are held there): given, else Megatron-LM's flags.
        exit_interval = exit_interval if exit_interval is not None else int_flag(sys.argv, "--exit-interval")
        train_iters = train_iters if train_iters is not None else int_flag(sys.argv, "--train-iters")
        self._cadence = VoteCadence(self.config.vote_budget,
                                    (self.save_interval, exit_interval, non_persistent_save_interval), train_iters)
        self._unvoted: int | None = None  # the newest step, when the ranks did not vote at it
        self._ballots: list[Ballot] = []  # others that vote in the same exchange (the memory tier)
        self._vote_layout: Layout | None = None  # where each part lies in a vote (_layout)
        numerics = from_env(NumericsConfig)
        # A collective: every rank makes its Hook.
        self.numerics = (NumericsGuard(self.run_dir, self._group, self._outbox, numerics)
                         if numerics.numerics_check else None)
        self.progress = ProgressWriter(self.run_dir, dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")),
                                       dump_signal=register_stack_dump(),
                                       started=process_started_at())

    def stalled(self, tier: str, seconds: float) -> None:
        """Training waited ``seconds`` inside a step for a save of ``tier`` ("disk", "memory")
        made off the training path: counted apart from the step's work (``eft report``)."""
        if not self.inert:
            self.progress.add_stall(tier, seconds)

    @property
    def inert(self) -> bool:
        return not self.run_dir

    # -- every iteration -------------------------------------------------------------

    def skips(self, iteration: int) -> bool:
        """True when the training step that makes ``iteration`` must not run: the job found
        its batch bad (``data_skipped``). Consume the batch (or skip it by index) and call
        ``step(iteration)`` as usual, with no loss."""
        return self.numerics is not None and self.numerics.skips(iteration)

    def step(self, iteration: int, loss: float | None = None, grad_norm: float | None = None,
             vote: bool = False) -> Action:
        """This iteration's decision, agreed by all ranks (call it on every rank, every iteration).

        ``iteration`` counts the steps done; ``loss`` is this rank's loss of the step that
        made it (None on ranks that have none, e.g. not the last pipeline stage), and
        ``grad_norm`` the step's gradient norm if known: with them, NaN and spikes roll back.
        ``vote``: every rank passes True here (the loop knows all must agree now), and the
        ranks vote whatever the cadence (``cadence.py``).
        """
        if self.inert:
            return NO_ACTION
        self.progress.step(iteration)
        self._cadence.tick()
        numbers = self.numerics.mine(iteration, loss, grad_norm) if self.numerics is not None else []
        self._held = self._new_request() or self._held
        if not (vote or self._votes_at(iteration)):
            if self.numerics is not None:
                self.numerics.unvoted()
            self._latest, self._unvoted = NO_ACTION, iteration
            return NO_ACTION  # what this rank saw waits for the next vote
        return self._ballot(iteration, numbers)

    def vote_held(self) -> Action | None:
        """Where the loop saves on its own at an iteration the ranks did not vote at (its end, a
        signal, its exit duration): they vote now on what they hold since the last vote, so that a
        bad-numbers verdict rolls back (``Action.rollback``: no save) instead of being saved. Every
        rank calls it at the same point; None when the ranks voted at their newest step."""
        if self.inert or self._unvoted is None:
            return None
        return self._ballot(self._unvoted, self.numerics.again() if self.numerics is not None else [])

    def _ballot(self, iteration: int, numbers: list[int]) -> Action:
        """The vote at ``iteration``, with this rank's numbers check slots ``numbers``."""
        self._unvoted = None
        slots = [0] * DECISION_WIDTH  # this rank's decision slots (vote.py); the parts follow them
        request, self._held = self._held, None
        if request is not None:
            self._want_request(slots, request, iteration)
        if self._leader:
            self._want_switches(slots)
        if self._signals.received is not None:
            self._want(slots, "signal", exit=True)
        if self._deadline is not None and time.time() >= self._deadline:
            self._want(slots, "exit_duration", exit=True)
        if self._slurm_deadline is not None and time.time() >= self._slurm_deadline:
            self._want(slots, "deadline", exit=True)
        layout, values = self._layout(), {self._cadence: [self._cadence.proposal()], self.numerics: numbers}
        values.update((ballot, ballot.mine(iteration)) for ballot in self._ballots)
        self.votes += 1
        started = time.perf_counter()
        agreed = self._vote(layout.join(slots, values))
        parts = layout.cut(agreed)
        self._cadence.voted(time.perf_counter() - started)
        self._cadence.settle(iteration, parts[self._cadence][0])
        for ballot in self._ballots:  # every part learns what this vote agreed, a rollback's too
            ballot.settle(parts[ballot])
        if self.numerics is not None and self.numerics.settle(iteration, parts[self.numerics]):
            self._latest = ROLLBACK  # the state is bad: no save of any kind now
            return ROLLBACK
        self._latest = self._settle(iteration, request, slots, agreed[:DECISION_WIDTH])
        if self._latest.exit:
            self.progress.stopping(self._latest.reason)  # tells the agent why the workers will exit
        if self._latest.save and not self._auto_checkpointing:
            # The save the loop is about to make is timed as checkpointing; saved() ends it.
            self._auto_checkpointing = True
            self.progress.enter("checkpointing")
        return self._latest

    def _layout(self) -> Layout:
        """The vote's parts after the decision: the cadence, the numbers check, the ballots (made
        once, and again only after ``add_ballot``: not at every vote)."""
        if self._vote_layout is None:
            self._vote_layout = Layout()
            self._vote_layout.add(self._cadence, 1)
            self._vote_layout.add(self.numerics, self.numerics.width if self.numerics is not None else 0)
            for ballot in self._ballots:
                self._vote_layout.add(ballot, ballot.width)
        return self._vote_layout

    def _votes_at(self, iteration: int) -> bool:
        """The same answer on every rank: the cadence's, a ballot's or the numbers check's."""
        return (self._cadence.due(iteration) or any(b.needs_vote(iteration) for b in self._ballots)
                or (self.numerics is not None and self.numerics.needs_vote(iteration)))

    @property
    def group(self):
        """The process group whose ranks agree (None: WORLD; ``vote_group.hook_group`` says which)."""
        return self._group

    def agree(self, values: list[int]) -> list[int]:
        """The MAX of ``values`` over the group's ranks (a collective: every rank calls it)."""
        return self._vote(values)

    def add_ballot(self, ballot: Ballot) -> None:
        """Let ``ballot`` vote in this hook's votes: one exchange for all, where any needs it."""
        if not self.inert:
            self._ballots.append(ballot)
            self._vote_layout = None

    # -- sections and work time --------------------------------------------------------

    @contextlib.contextmanager
    def section(self, name: str):
        """Time the block as section ``name`` (setup, step, checkpointing or other).

        Each section has its own timeout in the agent (``--eft-timeouts``); wrap a
        save in ``section("checkpointing")`` and an evaluation in ``section("other")``
        so that neither is held to the step timeout.
        """
        if self.inert:
            yield
            return
        self.progress.enter(name)
        try:
            yield
        finally:
            self.progress.leave()

    @contextlib.contextmanager
    def compute(self):
        """Count the block as this rank's own work in the step (straggler detection).

        Wrap work that waits for no other rank (forward and backward without the
        gradient all-reduce): a slow rank's peers wait for it in collectives, so their
        wall step times all look as slow as the straggler's. On a GPU the block ends
        with a device synchronisation so that the time is the GPU's.
        """
        if self.inert:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.progress.add_work(time.perf_counter() - started)

    def worked(self, seconds: float) -> None:
        """Count ``seconds`` of this rank's own work in the step, timed by the caller (as
        ``compute()`` would, for loops that time their work some other way)."""
        if not self.inert:
            self.progress.add_work(seconds)

    def close(self) -> None:
        """Training is over: from now on the rank is in the ``other`` section."""
        if not self.inert:
            self.progress.close()

    def _new_request(self) -> CheckpointRequest | None:
        """A request this rank reads for the first time and the job has not yet dealt with."""
        request = self._requests.poll()
        if request is None:
            return None
        key = request_hash(request.id)
        if key in self._seen:
            return None  # the agent rewrote the same request
        self._seen.add(key)
        if key in self._filtered and self._leader:
            self._report_filtered(request, *self._filtered[key])
        if key in self._covered or key in self._filtered:
            return None
        return request

    def _want_request(self, vote: list[int], request: CheckpointRequest, iteration: int) -> None:
        why = gap_filter(request.reason, iteration, self.last_saved_iteration, self.save_interval,
                         self.config.ckpt_gap, request.exit)
        if why is None:
            self._want(vote, request.reason, exit=request.exit)
        vote[HONOURED if why is None else FILTERED] = request_hash(request.id)

    def _want_switches(self, vote: list[int]) -> None:
        if self.config.kill_switch_present():
            self._want(vote, "kill_switch", exit=True)
        # Checked even beside the kill switch: a save switch left behind would make the
        # next run save at its first step.
        if self.config.save_switch and os.path.exists(self.config.save_switch):
            self._want(vote, "save_switch", exit=False)
            self._remove_save_switch = True

    @staticmethod
    def _want(vote: list[int], reason: str, exit: bool) -> None:
        vote[SAVE] = 1
        vote[EXIT] = max(vote[EXIT], int(exit))
        vote[REASON] = max(vote[REASON], CODE.get(reason, CODE["request"]))

    def _vote(self, vote: list[int]) -> list[int]:
        return group_max(vote, self._group, self._device)

    def _settle(self, iteration: int, request: CheckpointRequest | None, mine: list[int], agreed: list[int]) -> Action:
        """Record what the job decided about each request in the vote; the Action."""
        if not agreed[SAVE] and not agreed[FILTERED]:
            return NO_ACTION  # the common case: nothing anywhere
        my_request = mine[HONOURED] or mine[FILTERED]
        if agreed[SAVE]:
            # A save covers every request in the vote, also one a rank would have dropped.
            self._covered.update(k for k in (agreed[HONOURED], agreed[FILTERED], my_request) if k)
        else:
            for key in {agreed[FILTERED], my_request} - {0}:
                self._filtered[key] = (iteration, self.last_saved_iteration)
            if request is not None and self._leader:
                self._report_filtered(request, iteration, self.last_saved_iteration)
            return NO_ACTION
        request_id = request.id if request is not None and mine[HONOURED] else None
        if request_id is None and agreed[HONOURED] and self._leader:
            request_id = self._relayed_id(agreed[HONOURED])
        action = Action(
            save=True,
            exit=bool(agreed[EXIT]),
            reason=SAVE_REASONS[agreed[REASON]] if agreed[REASON] < len(SAVE_REASONS) else "request",
            request_id=request_id,
        )
        if self._leader:
            log.warning("iteration %d: %s (%s)", iteration, "save and exit" if action.exit else "save",
                        action.reason + (f", request {action.request_id}" if action.request_id else ""))
        return action

    def _relayed_id(self, key: int) -> str | None:
        """The id of the request another rank saved for, if rank 0's agent has relayed it
        since this step's poll; it makes the ack name its request (one read, per save)."""
        current = self._requests.read()
        return current.id if current is not None and request_hash(current.id) == key else None

    def _report_filtered(self, request: CheckpointRequest, iteration: int, last_saved: int | None) -> None:
        why = gap_filter(request.reason, iteration, last_saved, self.save_interval, self.config.ckpt_gap)
        log.info("request %s (%s) dropped by the gap rule: %s", request.id, request.reason, why)
        self._outbox.send({
            "type": OutboxKind.FILTERED,
            "request_id": request.id,
            "iteration": iteration,
            "last_saved_iteration": last_saved,
            "why": why,
        })

    # -- after a save ----------------------------------------------------------------

    def saved(self, iteration: int, path: str | os.PathLike, seconds: float) -> None:
        """Call on every rank once the checkpoint of ``iteration`` is complete on storage.

        Rank 0 tells its agent (the ack) and removes the save switch if it caused the save.
        """
        if self.inert:
            return
        self.last_saved_iteration = iteration
        if self._auto_checkpointing:
            self._auto_checkpointing = False
            self.progress.leave()
        if not self._leader:
            return
        self._outbox.send({
            "type": OutboxKind.ACK,
            "request_id": self._latest.request_id,
            "iteration": iteration,
            "path": os.fspath(path),
            "seconds": float(seconds),
            "exit": self._latest.exit,
        })
        if self._remove_save_switch:
            self._remove_save_switch = False
            try:
                os.unlink(self.config.save_switch)
            except FileNotFoundError:
                pass
