"""One line and exit status 2 for a user's mistake, in every ``eft`` sub-command.

click (inside typer) prints usage errors in a box over several lines; a script that runs
``eft`` wants one line it can log, so commands use ``OneLineErrors`` and ``fail``.
"""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(command: str, message: str) -> NoReturn:
    """``eft <command>: <message>`` on stderr, exit status 2."""
    typer.echo(f"eft {command}: {message}", err=True)
    raise typer.Exit(2)


class OneLineErrors(typer.core.TyperCommand):
    """Usage errors (a missing or malformed option, an unknown one) as one line."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except typer.TyperException as err:  # typer's usage errors (it vendors click)
            fail(_command_path(ctx), err.format_message())


def _command_path(ctx: typer.Context) -> str:
    """``kubernetes render`` for a group's command: every name under ``eft`` (the root's
    name is however Python was started)."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(reversed(names))
