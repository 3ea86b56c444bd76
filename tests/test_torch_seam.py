"""The private torch names eft relies on (elasticft/torch_seam.py), against the installed torch.

A torch upgrade that renames or reshapes one of them fails here, in the fast suite,
instead of silently bringing back the bug its workaround exists for. Where it can,
each test checks behaviour through torch's own code (its exit barrier, its launch path,
its rendezvous sanitizer, its error-file reader) rather than only the name.
"""

import inspect
import json
import os
import pickle
import re
import subprocess
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
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    _NodeDesc,
    _RendezvousState,
)
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from elasticft import torch_seam
from elasticft.torch_seam import TorchSeamError

ROOT = Path(__file__).resolve().parent.parent


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


def dynamic_handler(backend: RendezvousBackend | None = None) -> DynamicRendezvousHandler:
    return DynamicRendezvousHandler.from_backend(
        run_id="seam", store=dist.HashStore(), backend=backend or MemoryBackend(), min_nodes=1, max_nodes=2)


def local_agent(tmp_path) -> LocalElasticAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=dynamic_handler(),
                      entrypoint="true", max_restarts=3)
    return LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))


# -- the version the seam was checked against ----------------------------------------


def test_the_torch_pin_and_the_seam_name_the_installed_torch():
    installed = torch.__version__.split("+")[0]
    assert installed.startswith(torch_seam.CHECKED_TORCH + "."), "review elasticft/torch_seam.py for this torch"
    pin, = [Requirement(line) for line in re.findall(r'^\s*"(torch\b[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)]
    assert pin.specifier.contains(torch.__version__, prereleases=True)
    assert not pin.specifier.contains("2.14.0") and not pin.specifier.contains("2.12.0")


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
    for step in overridden:
        assert tuple(inspect.signature(vars(FTElasticAgent)[step]).parameters)[1:] == torch_seam.AGENT_STEPS[step]


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


# -- error files ---------------------------------------------------------------------


def test_error_file_reads_back_through_torchs_process_failure(tmp_path):
    message = "HangDetected: rank 3 has been in section 'step' for 9.0 s"
    path = torch_seam.write_error_file(tmp_path / "hang-3.json", message)
    failure = ProcessFailure(local_rank=3, pid=4242, exitcode=1, error_file=path)
    assert failure.error_file == path and failure.message["message"] == message
    assert abs(failure.timestamp - time.time()) < 60
    report = ChildFailedError("train.py", {3: failure}).format_msg()
    assert re.search(r"error_file: .*hang-3\.json", report) and message in report


# -- the worker's process group (eft report's restart phases) ----------------------------


def test_init_process_group_marks_the_end_of_imports_and_of_the_process_group(tmp_path):
    """Through elasticft.torch_seam: torch's own init_process_group, wrapped, forms a real group."""
    script = (
        "import json, time, torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d\n"
        "from elasticft.worker import phases\n"
        "phases.watch_process_group(); phases.watch_process_group()  # idempotent\n"
        "before = time.time()\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "assert dist.is_initialized() and dist.get_world_size() == 1\n"
        "print(json.dumps({'before': before, 'after': time.time(), 'stamps': phases.stamps(),\n"
        "                  'wrapped': hasattr(dist.init_process_group, 'eft_observed'),\n"
        "                  'one': distributed_c10d.init_process_group is dist.init_process_group}))\n")

    def run(**env) -> dict:
        environ = {k: v for k, v in os.environ.items() if k != "EFT_RUN_DIR"}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env={**environ, **env})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    seen = run(EFT_RUN_DIR=str(tmp_path))
    assert seen["wrapped"] and seen["one"]
    assert seen["before"] <= seen["stamps"]["imports"] <= seen["stamps"]["process_group"] <= seen["after"]
    plain = run()  # plain torchrun: nothing wrapped, nothing marked
    assert not plain["wrapped"] and plain["stamps"] == {}


# -- torch_dist checkpoints: where items lie, and a load that reads them by ranges -------------


def dcp_checkpoint(folder: Path) -> dict:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {f"w{i}": torch.arange(100 * (i + 1), dtype=torch.float32) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(folder), thread_count=1), no_dist=True)
    return state


def test_storage_locations_name_each_items_bytes_in_the_file(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    dcp_checkpoint(tmp_path)
    items = sorted(torch_seam.storage_location(info)
                   for info in FileSystemReader(str(tmp_path)).read_metadata().storage_data.values())
    assert {name for name, _, _ in items} == {"__0_0.distcp"}
    ends = [0] + [offset + length for _, offset, length in items]
    assert [offset for _, offset, _ in items] == ends[:-1]  # back to back, to the end of the file
    assert ends[-1] == (tmp_path / "__0_0.distcp").stat().st_size


def test_a_ranged_read_opens_the_checkpoints_files_through_the_opener_with_its_plans_items(tmp_path):
    import io
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    original = FileSystemReader.read_data
    ours, other = tmp_path / "ours", tmp_path / "other"
    state = dcp_checkpoint(ours)
    dcp_checkpoint(other)
    locations = {k.fqn: torch_seam.storage_location(v)
                 for k, v in FileSystemReader(str(ours)).read_metadata().storage_data.items()}
    opened = []

    def opener(name, wanted):
        opened.append((name, sorted(wanted)))
        return io.BytesIO((ours / name).read_bytes())

    def load(folder: Path, keys: list[str]) -> dict:
        target = {k: torch.empty_like(state[k]) for k in keys}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=FileSystemReader(str(folder)), no_dist=True)
        return target

    with torch_seam.ranged_storage_reads(ours, opener):
        loaded = load(ours, ["w1", "w3"])
        load(other, ["w0"])  # another checkpoint: read as before
        assert FileSystemReader.read_data is not original
    assert FileSystemReader.read_data is original
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    assert opened == [("__0_0.distcp", sorted(locations[k][1:] for k in ("w1", "w3")))]
