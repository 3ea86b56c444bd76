"""The training script (or ``-m`` module, or ``--no-python`` command) exists: checked before
anything starts.

torchrun finds out that ``train.py`` is misspelled only when every worker has started and
failed with Python's "can't open file", after the rendezvous and an etcd of its own, and
then ends in a traceback of the launcher's frames. The workers start in the launcher's
directory, with its environment and its interpreter, so the launcher can look where they
will look and say it in one line. Only a definite "not there" refuses: a lookup that cannot
decide (an unusual import hook, an unreadable directory) lets the job start as torchrun would.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys


def missing_entry(args) -> str | None:
    """One line naming what the workers could not start, or None when it is there."""
    target = args.training_script
    if args.no_python:
        return None if _finds_command(target) else f"{target}: no such command (--no-python runs it as it is)"
    if args.module:
        return None if _finds_module(target) is not False else (
            f"-m {target}: no module of that name on this Python's path ({sys.executable}, "
            f"searched from {os.getcwd()} first, as 'python -m' does)")
    if os.path.isfile(target):
        return None
    why = "is a directory, not a script" if os.path.isdir(target) else "no such file"
    return f"training script {target}: {why} (looked in {os.getcwd()})"


def _finds_command(command: str) -> bool:
    if os.sep in command:
        return os.path.isfile(command) and os.access(command, os.X_OK)
    return shutil.which(command) is not None


def _finds_module(name: str) -> bool | None:
    """Whether ``python -m name`` finds it, without importing any of it (a package's
    ``__init__`` may be heavy or have effects): True, False, or None when it cannot tell."""
    top, _, rest = name.partition(".")
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())  # 'python -m' puts the working directory first
    try:
        spec = importlib.util.find_spec(top)  # a top-level name imports nothing
        for part in rest.split(".") if rest else []:
            if spec is None or spec.submodule_search_locations is None:
                return False
            spec = importlib.machinery.PathFinder.find_spec(f"{spec.name}.{part}", list(spec.submodule_search_locations))
        return spec is not None
    except (ImportError, ValueError, OSError):
        return None
    finally:
        sys.path[:] = saved
