"""CPU emulation for Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain``).

Megatron-LM's emulation (``tests/megatron_lm/cpu_emulation.py``) answers megatron-core's and
``megatron.training``'s questions of the machine; Bridge asks three more:

- ``import megatron.bridge`` reaches ``import transformer_engine.pytorch as te`` through its LoRA
  layers (``megatron.bridge.peft.lora_layers``) whatever the recipe says, and Transformer Engine
  has no wheel for a machine without CUDA. While, and only while, that one module executes, a
  stand-in ``transformer_engine`` is in ``sys.modules``: its names are types nothing is an
  instance of. It is gone before the next import, so megatron-core's and Bridge's own
  ``try: import transformer_engine`` still see no TE and take their local paths;
- Bridge's ``setup`` calls its own ``initialize_megatron`` without ``allow_no_cuda``: the call gets
  ``allow_no_cuda=True``, as Megatron-LM's does (the argument only guards
  ``assert torch.cuda.is_available()``);
- its GPT recipe must ask for the local transformer implementation, fp32 and no fused kernels, as
  ``cpu_mode`` asks of any megatron-core model (the script does; nothing to emulate).

Call ``enable()`` before importing ``megatron``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_ENABLED = False


class _StandIn(types.ModuleType):
    """A module whose every attribute is a fresh type (or a further stand-in module): enough for
    ``te.Linear`` in an ``isinstance`` and ``te.ops.Sequential`` in an annotation."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StandIn(f"{self.__name__}.{name}") if name.islower() else type(name, (), {})
        setattr(self, name, value)
        return value


class _TransformerEngineForLoraOnly(importlib.abc.MetaPathFinder):
    """Runs Bridge's LoRA layer module with a stand-in ``transformer_engine`` in ``sys.modules``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA_LAYERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        original_exec = spec.loader.exec_module

        def exec_module(module):
            te = _StandIn("transformer_engine")
            names = {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch}
            shadowed = {name: sys.modules.get(name) for name in names}
            sys.modules.update(names)
            try:
                original_exec(module)
            finally:
                for name, before in shadowed.items():
                    if before is None:
                        sys.modules.pop(name, None)
                    else:
                        sys.modules[name] = before
        spec.loader.exec_module = exec_module
        return spec


def _allow_no_cuda() -> None:
    from megatron.bridge.training import initialize, setup

    original = initialize.initialize_megatron
    if getattr(original, "_cpu_emulation", False):
        return

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron._cpu_emulation = True
    initialize.initialize_megatron = initialize_megatron
    setup.initialize_megatron = initialize_megatron  # setup.py imported it by name


def _megatron_lm_emulation():
    """Megatron-LM's emulation (``tests/megatron_lm/cpu_emulation.py``), under a name of its own:
    this module has the same one, and is first on ``sys.path`` in a Bridge script's worker."""
    mlm = os.path.normpath(os.path.join(_HERE, "..", "megatron_lm"))
    if mlm not in sys.path:
        sys.path.append(mlm)  # its helpers (distrib_optimizer_on_cpu) are imported from beside it
    name = "megatron_lm_cpu_emulation"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(mlm, "cpu_emulation.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def enable() -> None:
    """Turn the emulation on for this process (idempotent). Call before importing megatron."""
    global _ENABLED
    if _ENABLED:
        return
    megatron_lm_emulation = _megatron_lm_emulation()

    if not any(isinstance(f, _TransformerEngineForLoraOnly) for f in sys.meta_path):
        sys.meta_path.insert(0, _TransformerEngineForLoraOnly())
    megatron_lm_emulation.enable()
    _allow_no_cuda()
    _ENABLED = True
