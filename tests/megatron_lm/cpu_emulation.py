"""CPU emulation for Megatron-LM's own training loop (``megatron.training.pretrain``).

The GPT example's ``cpu_mode`` (examples/gpt3/cpu_mode.py) already makes megatron-core's
CUDA-only code run on the CPU: devices, ``torch.cuda`` calls, the RNG tracker. Megatron-LM's
training loop (``megatron.training``, shipped in the megatron-core wheel) asks a few more
things of the machine; ``enable()`` turns on ``cpu_mode`` and answers those too, each as
low as it can be answered (a ``torch.cuda`` call where that is what is asked), so that the
loop itself runs unmodified:

- ``torch.cuda.device_count()`` is 1: ``_initialize_distributed`` builds the model-parallel
  groups only when it counts a device (it skips them silently otherwise, and the job fails
  later, far from the cause);
- ``torch.cuda.get_device_properties()`` / ``get_device_capability()`` describe an Ampere
  GPU: ``validate_args`` asks the architecture when TP or CP > 1 (and then, as on a real
  pre-Blackwell GPU, requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment);
- ``initialize_megatron`` is called with ``allow_no_cuda=True``: ``pretrain`` calls it without,
  and in megatron-core 0.17 to 0.19 the argument only guards an ``assert torch.cuda.is_available()``
  (which ``cpu_mode`` deliberately leaves False);
- the dataset index helper is not compiled when the wheel's prebuilt ``helpers_cpp`` imports:
  the wheel ships the compiled module but not the Makefile, so rank 0's ``make`` fails and
  ``compile_helpers`` ends the job with ``sys.exit(1)``. A packaging fault, not a CPU one,
  which eft-run mends for every Megatron-LM job (``elasticft/megatron_lm/attach.py``): the
  emulation does it only under plain torchrun, so that the tests see eft's fix at work.

Call ``enable()`` before importing ``megatron`` (``cpu_mode`` requires it), and run the model
as ``cpu_mode`` asks: ``--transformer-impl local``, fp32, no fused kernels.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

_ENABLED = False

# The emulated device: an Ampere-class GPU (compute capability 8.0).
_CAPABILITY = (8, 0)


def _import_cpu_mode():
    """The GPT example's cpu_mode module (examples/gpt3/cpu_mode.py in this repository)."""
    here = os.path.dirname(os.path.abspath(__file__))
    gpt3 = os.path.normpath(os.path.join(here, "..", "..", "examples", "gpt3"))
    if gpt3 not in sys.path:
        sys.path.insert(0, gpt3)
    import cpu_mode

    return cpu_mode


def _count_one_device() -> None:
    """``torch.cuda.device_count()`` -> 1.

    ``megatron.training.initialize._initialize_distributed`` calls
    ``mpu.initialize_model_parallel`` only when ``device_count > 0``; with 0 it returns
    without TP/PP/DP groups and the job fails later in model setup.
    """
    torch.cuda.device_count = lambda: 1


def _describe_device() -> None:
    """``torch.cuda.get_device_properties()`` / ``get_device_capability()`` answer for a GPU.

    ``validate_args`` reads ``get_device_properties("cuda:0").major`` (via
    ``get_device_arch_version``) when TP or CP > 1, and ``get_device_capability()`` for
    grouped GEMM; without CUDA both raise.
    """
    major, minor = _CAPABILITY
    properties = SimpleNamespace(
        name="CPU (megatron_lm cpu_emulation)",
        major=major,
        minor=minor,
        total_memory=0,
        multi_processor_count=1,
    )
    torch.cuda.get_device_properties = lambda device=None: properties
    torch.cuda.get_device_capability = lambda device=None: (major, minor)


def _allow_no_cuda() -> None:
    """``pretrain`` calls ``initialize_megatron()`` with ``allow_no_cuda=False``.

    In megatron-core 0.17 to 0.19 ``allow_no_cuda`` only guards ``assert torch.cuda.is_available()``;
    ``cpu_mode`` keeps ``is_available()`` False on purpose (code that asks it takes its CPU
    path), so the loop's call gets ``allow_no_cuda=True`` instead.
    """
    from megatron.training import training

    original = training.initialize_megatron
    if getattr(original, "_cpu_emulation", False):
        return

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron._cpu_emulation = True
    training.initialize_megatron = initialize_megatron


def _skip_helpers_compile_when_prebuilt() -> None:
    """Skip rank 0's ``make`` of the dataset helper when the wheel's ``helpers_cpp`` imports.

    The megatron-core wheel ships ``megatron/core/datasets/helpers_cpp*.so`` but not the
    Makefile ``compile_helpers`` runs, so ``make`` fails and ``compile_helpers`` calls
    ``sys.exit(1)`` (rank 0 exits, the others hang in the next barrier). A packaging fault,
    not a CPU one; the compile still runs where the prebuilt module is missing.
    """
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers
    if getattr(original, "_cpu_emulation", False):
        return

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            return original()
        return None

    compile_helpers._cpu_emulation = True
    dataset_utils.compile_helpers = compile_helpers


def enable() -> None:
    """Turn the emulation on for this process (idempotent). Call before importing megatron."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_emulation is for machines without CUDA; CUDA is available here")
    _import_cpu_mode().enable()
    _count_one_device()
    _describe_device()
    _allow_no_cuda()
    import distrib_optimizer_on_cpu  # beside this file, as this file is beside the script

    distrib_optimizer_on_cpu.apply()
    if not os.environ.get("EFT_RUN_DIR"):  # under eft-run, eft's own fix of the fault does it (and says so)
        _skip_helpers_compile_when_prebuilt()
    _ENABLED = True


def enabled() -> bool:
    return _ENABLED
