"""Attach eft to Megatron-Bridge's loop the moment the worker imports it.

The finder of Megatron-LM's mode (``megatron_lm.attach.AfterImport``) waits for
``megatron.bridge.training.pretrain``: the module a recipe script imports ``pretrain`` from,
and the last of Bridge's loop modules to finish executing (it imports ``train`` from
``train.py`` by name, so the wrappers must be in place in both before the script's next line).
"""

from __future__ import annotations

import sys

from elasticft import bridge_seam
from elasticft.megatron_lm.attach import AfterImport, skip_compile_when_shipped


def install() -> None:
    """Attach to Bridge's loop when this process imports it (idempotent)."""
    if any(isinstance(f, AfterImport) and f.name == bridge_seam.PRETRAIN for f in sys.meta_path):
        return
    if bridge_seam.PRETRAIN in sys.modules:
        _attach(sys.modules[bridge_seam.PRETRAIN])
        return
    sys.meta_path.insert(0, AfterImport(bridge_seam.PRETRAIN, _attach))


def _attach(_module) -> None:
    from elasticft.megatron_bridge.loop import BridgeLoop
    from elasticft.worker.phases import watch_process_group

    BridgeLoop().attach()
    bridge_seam.replace("compile_helpers", skip_compile_when_shipped)
    watch_process_group()  # before Bridge's initialize: eft report's imports and process_group phases
