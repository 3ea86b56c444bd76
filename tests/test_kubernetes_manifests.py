"""``eft kubernetes render`` and ``validate``: the manifests of an eft job on Kubernetes are
valid against the released schemas (strictly), keep the pod contract eft-run reads, map eft's
exit codes to the Job's failure policy, and the committed example is what the command renders.

Fast: no cluster; the schemas load once per process (elasticft/kubernetes/schemas.py).
"""

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from elasticft.contract.exit_codes import ExitCode
from elasticft.kubernetes import schemas
from elasticft.kubernetes.manifests import ManifestSpec, render
from elasticft.kubernetes.pod import DOWNWARD_API, JobSetPod, PodEnv
from launcher.cli import app

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
EXAMPLE = ROOT / "examples" / "kubernetes" / "jobset.yaml"


def eft(*args: str):
    return CliRunner().invoke(app, list(args))


def kinds(objects: list[dict]) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in objects]


def of_kind(objects: list[dict], kind: str) -> dict:
    return next(o for o in objects if o["kind"] == kind)


def job_of(objects: list[dict]) -> dict:
    return of_kind(objects, "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]


def container_of(objects: list[dict]) -> dict:
    return job_of(objects)["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path):
    result = eft("kubernetes", "validate", str(path))
    assert result.exit_code == 0, result.output
    assert "objects valid against Kubernetes 1.36, JobSet v0.12.0" in result.output


def test_the_example_is_what_its_header_command_renders_today(tmp_path):
    text = EXAMPLE.read_text()
    command = shlex.split(text.splitlines()[1].lstrip("# "))
    assert command[:3] == ["eft", "kubernetes", "render"]
    args = command[1:]
    where = args.index("--output") + 1
    original, args[where] = args[where], str(tmp_path / "jobset.yaml")
    result = eft(*args)
    assert result.exit_code == 0, result.output
    rendered = (tmp_path / "jobset.yaml").read_text().replace(args[where], original)
    assert rendered == text, "examples/kubernetes/jobset.yaml drifted: run the command in its header again"


SIZES = {
    "1 node, an etcd of the user's": ["--name", "tiny", "--nodes", "1", "--etcd-endpoint", "etcd.infra:2379"],
    "4 nodes, 1 etcd member": ["--name", "small", "--nodes", "4", "--etcd-members", "1"],
    "2048 nodes": ["--name", "big", "--nodes", "2048"],
    "a 40-character name": ["--name", "a" * 39 + "z", "--nodes", "16"],
}


@pytest.mark.parametrize("flags", SIZES.values(), ids=SIZES.keys())
def test_other_names_and_sizes_validate(flags, tmp_path):
    out = tmp_path / "job.yaml"
    made = eft("kubernetes", "render", *flags, "--nproc-per-node", "8", "--image", "registry/train:1",
               "--output", str(out), "--", "--nnodes", "1:4", "train.py", "--lr", "1e-4")
    assert made.exit_code == 0, made.output
    objects = list(yaml.safe_load_all(out.read_text()))
    assert schemas.validate(objects) == []
    checked = eft("kubernetes", "validate", str(out))
    assert checked.exit_code == 0 and f"{len(objects)} objects valid" in checked.output, checked.output
    name = flags[1]
    if "--etcd-endpoint" in flags:
        assert kinds(objects) == [f"JobSet/{name}", f"PodMonitor/{name}"]
        assert {"name": "EFT_ETCD_SERVICE", "value": "etcd.infra:2379"} in container_of(objects)["env"]
    else:
        assert kinds(objects) == [f"Service/{name}-etcd-peers", f"StatefulSet/{name}-etcd", f"Service/{name}-etcd",
                                  f"JobSet/{name}", f"PodMonitor/{name}"]


def test_etcd_client_service_is_the_endpoint_eft_run_defaults_to():
    objects = render(ManifestSpec("gpt", 4, 8, "img", ["train.py"], etcd_members=3))
    pod = JobSetPod.from_environ({PodEnv.JOBSET_NAME: "gpt"})
    service = objects[2]
    assert f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}" == pod.etcd_endpoint
    command = of_kind(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"]
    cluster = command[command.index("--initial-cluster") + 1].split(",")
    assert cluster == [f"gpt-etcd-{i}=http://gpt-etcd-{i}.gpt-etcd-peers:2380" for i in range(3)]
    assert of_kind(objects, "StatefulSet")["spec"]["replicas"] == 3


def test_an_unknown_field_deep_in_the_pod_and_a_wrong_type_are_reported_by_object_and_path():
    objects = render(ManifestSpec("gpt", 4, 8, "img", ["train.py"]))
    misspelt = copy.deepcopy(objects)
    container_of(misspelt)["imagePullPolicyy"] = "Always"
    problems = schemas.validate(misspelt)
    assert problems and all(p.startswith("JobSet/gpt: spec.replicatedJobs[0].template.spec.template.spec."
                                         "containers[0]: ") for p in problems), problems
    assert "imagePullPolicyy" in problems[0]

    beside_the_pod = copy.deepcopy(objects)  # where only JobSet's CRD knows the fields
    of_kind(beside_the_pod, "JobSet")["spec"]["failurePolicy"]["maxRestartz"] = 3
    assert schemas.validate(beside_the_pod) == ["JobSet/gpt: spec.failurePolicy: Additional properties are not "
                                                "allowed ('maxRestartz' was unexpected)"]

    wrong_type = copy.deepcopy(objects)
    of_kind(wrong_type, "JobSet")["spec"]["replicatedJobs"][0]["replicas"] = "four"
    problems = schemas.validate(wrong_type)
    assert problems == ["JobSet/gpt: spec.replicatedJobs[0].replicas: 'four' is not of type 'integer'"]


def test_validate_exits_1_and_prints_each_problem(tmp_path):
    objects = render(ManifestSpec("gpt", 2, 8, "img", ["train.py"]))
    of_kind(objects, "StatefulSet")["spec"]["replicass"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    result = eft("kubernetes", "validate", str(path))
    assert result.exit_code == 1
    assert "StatefulSet/gpt-etcd: spec: Additional properties are not allowed ('replicass'" in result.output


def test_an_unknown_kind_is_a_problem():
    problems = schemas.validate([{"apiVersion": "jobset.x-k8s.io/v1alpha1", "kind": "JobSet",
                                  "metadata": {"name": "old"}, "spec": {}}])
    assert problems == ["JobSet/old: apiVersion: no schema vendored for jobset.x-k8s.io/v1alpha1 JobSet "
                        "(served: jobset.x-k8s.io/v1alpha2)"]


def test_the_pod_gets_the_contracts_variables_and_only_eft_runs_command():
    objects = render(ManifestSpec("gpt", 4, 8, "img", ["--nnodes", "2:4", "train.py", "--lr", "1"]))
    container = container_of(objects)
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert downward == {str(k): v for k, v in DOWNWARD_API.items()}
    assert container["command"] == ["eft-run", "--nproc-per-node", "8", "--nnodes", "2:4", "train.py", "--lr", "1"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "EFT_METRICS_PORT", "value": "9400"} in container["env"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]


def test_metrics_port_0_turns_metrics_and_the_pod_monitor_off():
    objects = render(ManifestSpec("gpt", 4, 8, "img", ["train.py"], metrics_port=0, gpus_per_node=0))
    assert "PodMonitor" not in [o["kind"] for o in objects]
    container = container_of(objects)
    assert "ports" not in container and "resources" not in container
    assert not any(e["name"] == "EFT_METRICS_PORT" for e in container["env"])


def test_eft_runs_exit_codes_decide_the_jobs_and_the_jobsets_fate():
    objects = render(ManifestSpec("gpt", 4, 8, "img", ["train.py"]))
    job = job_of(objects)
    by_action: dict[str, set] = {}
    for rule in job["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container_of(objects)["name"]
            by_action.setdefault(rule["action"], set()).update(rule["onExitCodes"]["values"])
    assert by_action == {"FailJob": {ExitCode.USAGE, ExitCode.NO_PROGRESS}, "Ignore": {ExitCode.REQUEUE}}
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in \
        job["podFailurePolicy"]["rules"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    policy = of_kind(objects, "JobSet")["spec"]["failurePolicy"]
    assert [(r["action"], r["onJobFailureReasons"]) for r in policy["rules"]] == [("FailJobSet", ["PodFailurePolicy"])]


@pytest.mark.parametrize("flags, named", [
    (["--name", "gpt", "--nodes", "0"], "--nodes"),
    (["--name", "Gpt", "--nodes", "2"], "--name"),
    (["--name", "g" * 48, "--nodes", "2"], "--name"),
    (["--name", "g" * 30, "--nodes", "2", "--etcd-members", "2"], "--etcd-members"),
    (["--name", "gpt", "--nodes", "two"], "--nodes"),
], ids=["0 nodes", "uppercase name", "too long name", "even etcd", "not a number"])
def test_render_mistakes_are_one_line_naming_the_flag(flags, named):
    result = eft("kubernetes", "render", *flags, "--nproc-per-node", "8", "--image", "img", "--", "train.py")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eft kubernetes render: ") and named in lines[0], lines


@pytest.mark.parametrize("content", ["kind: [Service\n", None], ids=["not YAML", "missing"])
def test_validate_on_a_file_it_cannot_read_is_one_line(tmp_path, content):
    path = tmp_path / "manifest.yaml"
    if content is not None:
        path.write_text(content)
    result = eft("kubernetes", "validate", str(path))
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eft kubernetes validate: {path}: "), lines


def test_render_piped_into_validate():
    """``eft kubernetes render ... | eft kubernetes validate -``, as ``kubectl apply -f -`` reads it."""
    made = eft("kubernetes", "render", "--name", "piped", "--nodes", "3", "--nproc-per-node", "2", "--image", "img",
               "--", "train.py")
    assert made.exit_code == 0, made.output
    checked = CliRunner().invoke(app, ["kubernetes", "validate", "-"], input=made.output)
    assert checked.exit_code == 0 and "5 objects valid" in checked.output, checked.output
    broken = re.sub(r"(\n *)restartPolicy: Never", r"\1restartPolicy: Never\1restartPolicyy: Never", made.output)
    rejected = CliRunner().invoke(app, ["kubernetes", "validate", "-"], input=broken)
    assert rejected.exit_code == 1 and "JobSet/piped" in rejected.output and "restartPolicyy" in rejected.output
