"""Megatron's distributed optimizer (``--use-distributed-optimizer``) saved and resumed exactly on the CPU.

On a GPU, Megatron's distributed optimizer runs Apex's or Transformer Engine's fused Adam,
which keeps Adam's ``step`` in the parameter groups. Without either (this machine),
megatron-core falls back to torch's Adam, which keeps a ``step`` tensor per parameter, and
megatron-core's path for that case (``HAVE_APEX_OR_TE`` false) does not survive a resume:

1. ``state_dict()`` asserts it finds exactly one per-parameter ``step``; a freshly built torch
   Adam has none until its first step, and a load calls ``sharded_state_dict(is_loading=True)``,
   hence ``state_dict()``, before any step: the assertion fails, under plain torchrun too.
   The state is first made by megatron-core's own ``_init_optimizer_states_with_dummy_values``
   (one step of zero gradients, what its FSDP path does before a load); the load then
   overwrites all of it, the parameters included.
2. The load copies each saved state tensor onto the live one by name, ``step`` among them; in
   the ``dp_reshardable`` format the saved ``step`` is a local placeholder (megatron-core says
   the step "is handled separately via param_groups"), so every parameter's step became the
   dummy step's 1, and the first step after a resume used the wrong bias correction. The
   per-parameter copy leaves ``step`` alone, as with the fused optimizers.
3. ``load_state_dict`` hands every parameter one and the same ``step`` tensor from the
   parameter groups, and torch's Adam adds 1 to each parameter's step in place: a shared
   tensor would count one step once per parameter. Each parameter gets its own.
4. In fp32 (the emulation's precision) a shard's main parameter is a view of the model's
   parameter, a leaf that requires grad, and megatron-core 0.17 and 0.18 copy into it in
   place with grad on, which autograd refuses (0.19 copies under ``torch.no_grad``).

Test code only (``cpu_emulation.enable()`` applies it); on a GPU none of it is needed. What it
relies on is megatron-core's, so a release that renames it fails at ``apply()``, loudly.
"""

from __future__ import annotations

import inspect

import torch

_MARK = "_cpu_emulation"


def apply() -> None:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.sharded_state_dict, _MARK, False):
        return
    missing = [name for name in ("sharded_state_dict", "load_state_dict", "_set_main_param_and_optimizer_states",
                                 "_init_optimizer_states_with_dummy_values") if not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"the CPU emulation of the distributed optimizer needs DistributedOptimizer.{missing[0]}, "
                           "which this megatron-core lacks")
    _state_before_a_load(cls)
    _copies_leave_the_step(cls)
    _each_parameter_its_own_step(cls)


def _marked(function):
    setattr(function, _MARK, True)
    return function


def _state_before_a_load(cls) -> None:
    original = cls.sharded_state_dict
    signature = inspect.signature(original)

    @_marked
    def sharded_state_dict(self, *args, **kwargs):
        if signature.bind(self, *args, **kwargs).arguments.get("is_loading") and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    cls.sharded_state_dict = sharded_state_dict


def _copies_leave_the_step(cls) -> None:
    original = cls._set_main_param_and_optimizer_states

    @_marked
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state:  # copied onto itself: the step comes from the parameter groups
            tensors = {**tensors, "step": state["step"]}
        with torch.no_grad():
            return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _each_parameter_its_own_step(cls) -> None:
    original = cls.load_state_dict

    @_marked
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    cls.load_state_dict = load_state_dict
