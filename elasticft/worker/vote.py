"""The hook's vote: what each rank puts in it, how the agreed values are cut into their
parts (``Layout``), and what the job decided (``Action``). A vote is one MAX over the
vote's group (``tree_max.py``: a tree of point-to-point messages), held at the iterations
the cadence, a ballot or the numbers check asks for (``Hook._votes_at``).

Requests are identified in the vote by a 63-bit hash of their id, so that a rank that
sees a request only after the job already saved (or dropped) it does not act on it again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from elasticft.contract.argv import flag_value
from elasticft.contract.records import RequestReason

# Why a save happens, as the ranks vote on it: a request's reason (RequestReason) or a
# cause the workers see themselves (a switch file, a signal, the exit duration). The index
# is the code in the vote, and the MAX keeps the later in this order: weakest first, the
# reasons that always end the job last. "request" stands for a request reason this
# version does not know.
SAVE_REASONS = ("request", RequestReason.RISK.value, RequestReason.WATCHDOG.value, RequestReason.MANUAL.value,
                "save_switch", RequestReason.SIGNAL.value, "exit_duration", "deadline",
                "kill_switch")
CODE = {reason: code for code, reason in enumerate(SAVE_REASONS)}
SAVE, EXIT, REASON, HONOURED, FILTERED = range(5)  # the decision's slots, first in every vote
DECISION_WIDTH = FILTERED + 1


class Layout:
    """Where each part of a vote lies: the decision's slots, then each part's ``width`` values in
    the order added. Every rank builds the same layout (the same parts, the same widths), so the
    agreed values cut the same way everywhere; a part reads only its own slice."""

    def __init__(self):
        self._parts: list[tuple[object, int]] = []
        self.width = DECISION_WIDTH

    def add(self, part: object, width: int) -> None:
        self._parts.append((part, width))
        self.width += width

    def join(self, decision: list[int], values: dict[object, list[int]]) -> list[int]:
        """This rank's vote: the decision's slots, then each part's values (``values[part]``)."""
        joined = list(decision)
        for part, width in self._parts:
            mine = values[part]
            if len(mine) != width:
                raise ValueError(f"{part!r} voted {len(mine)} values, its width is {width}")
            joined += mine
        return joined

    def cut(self, agreed: list[int]) -> dict[object, list[int]]:
        """Each part's slice of the agreed values."""
        cut, at = {}, DECISION_WIDTH
        for part, width in self._parts:
            cut[part] = agreed[at:at + width]
            at += width
        return cut


@dataclass(frozen=True)
class Action:
    """What the loop must do at this iteration; the same ``save`` and ``exit`` on every rank.

    ``reason`` names the strongest reason any rank had; ``request_id`` is the id of the
    request that caused the save on the ranks that read it (rank 0 also when its agent
    has relayed it by the time of the vote), else None, as for saves no request asked for.

    ``rollback``: this iteration's numbers are bad (``numerics.py``): stop now *without*
    saving (``exit`` is set, ``save`` is not), finish the saves already in flight (they
    hold older, good states) and leave the process with exit code 0; the agent restarts
    the workers from the newest good state to re-run the iteration.
    """

    save: bool = False
    exit: bool = False
    reason: str | None = None
    request_id: str | None = None
    rollback: bool = False


NO_ACTION = Action()
ROLLBACK = Action(exit=True, reason="rollback", rollback=True)


class Ballot(Protocol):
    """Something else the ranks must agree on at votes (``Hook.add_ballot``)."""

    width: int  # how many int64s it adds to the vote

    def needs_vote(self, iteration: int) -> bool:
        """Whether the ranks must vote at ``iteration`` for this ballot: the same answer on
        every rank (from what earlier votes settled and the iteration alone)."""

    def mine(self, iteration: int) -> list[int]:
        """This rank's ``width`` values (non-negative; the job's is their MAX)."""

    def settle(self, agreed: list[int]) -> None:
        """The job's values, the same on every rank."""


def int_flag(argv: Sequence[str], flag: str) -> int | None:
    """The integer value of ``flag`` (Megatron's ``--save-interval``, say) in ``argv``, or None."""
    raw = flag_value(argv, flag)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None  # the training script's own parser reports it


def save_interval_from_argv(argv: Sequence[str]) -> int | None:
    """The value of Megatron's ``--save-interval`` in ``argv``, or None."""
    return int_flag(argv, "--save-interval")


def request_hash(request_id: str) -> int:
    """A positive int64 that names a request in the vote (0 means "none")."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def vote_device(group) -> torch.device:
    """Where the vote's tensor must live for the group's backend.

    A CPU tensor when the group has gloo (also "cpu:gloo,cuda:nccl"): no GPU sync.
    """
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    return accelerator if accelerator is not None else torch.device("cpu")
