"""Whether a job is a Megatron-Bridge script eft goes inside, decided once at launch.

``--eft-megatron-bridge auto`` (the default) turns the mode on for a script that imports
``megatron.bridge.training`` (its file and the modules beside it it imports, read, not run:
``megatron_lm.mode.imports``); ``on`` for a script that reaches Bridge's loop through a package
elsewhere, ``off`` to run it without eft in its loop. The workers then start with eft's boot
directory first on their ``PYTHONPATH`` and ``EFT_TRAINING_LOOP=megatron_bridge``, so that the
boot attaches to Bridge's loop (``attach.py``), not Megatron-LM's.

A Megatron-Bridge eft was not tested with runs when every name eft relies on is there
(``bridge_seam.problems``), with one warning line; a Bridge without them is refused here,
before any worker starts.
"""

from __future__ import annotations

import logging
import os

from elasticft import bridge_seam, versions
from elasticft.config import ConfigError, flag_name
from elasticft.contract.run_dir import TrainingLoop, WorkerEnv
from elasticft.megatron_lm.mode import BOOT_DIR, entry_file, imports

log = logging.getLogger(__name__)

TARGET = "megatron.bridge.training"


def worker_environment(mode: str, script: str, module: bool = False, no_python: bool = False) -> dict[str, str]:
    """The variables that put eft inside the script's Bridge loop ({}: the mode is off for it)."""
    flag = flag_name("megatron_bridge")
    entry = None if no_python or mode == "off" else entry_file(script, module)
    if entry is None or not imports(entry, TARGET):
        if mode == "on":
            what = "a program run with --no-python" if no_python else f"{script} does not import {TARGET}"
            raise ConfigError(f"{flag} on: {what}; eft enters Megatron-Bridge's own loop "
                              f"(megatron.bridge.training.pretrain), use {flag} off for a script with its own")
        return {}
    verdict = versions.judge(versions.MEGATRON_BRIDGE, bridge_seam.installed_version())
    if verdict.support is versions.Support.UNSUPPORTED:
        raise ConfigError(f"{flag}: {verdict.line}; use {flag} off to run {script} without eft in its loop")
    if verdict.support is versions.Support.UNTESTED:
        missing = bridge_seam.problems()
        if missing:
            raise ConfigError(f"{flag}: {verdict.line}, and it lacks what eft relies on: {'; '.join(missing)}")
        log.warning("%s: %s", flag, verdict.line)
    log.info("%s imports %s: eft attaches to Megatron-Bridge's loop (%s off: not)", script, TARGET, flag)
    path = os.pathsep.join(filter(None, [str(BOOT_DIR), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path, WorkerEnv.TRAINING_LOOP: TrainingLoop.MEGATRON_BRIDGE.value}
