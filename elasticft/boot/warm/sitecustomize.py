"""First on a warm interpreter's PYTHONPATH (``agent/warm_pool.py``): the site's own setup, watched.

A warm interpreter runs the site's setup (a ``sitecustomize`` of the user's or the cluster's: a
per-rank device or NUMA binding, a CPU emulation) before its worker's environment exists. It is
started with what is known of its worker slot (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); this file
records which variables the setup reads, so that the interpreter can tell at the handoff whether
the setup saw what a cold start's would (``warm_interpreter.doubt``). It:

1. takes itself off ``sys.path`` and puts ``PYTHONPATH`` back as the command has it (what the
   site's setup and a cold start see);
2. watches ``os.environ`` (``worker/environ_reads.py``) and runs the ``sitecustomize`` it shadows,
   as ``sys.modules["sitecustomize"]``, as a cold start would have it (a Megatron job's: eft's
   ``boot/``, which runs the site's own in turn). The interpreter watches on through
   ``usercustomize`` and its preload, until the handoff.
"""

import importlib.machinery
import importlib.util
import os
import sys

_eft_watched_site = True  # this module, not a site's own (the interpreter drops it if it stays)


def _take_back() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from elasticft.contract.warm_start import WATCHED_SITE, without_watched_site

    original = without_watched_site(dict(os.environ))
    os.environ.pop(WATCHED_SITE, None)
    if "PYTHONPATH" in original:
        os.environ["PYTHONPATH"] = original["PYTHONPATH"]
    else:
        os.environ.pop("PYTHONPATH", None)


def _run_shadowed() -> None:
    from elasticft.worker import environ_reads

    environ_reads.watch("the site setup")
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # the import machinery returns what is there at the end
    spec.loader.exec_module(module)


_take_back()
_run_shadowed()
