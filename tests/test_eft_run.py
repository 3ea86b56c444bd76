"""eft-run as a drop-in torchrun: environment parity, etcd-v3 rendezvous, bad input."""

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from bench.launch import WORKERS, Launched, eft_run, torchrun, wait_for
from elasticft.contract.keys import RunKeys
from elasticft.store import free_port

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE")
# Values that differ between any two launches (ids, ports, paths of error files).
PER_LAUNCH = ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")


def probe_envs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("env-*.json"))]


def launcher_vars(env: dict) -> set[str]:
    """What the launcher added to the worker's environment (minus eft's own)."""
    return {k for k in env if k not in os.environ and not k.startswith("EFT_")} - {"ALL_REDUCE_SUM"}


def rank_table(envs: list[dict]) -> list[tuple]:
    return sorted(tuple(e[v] for v in RANK_VARS) for e in envs)


def run_nodes(cmds: list[list[str]], tmp: Path, timeout: float = 120) -> None:
    nodes = [Launched(cmd, tmp / f"node{i}.log") for i, cmd in enumerate(cmds)]
    try:
        for node in nodes:
            assert node.wait(timeout) == 0, node.output()
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.seam
@pytest.mark.slow
def test_standalone_env_matches_torchrun(tmp_path):
    outputs = {}
    for name, launcher in (("torchrun", torchrun()), ("eft", eft_run())):
        out = tmp_path / name
        out.mkdir()
        cmd = [*launcher, "--standalone", "--nproc-per-node", "2", str(WORKERS / "env_probe.py"), str(out)]
        run_nodes([cmd], out)
        outputs[name] = probe_envs(out)
    torch_envs, eft_envs = outputs["torchrun"], outputs["eft"]
    assert len(torch_envs) == len(eft_envs) == 2
    assert [launcher_vars(e) for e in torch_envs] == [launcher_vars(e) for e in eft_envs]
    assert rank_table(torch_envs) == rank_table(eft_envs)
    for env in eft_envs:
        assert env["EFT_RUN_ID"] == env["TORCHELASTIC_RUN_ID"]
        assert env["EFT_ENDPOINT"].startswith("127.0.0.1:")
        assert env["ALL_REDUCE_SUM"] == "3.0"


@pytest.mark.slow
def test_two_agents_on_one_etcd_match_torchrun_c10d(tmp_path, etcd_server):
    def two_nodes(launcher, backend, endpoint, out):
        out.mkdir()
        run_id = uuid.uuid4().hex
        cmd = [*launcher, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", backend,
               "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, str(WORKERS / "env_probe.py"), str(out)]
        run_nodes([cmd, cmd], out)
        return probe_envs(out)

    torch_envs = two_nodes(torchrun(), "c10d", f"127.0.0.1:{free_port()}", tmp_path / "c10d")
    eft_envs = two_nodes(eft_run(), "etcd-v3", etcd_server.endpoint, tmp_path / "eft")
    plain_envs = two_nodes(torchrun(), "etcd-v3", etcd_server.endpoint, tmp_path / "plain")
    assert rank_table(torch_envs) == rank_table(eft_envs) == rank_table(plain_envs)
    assert launcher_vars(torch_envs[0]) == launcher_vars(eft_envs[0])
    # Both ranks joined one gloo group: 1 + 2 on every rank.
    assert {e["ALL_REDUCE_SUM"] for e in eft_envs + plain_envs} == {"3.0"}
    assert {e["EFT_ENDPOINT"] for e in eft_envs} == {etcd_server.endpoint}


def eft_error(args: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*eft_run(), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("eft-run: error:"), result.stderr
    for needle in needles:
        assert needle in last, last


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nnodes", "3:2"], "--nnodes"),
        (["--rdzv-conf", "join_timeout"], "--rdzv-conf"),
        (["--rdzv-conf", "lease_tll=3"], "lease_tll"),
        (["--rdzv-conf", "lease_ttl=soon"], "lease_ttl"),
        # A lease too short for --eft-lease-ttl is too short for --rdzv-conf as well.
        (["--rdzv-conf", "lease_ttl=0.2"], "lease_ttl must be >= 1"),
        (["--eft-lease-ttl", "0.2"], "--eft-lease-ttl"),
        (["--eft-inject", "gpu_melt:1@3"], "--eft-inject"),
        (["--eft-straggler-action", "kick"], "--eft-straggler-action"),
        (["--eft-straggler-relative", "1.5"], "--eft-straggler-relative"),
        (["--eft-suspect-action", "kick"], "--eft-suspect-action"),
        (["--eft-spike-min-history", "50"], "--eft-spike-min-history"),
        (["--eft-rerun-tolerance", "-1"], "--eft-rerun-tolerance"),
        # A node id names an etcd key and files: no '/', no spaces, no leading dot.
        (["--eft-node-id", "rack1/node2"], "--eft-node-id"),
        (["--eft-node-id", "node 2"], "--eft-node-id"),
        (["--eft-node-id", ".."], "--eft-node-id"),
    ],
)
def test_bad_input_gives_one_clear_line(tmp_path, args, needle, capfd):
    """eft-run's entry called as its console script calls it, in this process (an eft-run per
    case would pay torch's import each time; test_bad_eft_variable_names_it and
    tests/test_new_user.py run the command itself)."""
    from launcher import eft_run as launch

    handlers = list(launch.log.handlers)
    try:
        with pytest.raises(SystemExit) as stopped:
            launch.main(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", *args,
                         str(WORKERS / "env_probe.py"), str(tmp_path)])
    finally:
        launch.log.handlers[:] = handlers  # the launch set up its log as eft-run does
    assert_one_line_error(subprocess.CompletedProcess(args, stopped.value.code, "", capfd.readouterr().err), needle)


def test_bad_eft_variable_names_it(tmp_path):
    result = eft_error(["--standalone", str(WORKERS / "env_probe.py"), str(tmp_path)], env={"EFT_LEASE_TTL": "abc"})
    assert_one_line_error(result, "EFT_LEASE_TTL")


def etcd_leftovers(tmp: Path) -> tuple[list[str], list[str]]:
    """Embedded etcd data dirs under ``tmp`` and etcd processes still using them."""
    dirs = [str(p) for p in tmp.glob("eft-etcd-*")]
    procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(tmp) in cmdline and "etcd" in cmdline and "eft-run" not in cmdline:
                procs.append(pid)
    return dirs, procs


@pytest.mark.parametrize("how", ["finish", "sigint", "sigkill"])
def test_embedded_etcd_leaves_nothing_behind(tmp_path, how, eft_job):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    node = eft_job("allreduce_loop.py", out, standalone=True, env={"TMPDIR": str(tmpdir)})
    wait_for(lambda: (out / "starts.jsonl").exists(), 60, "the worker to start")
    assert etcd_leftovers(tmpdir)[0], "the embedded etcd should use a data dir under TMPDIR"
    if how == "sigkill":  # nothing of the launcher's runs: the kernel's death signal stops etcd
        node.proc.kill()
        node.wait(60)
        wait_for(lambda: not etcd_leftovers(tmpdir)[1], 30, "the embedded etcd to die with its launcher")
        return
    if how == "sigint":
        node.proc.send_signal(signal.SIGINT)
        assert node.wait(60) != 0
    else:
        (out / "finish").touch()
        assert node.wait(60) == 0, node.output()
    # The launcher's own output (workers' lines carry a [rankN] prefix).
    assert not [line for line in node.output().splitlines() if line.startswith("Traceback")]
    assert etcd_leftovers(tmpdir) == ([], [])




def redundant_pids(etcd, keys: RunKeys) -> set[int]:
    """The pids of the agents waiting beyond --nnodes' maximum: their participant keys in
    round 1 (round 0 formed full), named ``<addr>_<pid>_<n>`` as torch names a node."""
    return {int(key.rsplit("/", 1)[1].split("_")[-2]) for key in etcd.keys_with_prefix(keys.rdzv_participants(1))}


@pytest.mark.slow
def test_a_node_turned_away_as_redundant_exits_cleanly_when_the_job_ends(tmp_path, eft_job, etcd, run_keys):
    """torch puts a node that arrives when --nnodes' maximum is reached on its redundancy
    list; when the job ends, its rendezvous exits gracefully and torch's run returns
    nothing. The agent must turn that into a clean exit, not an AttributeError."""
    out = tmp_path / "out"
    out.mkdir()
    working = eft_job("allreduce_loop.py", out, nodes="1:1", name="working")
    wait_for(lambda: (out / "starts.jsonl").exists(), 60, "the first node's worker")
    redundant = eft_job("allreduce_loop.py", out, nodes="1:1", name="redundant")
    wait_for(lambda: redundant.proc.pid in redundant_pids(etcd, run_keys), 60, "the second node to be turned away")
    (out / "finish").touch()
    assert working.wait(60) == 0, working.output()
    assert redundant.wait(60) == 0, redundant.output()
    assert "Traceback" not in redundant.output(), redundant.output()
