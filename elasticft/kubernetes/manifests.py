"""The Kubernetes objects that run an eft job: its etcd, the JobSet of its nodes, a PodMonitor.

``eft kubernetes render`` prints them; ``schemas.py`` checks them against the released
schemas. The pods' side is fixed by ``pod.py``: the container gets every ``DOWNWARD_API``
variable, and its command is only ``eft-run --nproc-per-node N`` and the user's words, since
eft-run derives the rest (rendezvous, node count, address) from those variables.

Failures, and who handles them (``ExitCode`` is eft-run's status):

- a pod lost (exit 1, a signal, its node gone): the Job replaces it, counted against
  ``backoffLimit``; the other pods train on and eft re-forms the job around the new one;
- a pod evicted or preempted (condition DisruptionTarget), or eft saved and stopped for a
  preemption (``ExitCode.REQUEUE``): replaced, not counted;
- bad input or no progress (``ExitCode.USAGE``, ``ExitCode.NO_PROGRESS``): the Job fails
  through its podFailurePolicy, and the JobSet with it: restarting would fail the same way;
- a Job out of ``backoffLimit``: the JobSet recreates every Job, up to ``maxRestarts`` times.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from elasticft.config.knobs import env_name
from elasticft.contract.exit_codes import ExitCode
from elasticft.kubernetes.etcd_manifests import DEFAULT_IMAGE as DEFAULT_ETCD_IMAGE
from elasticft.kubernetes.etcd_manifests import etcd_objects
from elasticft.kubernetes.extra import require
from elasticft.kubernetes.pod import ANNOTATION, DOWNWARD_API, PodEnv, etcd_service

CONTAINER = "eft"  # the podFailurePolicy's exit-code rules name it
METRICS_PORT_NAME = "metrics"  # the PodMonitor scrapes the port by this name
APP_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
JOBSET_NAME_LABEL = f"{ANNOTATION}jobset-name"  # JobSet puts it on every pod of the JobSet (a label too)
LABEL_MAX = 63  # a DNS label, hence a Service, a pod hostname, a label value
# A StatefulSet's pods carry the label controller-revision-hash "<statefulset>-<hash of up to
# 10 characters>", a label value of at most 63: so its name is at most 52 characters.
STATEFULSET_NAME_MAX = 52
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass
class ManifestSpec:
    """What ``eft kubernetes render`` was asked for; checked when made (ValueError naming the flag)."""

    name: str  # the JobSet's name, and the prefix of every other object's
    nodes: int  # Jobs of the replicated job, one pod (one node's eft-run) each
    nproc_per_node: int  # eft-run's --nproc-per-node: workers (GPUs used) per pod
    image: str  # the training container's image: eft installed beside the training code
    # after `eft-run --nproc-per-node N`: extra eft-run flags, then the script and its arguments
    command: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None  # nvidia.com/gpu asked per pod; None: nproc_per_node, 0: none
    namespace: str | None = None  # every object's namespace; None: kubectl's current one
    # host:port of an etcd eft-run should use instead of its own (no etcd objects then)
    etcd_endpoint: str | None = None
    etcd_members: int = 3  # members of the job's own etcd: 3 survive a lost member
    etcd_image: str = DEFAULT_ETCD_IMAGE
    metrics_port: int | None = 9400  # each agent's /metrics; 0 or None: off, and no PodMonitor
    max_restarts: int = 3  # JobSet restarts (every Job recreated) once a Job is out of pod replacements
    pod_replacements: int = 100  # each Job's backoffLimit: its pod replaced after a failure
    termination_grace: int = 120  # seconds between SIGTERM and SIGKILL: eft saves on SIGTERM
    replicated_job: str = "node"  # the replicated job's name, part of every pod's hostname
    env: dict[str, str] = field(default_factory=dict)  # more variables for the training container

    def __post_init__(self) -> None:
        for label, flag in ((self.name, "--name"), (self.replicated_job, "--replicated-job")):
            if not _DNS_1035.fullmatch(label) or len(label) > LABEL_MAX:
                raise ValueError(f"{flag}: expected a DNS label (lowercase letters, digits and '-', starting "
                                 f"with a letter, at most {LABEL_MAX} characters), got {label!r}")
        if self.nodes < 1:
            raise ValueError(f"--nodes: expected a count >= 1, got {self.nodes}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node: expected a count >= 1, got {self.nproc_per_node}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node: expected a count >= 0, got {self.gpus_per_node}")
        if self.etcd_members not in (1, 3, 5, 7):
            raise ValueError(f"--etcd-members: expected an odd count from 1 to 7, got {self.etcd_members}")
        if self.metrics_port and not 1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: expected a port 1-65535 (0: off), got {self.metrics_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts: expected a count >= 0, got {self.max_restarts}")
        if not self.image:
            raise ValueError("--image: expected the training container's image, got nothing")
        if not self.command:
            raise ValueError("--: expected the training script (and its arguments) after --")
        self._check_name_lengths()

    def _check_name_lengths(self) -> None:
        """Kubernetes names made from ``--name`` must stay DNS labels: the last pod's hostname
        and, with the job's own etcd, its StatefulSet's name (``STATEFULSET_NAME_MAX``)."""
        limit = LABEL_MAX - (len(self.pod_hostname(self.nodes - 1)) - len(self.name))
        if self.etcd_endpoint is None:
            limit = min(limit, STATEFULSET_NAME_MAX - (len(etcd_service(self.name)) - len(self.name)))
        if len(self.name) > limit:
            made = [self.pod_hostname(self.nodes - 1)] + ([] if self.etcd_endpoint else [etcd_service(self.name)])
            raise ValueError(f"--name: at most {limit} characters for {self.nodes} nodes"
                             f"{'' if self.etcd_endpoint else ' and their etcd'}, got {len(self.name)} (names made "
                             f"from it, such as {' and '.join(made)}, must stay DNS labels)")

    def pod_hostname(self, job_index: int) -> str:
        """The hostname JobSet gives the pod of Job ``job_index``: ``<jobset>-<replicated job>-<job>-<pod>``."""
        return f"{self.name}-{self.replicated_job}-{job_index}-0"

    @property
    def metrics_on(self) -> bool:
        return bool(self.metrics_port)

    @property
    def labels(self) -> dict[str, str]:
        """On every object: which tool made it, for which job."""
        return {APP_LABEL: "eft", INSTANCE_LABEL: self.name}


def render(spec: ManifestSpec) -> list[dict]:
    """Every object of the job, in the order ``kubectl apply`` should meet them: etcd first."""
    objects = [] if spec.etcd_endpoint else etcd_objects(
        spec.name, spec.etcd_members, spec.etcd_image, spec.namespace, spec.labels)
    objects.append(jobset(spec))
    if spec.metrics_on:
        objects.append(pod_monitor(spec))
    return objects


def jobset(spec: ManifestSpec) -> dict:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            # each pod a stable hostname, resolvable before it is ready (rank 0's store address)
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All"},
            "failurePolicy": {
                "maxRestarts": spec.max_restarts,
                "restartStrategy": "Recreate",
                "rules": [{"name": "stop-on-eft-verdict", "action": "FailJobSet",
                           "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [{"name": spec.replicated_job, "replicas": spec.nodes,
                                "template": {"metadata": {"labels": spec.labels}, "spec": job_spec(spec)}}],
        },
    }


def job_spec(spec: ManifestSpec) -> dict:
    """One node's Job: one pod, replaced on failure (see the module's docstring for which count)."""
    def exit_codes(*codes: ExitCode) -> dict:
        return {"containerName": CONTAINER, "operator": "In", "values": [int(c) for c in codes]}

    return {
        "parallelism": 1, "completions": 1, "completionMode": "Indexed",
        "backoffLimit": spec.pod_replacements,
        # a new pod only once the old one has ended: never two eft-runs for one node
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": exit_codes(ExitCode.USAGE, ExitCode.NO_PROGRESS)},
            {"action": "Ignore", "onExitCodes": exit_codes(ExitCode.REQUEUE)},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"metadata": {"labels": spec.labels}, "spec": pod_spec(spec)},
    }


def pod_spec(spec: ManifestSpec) -> dict:
    return {
        "restartPolicy": "Never",  # a podFailurePolicy requires it: the Job replaces the pod
        "terminationGracePeriodSeconds": spec.termination_grace,
        "containers": [container(spec)],
        # torch's data loader workers and NCCL share memory through /dev/shm: 64 MB by default
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def container(spec: ManifestSpec) -> dict:
    gpus = spec.nproc_per_node if spec.gpus_per_node is None else spec.gpus_per_node
    body: dict = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["eft-run", "--nproc-per-node", str(spec.nproc_per_node), *spec.command],
        "env": container_env(spec),
    }
    if spec.metrics_on:
        body["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": spec.metrics_port, "protocol": "TCP"}]
    if gpus:
        body["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    body["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return body


def container_env(spec: ManifestSpec) -> list[dict]:
    env = [{"name": str(var), "valueFrom": {"fieldRef": {"fieldPath": path}}} for var, path in DOWNWARD_API.items()]
    if spec.etcd_endpoint:
        env.append({"name": str(PodEnv.ETCD_SERVICE), "value": spec.etcd_endpoint})
    if spec.metrics_on:
        env.append({"name": env_name("metrics_port"), "value": str(spec.metrics_port)})
    env += [{"name": k, "value": v} for k, v in spec.env.items()]
    return env


def pod_monitor(spec: ManifestSpec) -> dict:
    """Prometheus (through prometheus-operator) scrapes every agent of the JobSet."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": _metadata(spec, spec.name),
        "spec": {
            "selector": {"matchLabels": {JOBSET_NAME_LABEL: spec.name}},
            "podMetricsEndpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics"}],
        },
    }


def to_yaml(objects: list[dict], command_line: str) -> str:
    """One multi-document YAML, headed by the command that made it (run it again to regenerate)."""
    yaml = require("yaml")  # the kubernetes extra's: eft itself runs without it

    class PlainDumper(yaml.SafeDumper):
        """``safe_dump_all``'s dumper, without anchors: a dict used twice (the labels) is written
        out twice, as a person would write it, not as ``&id001`` and ``*id001``."""

        def ignore_aliases(self, data: object) -> bool:
            return True

    header = f"# Rendered by `eft kubernetes render`; regenerate with:\n#   {command_line}\n"
    return header + yaml.dump_all(objects, Dumper=PlainDumper, sort_keys=False, explicit_start=True, width=120)


def _metadata(spec: ManifestSpec, name: str) -> dict:
    return {"name": name, **({"namespace": spec.namespace} if spec.namespace else {}), "labels": spec.labels}
