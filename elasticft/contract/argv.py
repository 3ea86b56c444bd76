"""The worker's command line, as both sides read it: Megatron's flags by name.

The agent reads ``--save``/``--load`` (where learned timeouts are kept) and the
planner's model flags; the worker hook reads ``--save-interval``. One reader, so
both sides agree on argparse's spellings (``--name V``, ``--name=V``, the last wins).
"""

from __future__ import annotations

from typing import Sequence


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name V`` or ``--name=V``; the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        if flag == name:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value
