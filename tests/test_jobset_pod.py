"""eft-run in a JobSet pod: what it derives from the pod's variables, and what a flag keeps.

The variables are those the rendered pod spec sets (elasticft/kubernetes/pod.py's
DOWNWARD_API); eft-run's own parser reads the flags, as a pod's launch line would be read.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticft.contract.argv import TORCHRUN_DEFAULTS
from elasticft.kubernetes.defaults import derive
from elasticft.kubernetes.pod import DOWNWARD_API, JobSetPod, PodEnv
from launcher.eft_run import build_parser

POD = {
    PodEnv.JOBSET_NAME: "gpt", PodEnv.JOBSET_UID: "5d2c1a9e-8f7b-4c3d-9e1f-0a2b3c4d5e6f",
    PodEnv.RESTART_ATTEMPT: "2", PodEnv.REPLICAS: "128", PodEnv.JOB_INDEX: "7",
    PodEnv.POD_NAME: "gpt-node-7-0-x4k2p", PodEnv.POD_IP: "10.4.7.21",
}


def launch_line(*flags: str, environ: dict | None = None):
    args = build_parser().parse_args([*flags, "pretrain_gpt.py", "--lr", "1e-4"])
    derived = derive(args, JobSetPod.from_environ(POD), node_id_set=False, environ=environ or {})
    return args, derived


def test_the_bare_launch_line_takes_run_size_etcd_address_and_name_from_the_pod():
    args, derived = launch_line("--nproc-per-node", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("etcd-v3", "gpt-etcd:2379")
    assert args.rdzv_id == "k8s-gpt-5d2c1a9e-r2" and args.nnodes == "128" and args.local_addr == "10.4.7.21"
    assert derived.node_id == "gpt-node-7-0-x4k2p"
    assert derived.describe(JobSetPod.from_environ(POD)) == (
        "JobSet gpt Job 7 attempt 2: --rdzv-id k8s-gpt-5d2c1a9e-r2, --nnodes 128, --rdzv-backend etcd-v3, "
        "--rdzv-endpoint gpt-etcd:2379, --local-addr 10.4.7.21, node id gpt-node-7-0-x4k2p")


def test_a_flag_or_a_pet_variable_wins_over_the_pod():
    args, derived = launch_line("--nnodes", "64:128", "--rdzv-id", "mine", "--rdzv-endpoint", "etcd.infra:2379",
                                "--rdzv-backend", "etcd-v3", environ={"PET_LOCAL_ADDR": "x"})
    assert (args.nnodes, args.rdzv_id, args.rdzv_endpoint) == ("64:128", "mine", "etcd.infra:2379")
    assert args.local_addr is None and "local_addr" not in derived.flags  # PET_LOCAL_ADDR: torchrun reads it


def test_an_existing_etcd_is_named_by_its_service_and_the_restarts_make_new_runs():
    pod = JobSetPod.from_environ({**POD, PodEnv.ETCD_SERVICE: "etcd-client.infra"})
    assert pod.etcd_endpoint == "etcd-client.infra:2379"
    assert JobSetPod.from_environ({**POD, PodEnv.ETCD_SERVICE: "e:32379"}).etcd_endpoint == "e:32379"
    first = JobSetPod.from_environ({**POD, PodEnv.RESTART_ATTEMPT: "0"})
    assert first.run_id != pod.run_id and first.attempt != pod.attempt


def test_outside_a_jobset_nothing_is_read_and_every_variable_is_in_the_pod_spec():
    assert JobSetPod.from_environ({PodEnv.POD_NAME: "x", PodEnv.POD_IP: "10.0.0.1"}) is None
    assert set(DOWNWARD_API) == set(PodEnv) - {PodEnv.ETCD_SERVICE}


@pytest.mark.parametrize("variable", [PodEnv.REPLICAS, PodEnv.JOB_INDEX, PodEnv.RESTART_ATTEMPT])
def test_a_pod_spec_that_fills_a_count_with_something_else_is_one_line_and_exit_2(tmp_path, variable):
    script = tmp_path / "train.py"
    script.write_text("")
    env = {**POD, variable: "$(REPLICAS)", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "launcher.eft_run", "--nproc-per-node", "1", str(script)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    [line] = [l for l in done.stderr.splitlines() if l.strip()]
    assert line.startswith(f"eft-run: error: {variable}: expected a whole number") and "'$(REPLICAS)'" in line


@pytest.mark.seam
def test_the_defaults_a_flag_is_compared_with_are_torchruns_own():
    """A torch whose torchrun changed a default would make eft take a user's flag for unset."""
    parser = build_parser()
    assert {name: parser.get_default(name) for name in TORCHRUN_DEFAULTS} == TORCHRUN_DEFAULTS
