"""What a training process needs from eft: the per-iteration hook and checkpoint hygiene.

    from elasticft.worker import Hook
    hook = Hook()                                  # after init_process_group
    action = hook.step(iteration)                  # every iteration, on every rank
    # save when action.save, then hook.saved(iteration, path, seconds); stop when action.exit
    memory = MemoryCheckpoints(hook)               # snapshots in host memory, replicated by the agents
    memory.step(iteration, state_fn)               # every iteration, after hook.step

See docs/checkpoint.md and docs/memory-checkpoints.md.
"""

from __future__ import annotations

import importlib

# Loaded on first use: the agent and the `eft` command import the gap rule from this
# package and must not pay for importing torch (the hook's dependency) to get it.
_EXPORTS = {"Action": ".hook", "Hook": ".hook", "CheckpointDir": ".checkpoints",
            "MemoryCheckpoints": ".memory", "Restored": ".memory"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
