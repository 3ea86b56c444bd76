"""What a training process needs from eft: the per-iteration hook and checkpoint hygiene.

    from elasticft.worker import Hook
    hook = Hook()                                  # after init_process_group
    action = hook.step(iteration)                  # every iteration, on every rank
    # save when action.save, then hook.saved(iteration, path, seconds); stop when action.exit

See docs/checkpoint.md.
"""

from .checkpoints import CheckpointDir
from .hook import Action, Hook

__all__ = ["Action", "CheckpointDir", "Hook"]
