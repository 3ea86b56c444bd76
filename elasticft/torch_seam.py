"""The one module that touches torch's private names.

eft reuses torch's elastic agent, its dynamic rendezvous and torchrun's launch path,
and works around a few of their behaviours through names torch does not promise to
keep. They are all here, each behind a small function that says why eft needs it, so
that a torch upgrade has one place to review, and fails loudly instead of silently
bringing back the bugs these workarounds exist for:

* class-level facts (imports, the agent steps eft overrides, the fields it reads) are
  checked when this module is imported, and raise ``TorchSeamError``;
* attributes torch sets on instances are checked at first use, with the same error.

``tests/test_torch_seam.py`` asserts all of it against the installed torch, and
``pyproject.toml`` pins torch to the minor release that test was run with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import pickle
import time
from collections.abc import Callable, Collection, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)

# The torch release this seam was last checked against (see tests/test_torch_seam.py).
CHECKED_TORCH = "2.13"


class TorchSeamError(RuntimeError):
    """torch no longer has a private name or shape that eft relies on."""

    def __init__(self, what: str):
        super().__init__(
            f"torch {torch.__version__}: {what}; eft's torch seam (elasticft/torch_seam.py) "
            f"was checked against torch {CHECKED_TORCH} and needs updating"
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

# The agent steps FTElasticAgent overrides, with the parameters torch passes them.
# A step torch renamed or re-parameterised would leave an override that is never
# called (or called wrongly), with no error: hence the check at import.
AGENT_STEPS: dict[str, tuple[str, ...]] = {
    "_rendezvous": ("worker_group",),
    "_assign_worker_ranks": ("store", "group_rank", "group_world_size", "spec"),
    "_start_workers": ("worker_group",),
    "_monitor_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_stop_workers": ("worker_group",),
    "_shutdown": ("death_sig", "timeout"),
    # one worker's variables, filled in place: the SLURM rank variables (slurm/worker_env.py)
    "_set_local_rank_env": ("worker_env", "local_rank", "spec"),
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


def exit_barrier_key() -> str:
    """The store key torch's exit barrier counts finished agents under.

    A finished agent adds itself under this key before it waits for the others, so
    its existence means some node's workers are done: what a spare node, which has
    no workers to watch, waits for before it finishes too.
    """
    return _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS


def exit_barrier_reached(store: Any) -> bool:
    """True once any agent entered torch's exit barrier in ``store``.

    Store errors propagate: the caller decides what a store in trouble means.
    """
    return bool(store.check([exit_barrier_key()]))


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


# -- error files -----------------------------------------------------------------------


def write_error_file(path: str | Path, message: str) -> str:
    """Write ``message`` as a worker's error file in torch's format; returns the path.

    torch's ``ProcessFailure`` reads it back, and its failure report (the one torchrun
    prints when restarts run out) shows ``message``. torch's own writer, ``ErrorHandler``,
    writes only the current exception to ``$TORCHELASTIC_ERROR_FILE``, which does not
    fit a failure the agent diagnoses itself. No ``py_callstack``: torch's report shows
    it *instead of* the message when present.
    """
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    Path(path).write_text(json.dumps(data))
    return str(path)


# -- the worker's process group ---------------------------------------------------------


def observe_init_process_group(called: Callable[[], None], returned: Callable[[], None]) -> None:
    """Have ``called()`` run when this process calls ``torch.distributed.init_process_group``
    and ``returned()`` when the call returns (``eft report``'s restart phases: the script's
    imports end at the call, the process group is formed at the return).

    torch offers no callback for it, so eft replaces the public function by a wrapper that
    calls the original, in the two places a script finds it: ``torch.distributed`` and its
    ``distributed_c10d`` (one function; a torch that made them two fails here). A script that
    bound the function before this ran calls the original, unobserved. Idempotent.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = _attribute(distributed_c10d, "init_process_group")
    if getattr(original, "eft_observed", False):
        return
    if _attribute(dist, "init_process_group") is not original:
        raise TorchSeamError("torch.distributed.init_process_group is not distributed_c10d.init_process_group")

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        called()
        result = original(*args, **kwargs)
        returned()
        return result

    init_process_group.eft_observed = True
    _replace_attribute(distributed_c10d, "init_process_group", init_process_group)
    _replace_attribute(dist, "init_process_group", init_process_group)


# -- torch_dist checkpoints: where each storage item lies, and a ranged read of them ------------


def storage_location(info: Any) -> tuple[str, int, int]:
    """(file, offset, length) of one storage item, from torch's ``_StorageInfo`` (the values of a
    checkpoint's ``Metadata.storage_data``, and a write result's ``storage_data``)."""
    return (str(_attribute(info, "relative_path")), int(_attribute(info, "offset")),
            int(_attribute(info, "length")))


@contextlib.contextmanager
def ranged_storage_reads(directory: str | Path,
                         open_stream: Callable[[str, list[tuple[int, int]]], Any]) -> Iterator[None]:
    """Inside, torch's ``FileSystemReader`` loading the checkpoint ``directory`` opens each data file
    through ``open_stream(name, [(offset, length) of the plan's items in it])``, which returns a
    seekable binary stream or None (the file as it is); other checkpoints are read as before.

    torch's ``read_data`` (the public StorageReader step) opens each file of its plan once through
    ``self.fs.create_stream(path, "rb")`` and reads each item from it (seek, read): the one place
    that knows which bytes a rank needs. Megatron-core's readers subclass it.
    """
    from torch.distributed.checkpoint import FileSystemReader

    original = _attribute(FileSystemReader, "read_data")
    target = os.path.realpath(directory)

    @functools.wraps(original)
    def read_data(self, plan, planner):
        if os.path.realpath(_attribute(self, "path")) != target:
            return original(self, plan, planner)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            name, offset, length = storage_location(_attribute(self, "storage_data")[item.storage_index])
            wanted.setdefault(name, []).append((offset, length))
        fs = _attribute(self, "fs")
        self.fs = _RoutedFileSystem(fs, target, wanted, open_stream)
        try:
            return original(self, plan, planner)
        finally:
            self.fs = fs

    FileSystemReader.read_data = read_data
    try:
        yield
    finally:
        FileSystemReader.read_data = original


class _RoutedFileSystem:
    """A FileSystemReader's ``fs`` for one ``read_data``: the opens ``open_stream`` takes, the rest as before."""
    def __init__(self, fs: Any, directory: str, wanted: dict[str, list[tuple[int, int]]],
                 open_stream: Callable[[str, list[tuple[int, int]]], Any]):
        self._fs, self._directory, self._wanted, self._open = fs, directory, wanted, open_stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        name, stream = os.path.basename(path), None
        if mode == "rb" and os.path.realpath(os.path.dirname(path)) == self._directory:
            stream = self._open(name, self._wanted.get(name, []))
        return self._fs.create_stream(path, mode) if stream is None else stream  # a stream is its own context


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
    for step, expected in AGENT_STEPS.items():
        method = getattr(LocalElasticAgent, step, None)
        if method is None:
            raise TorchSeamError(f"LocalElasticAgent has no {step}() to override")
        parameters = tuple(inspect.signature(method).parameters)[1:]
        if parameters != expected:
            raise TorchSeamError(f"LocalElasticAgent.{step} takes {parameters}, not {expected}")


_check_installed_torch()
