"""What the job has learned about its numbers, kept across worker restarts.

The workers judge each iteration's loss and gradient norm (``elasticft.worker.numerics``)
and all reach the same verdicts, so they all hold the same ``NumericsState``. Local rank
0 of every node keeps it in the node's run directory (``NUMERICS_FILE``): the next
generation of workers reads it back (the re-run of a suspect iteration needs what the
first run saw), and the agent reads it to learn that its node is suspect. Workers that
stop for a rollback leave ``ROLLBACK_FILE`` beside it: their agent restarts them instead
of taking their clean exit for the end of training.

Iterations are the hook's: ``iteration`` N is the state after N training steps, and the
loss of N is the loss of the step that made it (the step that trained on batch N - 1
in the GPT example, whose batches are numbered from 0).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field

NUMERICS_FILE = "numerics.json"
ROLLBACK_FILE = "rollback.json"


class NumericKind(enum.StrEnum):
    """What was wrong with an iteration's numbers."""

    NAN = "nan"  # the loss or the gradient norm is NaN or infinite on some rank
    SPIKE = "spike"  # the loss is far above its recent robust level


class Cause(enum.StrEnum):
    """What the re-run of a bad iteration says caused it (the ``rollback`` event's ``cause``)."""

    UNKNOWN = "unknown"  # first sight: re-run to find out
    DATA = "data"  # the re-run gave the same numbers: skip the batch, roll back again
    HARDWARE = "hardware"  # the re-run was bad again, with other numbers: roll back again


def wire_float(x: float | None) -> float | str | None:
    """JSON has no NaN: non-finite values travel as their repr ("nan", "inf")."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))


def _float(x) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class NumericFault:
    """A bad iteration as every rank saw it: the job-wide numbers and who showed them.

    ``loss`` is the largest loss any rank passed (NaN if any was NaN), ``grad_norm`` the
    largest gradient norm; ``ranks`` the lowest and highest rank whose own values were
    not finite (empty: none, or a spike, which no single rank shows); ``nodes`` their
    nodes. ``level`` is the spike threshold in force when it was seen, so the re-run is
    judged by the same rule. ``attempt`` counts the runs of this iteration that were bad.
    """

    iteration: int
    kind: NumericKind
    loss: float | None
    grad_norm: float | None
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    level: float | None = None
    attempt: int = 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(kind=self.kind.value, loss=wire_float(self.loss), grad_norm=wire_float(self.grad_norm),
                   ranks=list(self.ranks), nodes=list(self.nodes))
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "NumericFault":
        return cls(int(raw["iteration"]), NumericKind(raw["kind"]), _float(raw.get("loss")),
                   _float(raw.get("grad_norm")), tuple(int(r) for r in raw.get("ranks", ())),
                   tuple(str(n) for n in raw.get("nodes", ())), _float(raw.get("level")), int(raw.get("attempt", 1)))


@dataclass
class NumericsState:
    """The job's memory of its numbers (the module's docstring says who keeps it).

    ``decisions`` counts the verdicts that changed it, so that of two nodes' copies the
    newer wins; ``pending`` is the bad iteration the next run must re-run and judge;
    ``skipped`` the iterations whose step must not run (their batch is bad);
    ``implicated`` how many faults each node was implicated in; ``suspects`` the nodes
    implicated often enough to be suspect; ``losses`` recent good (iteration, loss)
    pairs, the spike rule's window.
    """

    decisions: int = 0
    pending: NumericFault | None = None
    skipped: list[int] = field(default_factory=list)
    implicated: dict[str, int] = field(default_factory=dict)
    suspects: list[str] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({
            "decisions": self.decisions,
            "pending": self.pending.to_dict() if self.pending else None,
            "skipped": self.skipped,
            "implicated": self.implicated,
            "suspects": self.suspects,
            "losses": [[i, loss] for i, loss in self.losses],
        })

    @classmethod
    def from_json(cls, text: str) -> "NumericsState":
        """A state from its JSON; ValueError (or KeyError, TypeError) if it is not one."""
        raw = json.loads(text)
        return cls(
            decisions=int(raw["decisions"]),
            pending=NumericFault.from_dict(raw["pending"]) if raw.get("pending") else None,
            skipped=[int(i) for i in raw.get("skipped", [])],
            implicated={str(k): int(v) for k, v in raw.get("implicated", {}).items()},
            suspects=[str(n) for n in raw.get("suspects", [])],
            losses=[(int(i), float(loss)) for i, loss in raw.get("losses", [])],
        )
