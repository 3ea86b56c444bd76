"""eft-run's entry point: the versions it runs with, judged before torch is imported.

A container's torch that eft does not support must cost one line and exit status 2, not an
import traceback from deep inside torch or eft's torch seam; a torch newer than the newest
tested runs, with one line that says so. The seams check what eft relies on when they are
imported, and a name that moved is refused here by name (``versions.SeamError``), in one line.
``eft-run --version`` prints where each part stands, and works with a broken torch.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from elasticft import versions
from elasticft.contract.exit_codes import ExitCode
from elasticft.versions import Support
from launcher.version_report import version_lines


def refuse(prog: str, line: str) -> NoReturn:
    print(f"{prog}: error: {line}", file=sys.stderr)
    sys.exit(int(ExitCode.USAGE))


def check_versions(prog: str) -> None:
    """Exit 2 with one line for an unsupported Python or torch; one warning for an untested torch."""
    problem = versions.python_problem()
    if problem:
        refuse(prog, problem)
    torch = versions.judge(versions.TORCH, versions.installed(versions.TORCH))
    if torch.support is Support.UNSUPPORTED:
        refuse(prog, torch.line)
    if torch.support is Support.UNTESTED:
        print(f"{prog}: warning: {torch.line}", file=sys.stderr)


def eft_run(argv: list[str] | None = None) -> None:
    """The ``eft-run`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # before torch: it must answer where torch is broken
        print("\n".join(version_lines()))
        return
    check_versions("eft-run")
    try:
        from launcher import eft_run as launch
    except versions.SeamError as exc:
        refuse("eft-run", str(exc))
    launch.main(argv)


if __name__ == "__main__":
    eft_run()
