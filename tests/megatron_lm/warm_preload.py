"""What a warm interpreter imports ahead of need for pretrain_gpt.py here (``--eft-preload auto,warm_preload``).

In pretrain_gpt.py's order: CPU emulation first where there is no CUDA (megatron binds
torch.cuda functions at import), then megatron-core and Megatron-LM's loop, where eft
attaches (its ``sitecustomize`` ran in the warm interpreter as in a cold one).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_emulation

    cpu_emulation.enable()

import megatron.core  # noqa: E402,F401
import megatron.training.training  # noqa: E402,F401
