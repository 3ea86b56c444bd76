"""The job-wide restart record (``restarts``), as every agent reads and writes it.

torch counts ``--max-restarts`` per agent, so a job of many nodes restarts far more
often than the flag says, and a job that crashes at the same place after every restart
loops until that count runs out (or forever, when a node rejoins quickly). eft keeps one
record per run in etcd that every agent updates with compare-and-swap when its workers
restart, so that each restart *cycle* (the end of one rendezvous round) counts once,
however many agents restart for it. The rule that updates it is
``elasticft.agent.restart_budget``.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

from elasticft.contract.json_object import json_object


class Ending(enum.StrEnum):
    """Why the restart rule ended the job; the value is also the event kind recorded."""

    NO_PROGRESS = "no_progress"  # --eft-max-no-progress-restarts cycles in a row without progress
    BUDGET = "restart_budget_exhausted"  # more charged restarts than --eft-max-job-restarts


@dataclass(frozen=True)
class ProgressMark:
    """How far a restart cycle got: the newest complete checkpoint (disk or memory tier)
    and the highest iteration the workers reached; None: unknown."""

    checkpoint: int | None = None
    reached: int | None = None

    def merged(self, other: "ProgressMark") -> "ProgressMark":
        """The further of the two, field by field (agents each see their own workers)."""
        return ProgressMark(_max(self.checkpoint, other.checkpoint), _max(self.reached, other.reached))


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass(frozen=True)
class RestartRecord:
    """The value of ``restarts``.

    ``round``: the rendezvous round whose end was reported last; ``round_judged`` and
    ``round_charged`` say whether that cycle was already judged by the no-progress rule
    and charged to the budget (several agents report one cycle; the first with a reason
    that counts does it). ``agents`` (``host:pid``) reported this launch's cycles: a
    launch whose agents are all gone is over, and the next one gets a fresh budget.
    """

    round: int = -1
    round_judged: bool = False
    round_charged: bool = False
    charged: int = 0  # cycles charged to --eft-max-job-restarts in this launch
    no_progress: int = 0  # judged cycles in a row without progress (kept across launches)
    mark: ProgressMark | None = None  # the last judged cycle's (kept across launches)
    ended: Ending | None = None
    agents: tuple[str, ...] = field(default=())
    # The limits in force (--eft-max-job-restarts, --eft-max-no-progress-restarts), as this
    # launch's first agent stated them: for viewers (eft top, eft status); None: not stated.
    job_restarts_limit: int | None = None
    no_progress_limit: int | None = None

    def for_new_launch(self) -> "RestartRecord":
        """A fresh budget and no verdict; the no-progress count and mark carry on, so that a
        job requeued again and again without progress still stops."""
        return RestartRecord(no_progress=self.no_progress, mark=self.mark)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "RestartRecord":
        """Raises ValueError, TypeError or KeyError on a malformed record."""
        data = json_object(raw)
        mark = data.get("mark")
        ended = data.get("ended")
        return cls(
            round=int(data.get("round", -1)),
            round_judged=bool(data.get("round_judged")),
            round_charged=bool(data.get("round_charged")),
            charged=int(data.get("charged", 0)),
            no_progress=int(data.get("no_progress", 0)),
            mark=None if mark is None else ProgressMark(mark.get("checkpoint"), mark.get("reached")),
            ended=None if ended is None else Ending(ended),
            agents=tuple(str(a) for a in data.get("agents") or ()),
            job_restarts_limit=_int_or_none(data.get("job_restarts_limit")),
            no_progress_limit=_int_or_none(data.get("no_progress_limit")),
        )


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)
