"""Whether a job is a Megatron-LM script eft goes inside, decided once at launch.

``--eft-megatron-lm auto`` (the default) turns the mode on for a script that imports
``megatron.training``: the script's own file and the modules beside it that it imports
are read (parsed, not run) for such an import. A script that reaches Megatron's loop
through a package elsewhere needs ``on``; a script with its own loop that happens to
import ``megatron.training`` for a helper can say ``off``. The workers then start with
``elasticft/boot/`` first on their ``PYTHONPATH`` (the only change to their environment).

Mistakes are stopped here, before any worker starts, in one line: ``on`` for a script
that does not import ``megatron.training``, a megatron-core eft was not tested with,
and ``--enable-ft-package`` where eft is not in the loop to take the place of NVRx's rank
monitor (which needs NVRx's own launcher; inside the loop eft does, ``attach.py``).
"""

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path

from elasticft import megatron_seam as seam
from elasticft.config import ConfigError, flag_name
from elasticft.versions import Support

log = logging.getLogger(__name__)

# eft's boot directory (elasticft/boot/): first on a Megatron-LM or Bridge worker's PYTHONPATH
BOOT_DIR = Path(__file__).parent.parent / "boot"
TARGET = "megatron.training"
MAX_DEPTH = 3  # local modules followed from the script: enough for pretrain_gpt.py's model_provider.py


def worker_environment(mode: str, script: str, script_args: list[str], module: bool = False,
                       no_python: bool = False) -> dict[str, str]:
    """The variables that put eft inside the script's loop ({}: the mode is off for it)."""
    flag = flag_name("megatron_lm")
    entry = None if no_python or mode == "off" else entry_file(script, module)
    if entry is None or not imports_megatron_training(entry):
        if "--enable-ft-package" in script_args:
            raise ConfigError(f"--enable-ft-package: NVRx's rank monitor needs NVRx's ft_launcher, and eft is not "
                              f"in this script's loop to take its place ({flag} {mode}): drop --enable-ft-package")
        if mode == "on":
            what = "a program run with --no-python" if no_python else f"{script} does not import {TARGET}"
            raise ConfigError(f"{flag} on: {what}; eft enters Megatron-LM's own loop "
                              f"(megatron.training.pretrain), use {flag} off for a script with its own")
        return {}
    status, why = seam.version_status(seam.installed_version())
    if status is Support.UNSUPPORTED:
        raise ConfigError(f"{flag}: {why}; use {flag} off to run {script} without eft in its loop")
    if status is Support.UNTESTED:  # runs: every call site eft relies on is there (megatron_seam.problems)
        log.warning("%s: %s: running it untested", flag, why)
    log.info("%s imports %s: eft attaches to Megatron-LM's loop (%s off: not)", script, TARGET, flag)
    path = os.pathsep.join(filter(None, [str(BOOT_DIR), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path}


def entry_file(script: str, module: bool) -> Path | None:
    if not module:
        path = Path(script)
        return path if path.is_file() else None
    import importlib.util

    try:
        spec = importlib.util.find_spec(script)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def imports_megatron_training(entry: Path) -> bool:
    """Whether ``entry``, or a module beside it that it imports (MAX_DEPTH deep), imports
    ``megatron.training``. Read with ``ast``: nothing is executed."""
    return imports(entry, TARGET)


def imports(entry: Path, target: str) -> bool:
    """Whether ``entry``, or a module beside it that it imports (MAX_DEPTH deep), imports
    ``target`` or a module under it. Read with ``ast``: nothing is executed."""
    seen: set[Path] = set()
    todo = [(entry.resolve(), 0)]
    while todo:
        path, depth = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for name in _imported(tree):
            if name == target or name.startswith(target + "."):
                return True
            local = _beside(path.parent, name)
            if local is not None and depth < MAX_DEPTH:
                todo.append((local, depth + 1))
    return False


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # from megatron import training
    return names


def _beside(directory: Path, name: str) -> Path | None:
    """The file of module ``name`` if it lives in ``directory`` (the script's own modules)."""
    parts = name.split(".")
    for candidate in (directory.joinpath(*parts).with_suffix(".py"), directory.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate.resolve()
    return None
