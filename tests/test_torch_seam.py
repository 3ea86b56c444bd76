"""The private torch names eft relies on (elasticft/torch_seam/), against the installed torch.

A torch upgrade that renames or reshapes one of them fails here, in the fast suite,
instead of silently bringing back the bug its workaround exists for. Where it can,
each test checks behaviour through torch's own code (its exit barrier, its launch path,
its rendezvous sanitizer, its error-file reader) rather than only the name.
"""

import inspect
import json
import pickle
import re
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
from packaging.requirements import Requirement
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    _NodeDesc,
    _RendezvousState,
)
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from elasticft import torch_seam, versions
from elasticft.torch_seam import TorchSeamError

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.seam  # the compatibility lanes run it on every torch (.ci/run)


class MemoryBackend(RendezvousBackend):
    """Rendezvous state in memory, lost nodes aged as EtcdRendezvousBackend ages them."""

    def __init__(self, state: _RendezvousState | None = None, lost=(), name: str = "memory"):
        self._name = name
        self.bits = pickle.dumps(state) if state is not None else None
        self.token = 0
        self.lost = set(lost)

    @property
    def name(self) -> str:
        return self._name

    def get_state(self):
        if self.bits is None:
            return None
        return torch_seam.aged_rendezvous_state(self.bits, self.lost), self.token

    def set_state(self, state, token=None):
        swapped = token == self.token or (token is None and self.bits is None)
        if swapped:
            self.bits, self.token = state, self.token + 1
        return torch_seam.aged_rendezvous_state(self.bits, self.lost), self.token, swapped


def dynamic_handler(backend: RendezvousBackend | None = None, max_nodes: int = 2) -> DynamicRendezvousHandler:
    return DynamicRendezvousHandler.from_backend(
        run_id="seam", store=dist.HashStore(), backend=backend or MemoryBackend(), min_nodes=1, max_nodes=max_nodes)


def local_agent(tmp_path) -> LocalElasticAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=dynamic_handler(),
                      entrypoint="true", max_restarts=3)
    return LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))


# -- the versions the seam is checked against ------------------------------------------


def test_the_installed_torch_is_one_eft_is_tested_with():
    """CI runs this module on every torch minor of the range; a newer one runs untested."""
    verdict = versions.judge(versions.TORCH, versions.installed(versions.TORCH))
    assert versions.release(verdict.version) == versions.release(torch.__version__)  # metadata may lack +cu128
    assert verdict.support is versions.Support.TESTED, verdict.line


def test_pyproject_admits_every_build_of_the_supported_torches_and_no_older():
    """pip keeps a container's torch when it satisfies eft's requirement: NGC's pre-release
    builds sort below their release, and there is no upper bound to push a newer torch out."""
    pin, = [Requirement(line) for line in re.findall(r'^\s*"(torch\b[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)]
    oldest = ".".join(map(str, versions.TORCH.oldest))
    for build in (f"{oldest}.0a0+50eac811a6", f"{oldest}.0", "2.11.0a0+eb65b36914", "2.13.0+cpu", "2.15.0",
                  "2.16.0", "3.0.0"):
        assert pin.specifier.contains(build, prereleases=True), build
    for older in ("2.8.0", "2.8.0a0+5228986c39"):
        assert not pin.specifier.contains(older, prereleases=True), older


# -- the agent --------------------------------------------------------------------------


def test_agent_steps_eft_overrides_take_the_parameters_the_seam_expects():
    from elasticft.agent.agent import FTElasticAgent

    for step, parameters in torch_seam.AGENT_STEPS.items():
        assert tuple(inspect.signature(getattr(LocalElasticAgent, step)).parameters)[1:] == parameters
    overridden = {name for name, value in vars(FTElasticAgent).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value)
                  and hasattr(LocalElasticAgent, name)}
    # An override of a torch step the seam does not check would break silently on an upgrade.
    assert overridden <= set(torch_seam.AGENT_STEPS), overridden - set(torch_seam.AGENT_STEPS)
    for step in overridden:  # torch's parameters first; any more must have defaults (torch never passes them)
        parameters = list(inspect.signature(vars(FTElasticAgent)[step]).parameters.values())[1:]
        expected = torch_seam.AGENT_STEPS[step]
        assert tuple(p.name for p in parameters[:len(expected)]) == expected, step
        assert all(p.default is not p.empty for p in parameters[len(expected):]), step


def test_the_shutdown_branch_is_the_shape_of_the_installed_torchs_step():
    takes = tuple(inspect.signature(LocalElasticAgent._shutdown).parameters)[1:]
    assert torch_seam.SHUTDOWN_TAKES_TIMEOUT is torch_seam.SHUTDOWN_SHAPES[takes]
    assert torch_seam.SHUTDOWN_TAKES_TIMEOUT is (versions.release(torch.__version__)[:2] >= (2, 12))


STUBBORN = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (time.sleep({linger}), open(sys.argv[1], 'w').write('saved'),\n"
            "                                           sys.exit(0)))\n"
            "open(sys.argv[1] + '.up', 'w').close()\n"
            "time.sleep(120)\n")


def started_worker(tmp_path, linger: float):
    """A real worker process under torch's process context, that takes ``linger`` s to save
    after SIGTERM (a signalled job's rank writing its checkpoint)."""
    from torch.distributed.elastic.multiprocessing import start_processes

    marker = tmp_path / f"saved-{linger}"
    context = start_processes("seam", sys.executable, {0: ("-c", STUBBORN.format(linger=linger), str(marker))},
                              {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / f"logs-{linger}")))
    up = Path(str(marker) + ".up")
    deadline = time.monotonic() + 60
    while not up.exists() and time.monotonic() < deadline:  # its handler is installed: an event, not a guess
        assert not context.wait(timeout=0.05) or False, "the worker ended before it was up"
    return context, marker


@pytest.mark.parametrize("grace,saves", [(30, True), (1, False)], ids=["long-grace-saves", "short-grace-kills"])
def test_shutdown_gives_the_workers_the_grace_on_every_torch(tmp_path, grace, saves):
    """The grace between the stop signal and SIGKILL is what lets a signalled job save: torch 2.12+
    passes it through its step, older torches through the process context's close."""
    import signal as signals

    agent = local_agent(tmp_path)
    context, marker = started_worker(tmp_path, linger=4)
    agent._pcontext = context
    began = time.monotonic()
    torch_seam.shutdown(agent._shutdown, agent, signals.SIGTERM, grace)
    took = time.monotonic() - began
    assert marker.exists() is saves
    assert (took >= 4) if saves else (took < 4)  # the save took 4 s; a 1 s grace ended it first
    assert "close" not in vars(context)  # the context's own close again


# Records SIGTERM, as eft's hook does, and never acts on it (a rank stuck in a collective).
STUCK = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + '.sigterm', 'w').close())\n"
         "open(sys.argv[1], 'w').close()\n"
         "while True:\n"
         "    time.sleep(60)\n")
# Fails once the stuck rank is up: the group's close then finds it in place.
FAILS = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.01)\nsys.exit(3)\n"


def test_the_workers_left_after_one_failed_get_sigkill_at_once_inside_failure_kills_the_rest(tmp_path):
    """torch's monitor look (the process context's ``wait``/``_poll``) closes the group when one
    worker failed, with SIGTERM and a 30 s grace unless the seam's block gives its ``close`` SIGKILL:
    the stuck rank is killed at once, never sees SIGTERM, and the context's own close comes back."""
    from torch.distributed.elastic.multiprocessing import start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext

    up = tmp_path / "stuck-up"
    context = start_processes("seam", sys.executable, {0: ("-c", STUCK, str(up)), 1: ("-c", FAILS, str(up))},
                              {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    agent = local_agent(tmp_path)
    agent._pcontext = context
    grace = inspect.signature(PContext.close).parameters["timeout"].default
    began = time.monotonic()
    try:
        with torch_seam.failure_kills_the_rest(agent):
            result = context.wait(timeout=grace, period=0.05)
        took = time.monotonic() - began
    finally:
        context.close(signal.SIGKILL)
    assert result is not None and result.failures[1].exitcode == 3
    # Newer torches record the rest's exit after their close (2.15: -SIGKILL); 2.9 reports the first alone.
    assert 0 not in result.failures or result.failures[0].exitcode == -signal.SIGKILL
    assert took < grace / 2, f"{took:.1f} s: torch's close waited its SIGTERM grace"
    assert not Path(str(up) + ".sigterm").exists()
    assert "close" not in vars(context)


def test_worker_envs_filled_reach_the_workers_torchs_agent_starts(tmp_path, monkeypatch):
    """Through torch's own agent and rendezvous: every worker's variables pass the fill, with
    torch's (RANK...) already in them; outside the block, nothing is filled."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    script = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1] + os.environ['LOCAL_RANK'], 'w'))"

    def run(out: Path):
        spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=dynamic_handler(max_nodes=1),
                          entrypoint=sys.executable, args=("-c", script, str(out)), max_restarts=0)
        assert not LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / out.name))).run().is_failed()
        return [json.loads(Path(f"{out}{rank}").read_text()) for rank in (0, 1)]

    seen = []
    with torch_seam.worker_envs_filled(lambda env, local_rank: (seen.append(env["RANK"]),
                                                                 env.update(FILLED=f"r{local_rank}"))):
        filled = run(tmp_path / "filled-")
    assert [env["FILLED"] for env in filled] == ["r0", "r1"] and sorted(seen) == ["0", "1"]
    assert all("FILLED" not in env for env in run(tmp_path / "plain-"))


def test_agent_attributes_read_through_the_seam(tmp_path):
    agent = local_agent(tmp_path)
    assert torch_seam.worker_processes(agent) is None and torch_seam.worker_pids(agent) == {}
    assert torch_seam.remaining_restarts(agent) == 3
    assert torch_seam.rendezvous_store(agent) is None  # set by the first rendezvous
    assert agent.get_worker_group().spec.role == "trainer"  # public: no seam needed for the group
    agent._pcontext = SimpleNamespace(pids=lambda: {0: 4242})
    assert torch_seam.worker_pids(agent) == {0: 4242}
    torch_seam.forget_worker_processes(agent)
    assert torch_seam.worker_processes(agent) is None


def test_exit_barrier_key_is_the_one_torchs_exit_barrier_writes(tmp_path):
    agent = local_agent(tmp_path)
    store = dist.HashStore()
    agent._store, agent._exit_barrier_timeout = store, 5
    agent.get_worker_group().group_world_size = 1
    assert not torch_seam.exit_barrier_reached(store)
    agent._exit_barrier()  # torch's own: what a finished working node does
    assert torch_seam.exit_barrier_reached(store)


def test_a_node_checked_in_at_exit_releases_the_others_waiting_in_torchs_exit_barrier(tmp_path):
    """A signalled node's check-in (eft-run's, after its workers saved) is one torch's own
    barrier counts: the node still there leaves at once, not after its timeout."""
    store = dist.HashStore()
    gone, staying = local_agent(tmp_path / "gone"), local_agent(tmp_path / "staying")
    for agent in (gone, staying):
        agent._store, agent._exit_barrier_timeout = store, 30
        agent.get_worker_group().group_world_size = 2
    torch_seam.check_in_at_exit(gone)
    started = time.monotonic()
    staying._exit_barrier()  # torch's own, as the node the signal did not reach waits
    assert time.monotonic() - started < 10


class Built(Exception):
    def __init__(self, kwargs):
        super().__init__("built")
        self.kwargs = kwargs


def _seam_test_handler(params):
    return dynamic_handler(MemoryBackend(name=params.backend))


def test_agent_class_swapped_makes_torchs_launch_agent_build_ours(tmp_path, monkeypatch):
    rendezvous_handler_registry.register("eft-seam-test", _seam_test_handler)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")  # launch_agent sets it; restored after

    def factory(**kwargs):
        raise Built(kwargs)

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="seam", rdzv_backend="eft-seam-test",
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    with torch_seam.agent_class_swapped(factory), pytest.raises(Built) as built:
        launch_agent(config, "true", ["--flag"])
    assert built.value.kwargs["spec"].args == ("--flag",)
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_subprocess_handlers_build_every_worker_process_torch_starts(tmp_path):
    """Warm workers take the workers' processes through torch's handler factory: it must still
    be the name torch's process context calls, with the keywords the pool's handler takes, and
    a handler's process must still come from ``_popen``."""
    import sys

    import torch.distributed.elastic.multiprocessing.api as mp_api
    from torch.distributed.elastic.multiprocessing import start_processes

    handler_class = torch_seam.subprocess_handler_class()
    params = tuple(inspect.signature(handler_class.__init__).parameters)[1:]
    assert params == torch_seam.SUBPROCESS_HANDLER_PARAMS
    assert tuple(inspect.signature(mp_api.get_subprocess_handler).parameters) == torch_seam.SUBPROCESS_HANDLER_PARAMS
    built = []

    class Recorded(handler_class):
        def _popen(self, args, env):
            built.append((self.local_rank_id, tuple(args)))
            return super()._popen(args, env)

    with torch_seam.subprocess_handlers(lambda **kwargs: Recorded(**kwargs)):
        context = start_processes("seam", sys.executable, {0: ("-c", "pass"), 1: ("-c", "pass")}, {0: {}, 1: {}},
                                  DefaultLogsSpecs(log_dir=str(tmp_path)))
    result = context.wait(timeout=60)
    assert sorted(built) == [(0, (sys.executable, "-c", "pass")), (1, (sys.executable, "-c", "pass"))]
    assert not result.failures and mp_api.get_subprocess_handler is not Recorded


# -- the dynamic rendezvous -----------------------------------------------------------


def test_node_descriptor_and_state_have_the_fields_eft_reads():
    node = _NodeDesc("host-a", 11, 0)
    assert (node.addr, node.pid, node.local_id) == ("host-a", 11, 0)
    assert repr(node) == "host-a_11_0"  # the addr_pid_localid identity membership.py matches
    assert _RendezvousState().last_heartbeats == {}


def state_with(*nodes: _NodeDesc, waiting: bool = False) -> _RendezvousState:
    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for node in nodes:
        state.last_heartbeats[node] = now
        if waiting:
            state.wait_list.add(node)
    return state


def test_aged_rendezvous_state_ages_only_the_lost_nodes():
    lost, alive = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 22, 0)
    state = state_with(lost, alive)
    bits = pickle.dumps(state)
    aged = pickle.loads(torch_seam.aged_rendezvous_state(bits, {("host-a", 11)}))
    assert aged.last_heartbeats[lost] == state.last_heartbeats[lost] - torch_seam.HEARTBEAT_AGE
    assert aged.last_heartbeats[alive] == state.last_heartbeats[alive]
    # Nothing to age: the very same bytes, so that nothing looks changed.
    assert torch_seam.aged_rendezvous_state(bits, set()) is bits
    assert torch_seam.aged_rendezvous_state(bits, {("host-a", 12)}) is bits


def test_aged_rendezvous_state_refuses_a_state_it_does_not_know():
    with pytest.raises(TorchSeamError, match="not a _RendezvousState"):
        torch_seam.aged_rendezvous_state(pickle.dumps({"last_heartbeats": {}}), {("host-a", 11)})


def test_torch_drops_an_aged_node_at_its_next_sync():
    lost, alive = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 22, 0)
    state = state_with(lost, alive, waiting=True)
    assert dynamic_handler(MemoryBackend(state)).num_nodes_waiting() == 2
    assert dynamic_handler(MemoryBackend(state, lost={("host-a", 11)})).num_nodes_waiting() == 1


def test_stop_heartbeats_stops_the_keep_alive_thread_and_leaves_the_rendezvous_open():
    backend = MemoryBackend()
    handler = dynamic_handler(backend)
    before = set(threading.enumerate())
    handler._start_heartbeats()  # what torch does once this node has joined a round
    timers = [t for t in set(threading.enumerate()) - before if t.name.startswith("RendezvousKeepAliveTimer")]
    assert len(timers) == 1
    torch_seam.stop_heartbeats(handler)
    assert not timers[0].is_alive()
    assert backend.bits is None  # nothing written: not closed


def test_rendezvous_round_is_the_round_torch_says_this_node_joined(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no TCP store server for the agents
    handler = DynamicRendezvousHandler.from_backend(
        run_id="seam-round", store=dist.HashStore(), backend=MemoryBackend(), min_nodes=1, max_nodes=1)
    try:
        rounds = []
        for _ in range(2):  # every restart joins the next round
            handler.next_rendezvous()
            rounds.append(torch_seam.rendezvous_round(handler))
    finally:
        torch_seam.stop_heartbeats(handler)
    assert rounds == [0, 1]
    with pytest.raises(TorchSeamError, match="_state_holder"):
        torch_seam.rendezvous_round(object())


def test_a_missing_private_name_fails_loudly_and_names_it():
    with pytest.raises(TorchSeamError, match=r"^torch \S+: object has no attribute '_stop_heartbeats'; "):
        torch_seam.stop_heartbeats(object())


def test_parse_rendezvous_config_is_torchruns():
    assert torch_seam.parse_rendezvous_config(" a=1, b = x=y ") == {"a": "1", "b": "x=y"}
    assert torch_seam.parse_rendezvous_config("") == {}
    for malformed in ("a", "=1", "a=1,,b=2"):
        with pytest.raises(ValueError):
            torch_seam.parse_rendezvous_config(malformed)
