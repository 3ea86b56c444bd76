import os
import sys
import uuid
from pathlib import Path

import pytest

from bench.launch import WORKERS, Launched, eft_run, rdzv_command, shutdown_crash
from elasticft.agent.context import AgentContext
from elasticft.agent.events import EventLog
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.store import EmbeddedEtcd, StoreOptions, connect

# The commands tests run by name (eft, eft-run, python in a SLURM batch script) are those of the
# interpreter under test, as in its activated environment: `.venv/bin/python -m pytest` (README)
# then tests .venv's eft, not another one on PATH.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


@pytest.fixture(scope="session")
def etcd_server():
    """One real etcd for the whole session; tests isolate themselves by run id."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def etcd(etcd_server):
    client = connect(StoreOptions(etcd_server.endpoint))
    yield client
    client.close()


@pytest.fixture
def agent_context(etcd, run_keys, tmp_path):
    """Make a real AgentContext: ``agent_context(node_id, run_dir=None) -> AgentContext``.

    Node ``node_id`` joins this test's run on the session's etcd as an agent does (its
    record under a lease, an event log, a membership watch); its run directory is
    ``run_dir`` or ``tmp_path/<node_id>``. Every context is closed at teardown.
    """
    made: list[AgentContext] = []

    def make(node_id: str, run_dir: Path | None = None) -> AgentContext:
        run_dir = Path(run_dir or tmp_path / node_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        node = NodeLease(etcd, run_keys, NodeRecord(node_id, "host", "host", 1), ttl=3.0)
        made.append(AgentContext(etcd, run_keys, node, EventLog(etcd, run_keys, node_id), Membership(etcd, run_keys),
                                 run_dir))
        return made[-1]

    yield make
    for ctx in made:
        ctx.membership.close()
        ctx.node.close(clean=True)


@pytest.fixture
def run_keys():
    """The etcd keys of this test's own run (a fresh run id); eft_job's nodes join it by default."""
    return RunKeys(uuid.uuid4().hex)


@pytest.fixture
def eft_job(request, tmp_path, run_keys):
    """Start eft-run as one simulated node: ``eft_job(script, *script_args, ...) -> Launched``.

    ``script`` is a worker of tests/workers by name, or a path. By default the node joins
    this test's run (``run_keys``) on the session's etcd with ``--nnodes 1`` and one
    worker, so that calls in one test make nodes of one job; pass ``run_id`` for another
    job. ``standalone=True`` gives the node its own embedded etcd instead. ``launcher``
    replaces ``eft-run`` (a wrapper that takes its arguments). The log is
    ``tmp_path/<name>.log`` (``node0``, ``node1``... by default). Every node still
    running at teardown is killed with its workers.
    """
    started: list[Launched] = []

    def start(script: str | Path, *script_args, nodes: str = "1", nproc: int = 1, endpoint: str | None = None,
              run_id: str | None = None, standalone: bool = False, eft_flags=(), env: dict | None = None,
              launcher: list[str] | None = None, name: str | None = None) -> Launched:
        launcher = launcher or eft_run()
        # How often the agent looks at its workers; pinned, as tests time how soon a failure is seen.
        flags = ["--monitor-interval", "0.1", *map(str, eft_flags)]
        program = [str(WORKERS / script), *map(str, script_args)]
        if standalone:
            cmd = [*launcher, "--standalone", "--nproc-per-node", str(nproc), *flags, *program]
        else:
            endpoint = endpoint or request.getfixturevalue("etcd_server").endpoint
            cmd = rdzv_command(launcher, *program, nnodes=nodes, nproc=nproc, backend="etcd-v3", endpoint=endpoint,
                               run_id=run_id or run_keys.run_id, flags=flags)
        node = Launched(cmd, tmp_path / f"{name or f'node{len(started)}'}.log", env=env)
        started.append(node)
        return node

    yield start
    crashed = []
    for node in started:
        ended_alone = node.proc.poll() is not None
        node.stop()
        sign = shutdown_crash(node.log_path.read_text(errors="replace")) if ended_alone else None
        if sign:
            crashed.append(f"{node.log_path.name}: {sign}")
    # every way an agent ends (done, failed, SIGTERM, excluded, fenced then ended) closes
    # its etcd client with its services' threads still about: none may crash it in gRPC
    assert not crashed, f"an agent crashed on its way out: {crashed}"


# A forked child inherits the parent's memory but none of its threads: a lock one of them
# held (gRPC's pollers and an etcd client's keep-alive, torch's c10d handlers' TCPStore
# servers and timers) stays locked in the child, which can then hang or crash (a gloo rank
# segfaulted in init_process_group in 1 CI run). The modules that fork gloo ranks
# (start_method="fork") run first, before any test has made such a thread; those that
# leave the most behind run last; and they fork through tests/forked.py, which keeps the
# child's garbage collector off what it inherited (a gRPC channel freed in a child aborts it).
RUN_FIRST = ("test_worker_hook.py", "test_worker_memory.py", "test_numerics_worker.py", "test_mem_overlap.py",
             "test_vote_cadence.py")
RUN_LAST = ("test_rendezvous_torch_contract.py",)


# pytest-xdist (README's command: `-n 2`; pyproject: --dist loadgroup) hands each xdist_group
# to one worker, in the order above: every worker runs its share of RUN_FIRST before anything
# else. A module is one group: its module fixtures (a reference run, a model build) are made
# once and its tests keep their order. The modules in SPREAD hold long end-to-end tests that
# each start all they need (etcd, namespaces, agents): one test to a group, so that the
# workers share them out. The SLURM modules are one group: one cluster (the session's
# slurm_cluster fixture would start one per worker).
SPREAD = ("test_chaos.py", "test_partitions.py")
SHARED_GROUPS = {"test_slurm.py": "slurm", "test_slurm_cluster.py": "slurm"}
# A worker takes the next group when it is almost out of work: a group that starts late and
# runs long leaves the other worker idle at the end. The SLURM group is a sixth of the lane
# (about 12 minutes of one worker): it starts right after RUN_FIRST, so that the rest of the
# suite runs beside it (in collection order it started late, and the other worker ran out of
# work minutes before it ended).
START_EARLY = tuple(SHARED_GROUPS)


def _order(item) -> int:
    name = item.path.name
    return 0 if name in RUN_FIRST else 1 if name in START_EARLY else 3 if name in RUN_LAST else 2


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_order)  # stable: the order is otherwise kept
    for item in items:
        if item.path.name not in SPREAD and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(item.path.name, item.path.name)))


def pytest_xdist_node_collection_finished(node, ids):
    """On xdist's controller: each worker's test ids carry their group (``@group``) under
    --dist loadgroup. Where they do not (pytest 9.2 with pytest-xdist 3.8), a module's tests
    would spread over both workers, each making the module's fixtures (two SLURM clusters)."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in nodeid for nodeid in ids):
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not group the tests (pytest "
                                f"{pytest.__version__}): install the pytest pyproject.toml's test extra names")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A private one-host SLURM cluster (nodes n1..n4) for the session; skips where it cannot run."""
    from tests.slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
