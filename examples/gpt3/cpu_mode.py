"""CPU mode: run megatron-core's CUDA-only code paths on the CPU, as an emulation for testing.

megatron-core assumes a GPU: it allocates buffers with ``device=torch.cuda.current_device()``,
moves tensors with ``.cuda()``, swaps CUDA RNG states around tensor-parallel regions, and
brackets work with CUDA streams, events and NVTX ranges. On a machine without CUDA,
``enable()`` makes that code run on the CPU so that the GPT example trains with TP, PP and
DP on gloo, which is how the tests and CI exercise checkpoints and resharding:

1. a ``torch.overrides.TorchFunctionMode`` turns ``device="cuda"``, ``torch.device("cuda")``
   and integer devices into the CPU wherever a torch function takes a device, and makes
   ``Tensor.cuda()`` and ``Tensor.pin_memory()`` return the tensor itself;
2. the ``torch.cuda`` calls megatron-core makes and that fail without CUDA (current_device,
   synchronize, the RNG state calls, streams and events, memory queries, NVTX) become
   CPU equivalents or no-ops; ``torch.cuda.is_available()`` stays False;
3. megatron's tensor-parallel RNG tracker saves and restores the CPU generator where it
   would use the CUDA one (dropout on CPU tensors draws from the CPU generator).

It is for testing, not for speed, and it has limits:

- build the model with ``TransformerConfig(use_cpu_initialization=True)`` and the local
  layer spec (no Transformer Engine, no apex), in fp32;
- use the plain megatron optimizer: the distributed optimizer and the bf16/fp16 optimizer
  test ``param.type() == "torch.cuda.FloatTensor"`` and would refuse CPU parameters (and
  the distributed optimizer's torch-Adam fallback does not resume correctly);
- gradient clipping asserts the same type name on each gradient; ``Tensor.type()`` is
  therefore answered with the CUDA name for float32 CPU tensors (only the name: the
  tensor stays on the CPU);
- nothing here makes megatron-core's fused kernels (TE, apex, fused softmax) available:
  turn the fusions off.

``enable()`` must run before megatron-core is imported (some modules bind ``torch.cuda``
functions at import time) and stays on for the life of the process.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_MODE = None  # the _CpuDevices mode once enabled

# Legacy type names megatron-core compares with, CPU name -> CUDA name.
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor"}


def _cpu(device):
    """The CPU in place of a CUDA device (a string, a torch.device or an ordinal)."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


class _CpuDevices(TorchFunctionMode):
    """Every torch function call sees the CPU where it was given a CUDA device."""

    _IDENTITY = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._IDENTITY:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            # tensor.to("cuda"), tensor.to(0), tensor.to(torch.device("cuda", 1), dtype)
            args = (args[0],) + tuple(_cpu(a) for a in args[1:])
        return func(*args, **kwargs)


class _NoStream:
    """A CUDA stream or event that does nothing: CPU work is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


# torch._dynamo keeps a rule per torch.cuda function object and refuses one object
# under two names: every replacement below is a function of its own.
def _nothing():
    return lambda *args, **kwargs: None


def _zero():
    return lambda *args, **kwargs: 0


def _no_context():
    @contextlib.contextmanager
    def no_context(*args, **kwargs):
        yield
    return no_context


def _stub_torch_cuda() -> None:
    cuda = torch.cuda
    replacements = {
        "current_device": _zero(),
        "set_device": _nothing(),
        "synchronize": _nothing(),
        "empty_cache": _nothing(),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(seed),
        "Stream": _NoStream,
        "Event": _NoStream,
        "current_stream": lambda device=None: _NoStream(),
        "default_stream": lambda device=None: _NoStream(),
        "stream": _no_context(),
        "memory_allocated": _zero(),
        "max_memory_allocated": _zero(),
        "memory_reserved": _zero(),
        "max_memory_reserved": _zero(),
        "reset_peak_memory_stats": _nothing(),
        "reset_max_memory_allocated": _nothing(),
        "memory_stats": lambda device=None: {},
        "mem_get_info": lambda device=None: (0, 0),
    }
    for name, replacement in replacements.items():
        setattr(cuda, name, replacement)
    # torch.cuda.random's functions are the same objects as torch.cuda's: reuse them.
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(cuda.random, name, replacements[name])
    for name in ("range_push", "range_pop", "mark"):
        setattr(cuda.nvtx, name, _nothing())
    cuda.nvtx.range = _no_context()


def _patch_megatron_rng() -> None:
    """megatron's RNG tracker swaps "CUDA" states: let it swap the CPU generator's."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    class _SameGenerator(logging.Filter):
        # The tracker warns when the CPU state changes inside a forked "CUDA" state;
        # here the two are one generator, so it always does.
        def filter(self, record):
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mp_random.__name__).addFilter(_SameGenerator())


def enable() -> None:
    """Turn CPU mode on for this process (idempotent). Call before importing megatron.core."""
    global _MODE
    if _MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_mode is an emulation for machines without CUDA; CUDA is available here")
    _stub_torch_cuda()
    _MODE = _CpuDevices()
    _MODE.__enter__()
    _patch_megatron_rng()


def enabled() -> bool:
    return _MODE is not None
