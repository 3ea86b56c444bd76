"""What a warm interpreter may import ahead of need for this example (train.py's ``__eft_preload__``).

train.py imports megatron-core only after ``cpu_mode.enable()`` (some megatron modules bind
torch.cuda functions at import), so ``auto`` leaves megatron-core to the worker. This module
keeps that order: CPU mode first where there is no CUDA (``enable()`` is idempotent; train.py
calls it again), then the modules train.py and its siblings import. Nothing here depends on
the rank.
"""

import os
import sys
import warnings

import torch

# train.py's filters for megatron-core's import-time notes, so that a warm worker's log shows
# what a cold one's does.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and )?Apex (is|are) not installed")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")

if not torch.cuda.is_available():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_mode

    cpu_mode.enable()

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
