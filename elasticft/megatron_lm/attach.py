"""Attach eft to Megatron-LM's loop the moment the worker imports it.

A Megatron-LM script imports ``megatron.training`` at its top and calls ``pretrain``;
eft must be inside that loop without an edit to the script. ``install()`` (run by the
worker's ``sitecustomize``, see ``elasticft/boot/``) puts a finder at the head of ``sys.meta_path``
that lets Python import ``megatron.training.training`` as usual and then attaches
``MegatronLoop`` to it, before the script's next line runs. A process that never imports
it (a helper the save starts, a script with its own loop) pays one finder lookup per
import and nothing else.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

from elasticft import megatron_seam as seam

log = logging.getLogger(__name__)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``name`` so ``then()`` runs after it."""

    def __init__(self, name: str, then):
        self.name = name
        self.then = then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find this finder again
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            then(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Attach to Megatron-LM's loop when this process imports it (idempotent)."""
    if any(isinstance(f, AfterImport) for f in sys.meta_path):
        return
    if seam.TRAINING in sys.modules:  # imported before site ran its course: attach now
        _attach(sys.modules[seam.TRAINING])
        return
    sys.meta_path.insert(0, AfterImport(seam.TRAINING, _attach))


def _attach(_module) -> None:
    from elasticft.megatron_lm.loop import MegatronLoop
    from elasticft.worker.phases import watch_process_group

    MegatronLoop().attach()
    watch_process_group()  # before Megatron's initialize: eft report's imports and process_group phases
    seam.replace("compile_helpers", skip_compile_when_shipped)
    seam.replace("ft_setup", _eft_in_place_of_nvrx)


def _eft_in_place_of_nvrx(_original):
    """``--enable-ft-package`` under eft-run: no NVRx rank monitor is there to connect to, so its
    client stays unset (every ``ft_integration`` call is then a no-op) and eft's own section
    timeouts, fed by the same loop, do its work (ft_launcher's flags set them)."""
    def setup():
        if "--enable-ft-package" in sys.argv:
            print("eft: --enable-ft-package: eft times Megatron's sections in place of NVRx's rank monitor",
                  file=sys.stderr, flush=True)
    return setup


def skip_compile_when_shipped(original):
    """megatron-core's wheel ships the dataset helper compiled but not its Makefile, and rank 0's
    ``make`` then fails and exits the job: run it only when the compiled helper is missing."""
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401 - the import is the check
        except ImportError:
            return original()
        print("eft: megatron-core's dataset helper is already compiled (helpers_cpp); not running make",
              file=sys.stderr, flush=True)
        return None
    return compile_helpers
