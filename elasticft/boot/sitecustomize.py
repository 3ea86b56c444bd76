"""Run by Python's ``site`` at the start of every worker of a Megatron-LM or Megatron-Bridge job under eft-run.

eft-run puts this directory first on the workers' ``PYTHONPATH`` (``megatron_lm/mode.py``), which is
how eft reaches an unmodified script: no change to its command line, its ``sys.argv`` or
its ``__main__``. It does two things and imports nothing heavy:

1. runs the ``sitecustomize`` this file shadows, if the environment has one (a site's own
   setup must not be lost to eft's);
2. under eft-run (``EFT_RUN_DIR`` set), installs the finder that attaches eft to
   Megatron's loop when the script imports ``megatron.training`` (or, where the launcher found
   a Megatron-Bridge script, ``EFT_TRAINING_LOOP=megatron_bridge``, Bridge's loop when it imports
   ``megatron.bridge.training.pretrain``).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_shadowed()
if os.environ.get("EFT_RUN_DIR"):
    _bridge = os.environ.get("EFT_TRAINING_LOOP") == "megatron_bridge"  # contract.run_dir.TrainingLoop
    try:
        if _bridge:
            from elasticft.megatron_bridge.attach import install
        else:
            from elasticft.megatron_lm.attach import install
    except ImportError as exc:  # eft not importable by this interpreter: the script runs without it
        print(f"eft: not attaching to {'Megatron-Bridge' if _bridge else 'Megatron-LM'}'s loop: {exc}",
              file=sys.stderr, flush=True)
    else:
        install()
