"""What eft changes in a recipe's ConfigContainer, at ``pretrain``, before Bridge reads it.

A Bridge job's parallelism lives in its ConfigContainer, not in Megatron-LM flags (which the
planner rewrites for a Megatron-LM script). When eft-run plans the layout (``--eft-model-config``:
a Bridge job has no ``--num-layers`` to read), each worker gets ``EFT_TP``/``EFT_PP``
(``planner.layout.plan_env``) and the recipe's ``model.tensor_model_parallel_size`` and
``model.pipeline_model_parallel_size`` are set from them here, every restart, so the recipe
obeys every re-plan with no change to the script; DP follows from the world size, as in Bridge.

NVRx's rank monitor (``ft.enable_ft_package``) needs NVRx's ``ft_launcher``; under eft-run no
monitor is there to connect to, and eft's own section timeouts, fed by the same loop, do its
work (ft_launcher's ``--ft-*`` flags set them: ``launcher/ft_launcher_flags.py``). The field is
turned off here, with one line saying so. So is NVRx's in-process restart
(``inprocess_restart.enabled``): it would run ``_pretrain`` again inside this process, on process
groups it destroyed while eft's hook holds them; eft restarts the workers itself (warm workers
give a restart its in-process speed).
"""

from __future__ import annotations

import logging
import os

from elasticft import bridge_seam as seam

log = logging.getLogger(__name__)

LAYOUT_ENV = {seam.TP: "EFT_TP", seam.PP: "EFT_PP"}  # planner.layout.plan_env's names


def apply(config) -> list[str]:
    """Put eft's layout and fault tolerance into ``config``; what was changed, in words."""
    changes = []
    for field, variable in LAYOUT_ENV.items():
        wanted = os.environ.get(variable)
        if not wanted:
            continue
        current = seam.get(config, field)
        if current != int(wanted):
            seam.put(config, field, int(wanted))
            changes.append(f"{field} {current} -> {wanted} (eft's plan)")
    if changes and _dp_reshardable_only(config):
        changes.append(f"the distributed optimizer's state is saved dp_reshardable: a checkpoint saved at another "
                       f"TP or PP will not load (set {seam.FULLY_RESHARDABLE}=true in the recipe)")
    ft = getattr(config, seam.FT, None)
    if ft is not None and getattr(ft, seam.FT_ENABLED, False):
        setattr(ft, seam.FT_ENABLED, False)
        changes.append("ft.enable_ft_package off: eft times Bridge's sections in place of NVRx's rank monitor")
    inprocess = getattr(config, seam.INPROCESS_RESTART, None)
    if inprocess is not None and getattr(inprocess, seam.INPROCESS_ENABLED, False):
        setattr(inprocess, seam.INPROCESS_ENABLED, False)
        changes.append("inprocess_restart off: eft restarts the workers itself (NVRx's in-process restart would run "
                       "the training again in this process on groups eft's hook holds)")
    if changes and _first_rank():
        print(f"eft: the recipe's ConfigContainer: {'; '.join(changes)}", flush=True)
    return changes


def _dp_reshardable_only(config) -> bool:
    """Whether the recipe's checkpoints reshard DP only (Megatron's rule: ``planner.megatron_args.reshard_rule``)."""
    return bool(seam.get(config, seam.DISTRIBUTED_OPTIMIZER)) and not seam.get(config, seam.FULLY_RESHARDABLE)


def _first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"
