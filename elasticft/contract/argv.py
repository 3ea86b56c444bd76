"""Command lines as both sides read them.

The worker's: Megatron's flags by name. The agent reads ``--save``/``--load`` (where learned
timeouts are kept) and the planner's model flags; the worker hook reads ``--save-interval``.
One reader, so both sides agree on argparse's spellings (``--name V``, ``--name=V``, the last wins).

eft-run's: which of torchrun's flags the user chose. What eft-run derives from its host (SLURM,
a JobSet pod) fills only the flags left at torchrun's defaults, by one rule.
"""

from __future__ import annotations

from typing import Mapping, Sequence

# torchrun's own defaults: a value equal to one of these was not chosen by the user.
TORCHRUN_DEFAULTS = {"rdzv_id": "none", "nnodes": "1:1", "node_rank": 0, "rdzv_backend": "static",
                     "rdzv_endpoint": "", "local_addr": None}


def user_set(args, name: str, environ: Mapping[str, str]) -> bool:
    """Whether the user chose ``--<name>`` (a flag or a ``PET_*`` variable)."""
    return f"PET_{name.upper()}" in environ or getattr(args, name) != TORCHRUN_DEFAULTS[name]


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name V`` or ``--name=V``; the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        if flag == name:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value
