"""What a training process needs from eft: checkpoint hygiene (the per-iteration hook follows)."""

from .checkpoints import CheckpointDir

__all__ = ["CheckpointDir"]
