"""The one place that touches torch's private names (this module, ``worker_side.py`` for the
workers' part and ``exit_barrier.py`` for the agents' last meeting, whose names it re-exports).

eft reuses torch's elastic agent, its dynamic rendezvous and torchrun's launch path,
and works around a few of their behaviours through names torch does not promise to
keep. They are all here, each behind a small function that says why eft needs it, so
that a torch upgrade has one place to review, and fails loudly instead of silently
bringing back the bugs these workarounds exist for:

* class-level facts (imports, the agent steps eft overrides, the fields it reads) are
  checked when this module is imported, and raise ``TorchSeamError``;
* attributes torch sets on instances are checked at first use, with the same error.

``tests/test_torch_seam.py`` asserts all of it against the installed torch; CI runs it on
every torch minor of ``versions.TORCH`` (2.9 to the newest). Where torches of that range
differ in what eft relies on, the difference is a named branch here (``SHUTDOWN_TAKES_TIMEOUT``),
checked at import against the two shapes eft knows, so that a third fails loudly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import pickle
import signal
import threading
from collections.abc import Callable, Collection, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)

from elasticft.versions import TORCH, SeamError


class TorchSeamError(SeamError):
    """torch no longer has a private name or shape that eft relies on."""

    def __init__(self, what: str):
        super().__init__(
            f"torch {torch.__version__}: {what}; eft's torch seam (elasticft/torch_seam/) "
            f"was checked against {TORCH.range_text()} and needs updating"
        )


try:
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS
except ImportError as exc:
    raise TorchSeamError(str(exc)) from exc


# How far back a lost node's heartbeat is moved: far beyond any keep-alive timeout.
HEARTBEAT_AGE = timedelta(days=1)

# torch 2.12 gave the agent's _shutdown a grace period (``timeout``, passed on to the process
# context's close); before it, _shutdown(death_sig) closed with close()'s default 30 s.
SHUTDOWN_SHAPES = {("death_sig", "timeout"): True, ("death_sig",): False}
SHUTDOWN_PARAMS = tuple(inspect.signature(LocalElasticAgent._shutdown).parameters)[1:]
SHUTDOWN_TAKES_TIMEOUT = SHUTDOWN_SHAPES.get(SHUTDOWN_PARAMS)

# The agent steps FTElasticAgent overrides, with the parameters torch passes them.
# A step torch renamed or re-parameterised would leave an override that is never
# called (or called wrongly), with no error: hence the check at import. An override may
# take more parameters than torch passes, with defaults (``_shutdown``'s timeout before 2.12).
AGENT_STEPS: dict[str, tuple[str, ...]] = {
    "_rendezvous": ("worker_group",),
    "_assign_worker_ranks": ("store", "group_rank", "group_world_size", "spec"),
    "_start_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_stop_workers": ("worker_group",),
    "_shutdown": SHUTDOWN_PARAMS,
}


def _attribute(owner: Any, name: str) -> Any:
    """``owner.<name>``, or a TorchSeamError naming what torch no longer has."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise TorchSeamError(f"{type(owner).__name__} has no attribute {name!r}") from None


def _replace_attribute(owner: Any, name: str, value: Any) -> None:
    """Set an attribute torch already has; a missing one means torch moved it."""
    _attribute(owner, name)
    setattr(owner, name, value)


# -- the agent (torch's SimpleElasticAgent / LocalElasticAgent) ---------------------


def worker_processes(agent: LocalElasticAgent) -> Any:
    """torch's process context of the running workers (``pids()``, ``stdouts``), or None.

    torch keeps it in ``_pcontext`` and replaces it at every restart, so read it at
    each use rather than keeping it.
    """
    return _attribute(agent, "_pcontext")


def worker_pids(agent: LocalElasticAgent) -> dict[int, int]:
    """Local rank -> pid of the running workers; {} when none are running."""
    processes = worker_processes(agent)
    return processes.pids() if processes is not None else {}


def forget_worker_processes(agent: LocalElasticAgent) -> None:
    """Say that no workers run: a spare node starts none for its round.

    torch's monitor and shutdown steps treat a ``None`` context as "nothing to do";
    a previous generation's context left in place would be waited on again.
    """
    _replace_attribute(agent, "_pcontext", None)


def remaining_restarts(agent: LocalElasticAgent) -> int:
    """How many worker failures torch will still restart after (``--max-restarts`` left)."""
    return _attribute(agent, "_remaining_restarts")


def rendezvous_store(agent: LocalElasticAgent) -> Any:
    """The c10d store of the agent's current rendezvous round (None before the first)."""
    return _attribute(agent, "_store")


@contextlib.contextmanager
def agent_class_swapped(factory: Callable[..., LocalElasticAgent]) -> Iterator[None]:
    """Have torch's ``launch_agent`` build its agent with ``factory``.

    Reusing torch's launch path keeps metrics, events, error files and exit codes
    identical to torchrun's; the agent class is the one name ``launch_agent`` looks
    up at call time, in its own module (checked at import).
    """
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def shutdown(base: Callable[..., None], agent: LocalElasticAgent, death_sig: Any, timeout: float) -> None:
    """torch's ``_shutdown`` step (``base``: the agent's ``super()._shutdown``) with ``timeout`` s
    between ``death_sig`` and SIGKILL, on every torch of the range.

    The grace is what lets a signalled job's workers finish their save. Since 2.12 torch's step
    takes it and passes it to the process context's ``close``; before, the step called
    ``close(death_sig)`` with close's default (30 s), so the context's ``close`` is given the
    grace for this one call.
    """
    if SHUTDOWN_TAKES_TIMEOUT:
        base(death_sig, timeout)
        return
    with _close_given(agent, timeout=timeout):
        base(death_sig)


@contextlib.contextmanager
def _close_given(agent: LocalElasticAgent, **arguments: Any) -> Iterator[None]:
    """Inside, the agent's process context's ``close`` is called with ``arguments`` (keywords of
    ``PContext.close``, checked at import) where torch's caller leaves them at their defaults."""
    processes = worker_processes(agent)
    if processes is None:
        yield
        return
    processes.close = functools.partial(_attribute(processes, "close"), **arguments)
    try:
        yield
    finally:
        del processes.close  # the class's own again


@contextlib.contextmanager
def failure_kills_the_rest(agent: LocalElasticAgent) -> Iterator[None]:
    """Inside (torch's monitor step), the workers left when one of them failed get SIGKILL at
    once, not SIGTERM and 30 s to act on it.

    torch's process contexts (``SubprocessContext``, ``MultiprocessContext``) close the whole
    group from ``_poll`` (``wait(0)``, the monitor's look) as soon as one worker failed, with
    ``self.close()``'s defaults: SIGTERM, then SIGKILL after 30 s. A rank with a dead local
    peer is stuck in a collective that cannot finish (on a GPU, an NCCL kernel) and never acts
    on SIGTERM (eft's ``Hook`` makes it a request to save), so the node waited the whole 30 s.
    The context's ``close`` gets SIGKILL for the look (after a success, none runs to signal)."""
    with _close_given(agent, death_sig=signal.SIGKILL):
        yield


_fill = threading.local()  # the fill of the agent starting workers on this thread
_fill_installed = threading.Lock()


@contextlib.contextmanager
def worker_envs_filled(fill: Callable[[dict[str, str], int], None]) -> Iterator[None]:
    """Inside, each worker's variables that the agent's ``_start_workers`` builds pass through
    ``fill(env, local_rank)`` (in place) before its process starts: under SLURM, the worker's
    own SLURM_PROCID etc. (``slurm/worker_env.py``).

    torch 2.10 added a step for one worker's variables (``_set_local_rank_env``); 2.9 builds them
    inline. Every torch of the range hands them, a dict per local rank, to ``start_processes``,
    which the agent's module looks up at call time (checked at import): eft wraps that, once,
    and the wrapper applies the fill of the thread that starts workers (none: unchanged).
    """
    _install_envs_wrapper()
    previous, _fill.current = getattr(_fill, "current", None), fill
    try:
        yield
    finally:
        _fill.current = previous


def _install_envs_wrapper() -> None:
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent_module

    with _fill_installed:
        original = _attribute(agent_module, "start_processes")
        if getattr(original, "eft_fills_envs", False):
            return
        signature = inspect.signature(original)

        @functools.wraps(original)
        def start_processes(*args, **kwargs):
            fill = getattr(_fill, "current", None)
            if fill is not None:
                for local_rank, env in signature.bind(*args, **kwargs).arguments["envs"].items():
                    fill(env, local_rank)
            return original(*args, **kwargs)

        start_processes.eft_fills_envs = True
        agent_module.start_processes = start_processes


# How torch's SubprocessContext asks for one worker process (torch.distributed.elastic.
# multiprocessing.api): it calls the module-level ``get_subprocess_handler`` by name with these
# keywords, and a handler's process is whatever its ``_popen(args, env)`` returns.
SUBPROCESS_HANDLER_PARAMS = ("entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options")


@contextlib.contextmanager
def subprocess_handlers(factory: Callable[..., Any]) -> Iterator[None]:
    """Have torch build each worker's subprocess handler with ``factory`` (same keywords) for
    one start of the workers: the warm interpreters (``agent/warm_pool.py``) become the
    workers' processes there, and the rest of torch's process handling stays its own."""
    import torch.distributed.elastic.multiprocessing.api as mp_api

    original = _attribute(mp_api, "get_subprocess_handler")
    mp_api.get_subprocess_handler = factory
    try:
        yield
    finally:
        mp_api.get_subprocess_handler = original


def subprocess_handler_class() -> type:
    """torch's SubprocessHandler, whose ``_popen`` a warm start overrides."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    _attribute(SubprocessHandler, "_popen")
    return SubprocessHandler


# -- the dynamic rendezvous ----------------------------------------------------------


def rendezvous_round(handler: DynamicRendezvousHandler) -> int:
    """The round of the rendezvous this node joined last (read right after it joined).

    Every node of a round reads the same number, and the round moves on only once they
    have all left it, so it names one restart cycle job-wide: the job-wide restart
    count (``elasticft.agent.restart_budget``) counts each cycle once by it. torch logs
    it but offers no public way to read it.
    """
    return int(_attribute(_attribute(_attribute(handler, "_state_holder"), "state"), "round"))


def stop_heartbeats(handler: DynamicRendezvousHandler) -> None:
    """Stop the handler's keep-alive timer without closing the rendezvous.

    The handler's public ``shutdown`` does both; a node leaving a running job must
    do only the first, or the nodes that stay could form no further round.
    """
    _attribute(handler, "_stop_heartbeats")()


def aged_rendezvous_state(state_bits: bytes, lost_identities: Collection[tuple[str, int]]) -> bytes:
    """``state_bits`` with the heartbeats of lost nodes moved far into the past.

    torch drops a node from the rendezvous only when its last heartbeat is older than
    ``keep_alive_interval * keep_alive_max_attempt``. eft learns of a lost node sooner
    (its lease vanished); aging its heartbeat in the state the backend hands torch
    lets torch's own sanitizer drop it at the next sync. Nodes are matched by
    ``(addr, pid)``, the part of torch's node descriptor (``addr_pid_localid``) an
    agent can know of itself. The input comes back unchanged when nothing was aged.
    """
    if not lost_identities:
        return state_bits
    state = pickle.loads(state_bits)
    if not isinstance(state, _RendezvousState):
        raise TorchSeamError(f"the rendezvous state is a {type(state).__name__}, not a _RendezvousState")
    heartbeats = _attribute(state, "last_heartbeats")
    aged = False
    for node, last in list(heartbeats.items()):
        if (_attribute(node, "addr"), _attribute(node, "pid")) in lost_identities:
            heartbeats[node] = last - HEARTBEAT_AGE
            aged = True
    return pickle.dumps(state) if aged else state_bits


def parse_rendezvous_config(text: str) -> dict[str, str]:
    """``--rdzv-conf`` as torchrun reads it (``K=V,K=V``); raises ValueError when malformed.

    eft checks it up front, with torch's own parser, so that a mistake costs one
    line instead of a traceback from deep inside the launch.
    """
    return _parse_rendezvous_config(text)


# -- checked at import -------------------------------------------------------------------


def _check_installed_torch() -> None:
    for name, value in (("_TERMINAL_STATE_SYNC_ID", _TERMINAL_STATE_SYNC_ID), ("_NUM_MEMBERS", _NUM_MEMBERS)):
        if not isinstance(value, str):
            raise TorchSeamError(f"{name} is a {type(value).__name__}, not a str")
    fields = {f.name for f in dataclasses.fields(_NodeDesc)} if dataclasses.is_dataclass(_NodeDesc) else set()
    if not {"addr", "pid"} <= fields:
        raise TorchSeamError(f"_NodeDesc has fields {sorted(fields)}, not addr and pid")
    if not isinstance(_attribute(_RendezvousState(), "last_heartbeats"), dict):
        raise TorchSeamError("_RendezvousState.last_heartbeats is not a dict")
    if not callable(getattr(DynamicRendezvousHandler, "_stop_heartbeats", None)):
        raise TorchSeamError("DynamicRendezvousHandler has no _stop_heartbeats()")
    if getattr(launcher_api, "LocalElasticAgent", None) is not LocalElasticAgent or (
        "LocalElasticAgent" not in launcher_api.launch_agent.__code__.co_names
    ):
        raise TorchSeamError("launch_agent no longer builds the LocalElasticAgent of its module")
    if SHUTDOWN_TAKES_TIMEOUT is None:
        raise TorchSeamError(f"LocalElasticAgent._shutdown takes {SHUTDOWN_PARAMS}, not one of {list(SHUTDOWN_SHAPES)}")
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent_module
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, PContext, SubprocessContext

    if tuple(inspect.signature(PContext.close).parameters)[1:] != ("death_sig", "timeout"):
        raise TorchSeamError("PContext.close no longer takes (death_sig, timeout)")
    for context in (SubprocessContext, MultiprocessContext):  # failure_kills_the_rest
        if "close" not in inspect.unwrap(context._poll).__code__.co_names:
            raise TorchSeamError(f"{context.__name__}._poll no longer closes the workers through close()")
    if "envs" not in inspect.signature(_attribute(agent_module, "start_processes")).parameters or (
        "start_processes" not in inspect.unwrap(LocalElasticAgent._start_workers).__code__.co_names
    ):
        raise TorchSeamError("LocalElasticAgent._start_workers no longer hands the workers' envs to start_processes")
    for step, expected in AGENT_STEPS.items():
        method = getattr(LocalElasticAgent, step, None)
        if method is None:
            raise TorchSeamError(f"LocalElasticAgent has no {step}() to override")
        parameters = tuple(inspect.signature(method).parameters)[1:]
        if parameters != expected:
            raise TorchSeamError(f"LocalElasticAgent.{step} takes {parameters}, not {expected}")


_check_installed_torch()


# The worker's side (defined after the checks above, which it relies on).
from elasticft.torch_seam.exit_barrier import check_in_at_exit, exit_barrier_key, exit_barrier_reached  # noqa: E402,F401,I001
from elasticft.torch_seam.worker_side import (  # noqa: E402,F401 - the seam's face
    lazy_gloo_group,
    observe_init_process_group,
    ranged_storage_reads,
    storage_location,
    write_error_file,
)
