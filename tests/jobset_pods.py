"""A JobSet's pods emulated in network namespaces, driven by the manifest eft renders.

No kube-apiserver or kubelet can run here, so this plays their part, and only theirs: the
JobSet, its Jobs' pod failure policy and the command are the rendered manifest's own
(``elasticft/kubernetes/manifests.py``); what runs is the manifest's container command.

    with EmulatedJobSet(render(spec), workdir=tmp_path, slots=4) as js:
        js.start()                     # the etcd members, then one pod per Job, each in a namespace
        js.delete_pod(1)               # its processes SIGKILLed, as when its node dies
        js.delete_pod(1, graceful=True)   # or SIGTERM, SIGKILL after its termination grace
        js.wait_outcome(timeout=120)   # "Completed" or "Failed", as the JobSet's condition

A pod is a namespace of ``bench/netns.py`` with its own address; a replacement pod (the
Job controller's, same Job index) takes a namespace not used before, so it has a new
address and a new name, and keeps the hostname (``<jobset>-<job>-<index>-0``, set in a UTS
namespace of its own). Names resolve as the headless Services make them: the etcd client
Service and every pod's hostname under the JobSet's subdomain, through ``/etc/netns/<ns>/hosts``
(``ip netns exec`` mounts it over ``/etc/hosts``). The variables are the pod spec's: literal
values, and the downward API's fields from the annotations JobSet sets on its pods (its
``labelAndAnnotateObject``). The controllers' rules: a container exit is matched against the
Job's ``podFailurePolicy`` (FailJob fails the Job, Ignore replaces the pod uncounted, no rule
counts it against ``backoffLimit``); a Job failed by its policy fails the JobSet when its
``failurePolicy`` says FailJobSet; the JobSet completes when every Job has (successPolicy All).
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import string
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.launch import Launched, eft_run
from bench.netns import NetnsCluster
from elasticft.store.server import find_etcd

ANNOTATION = "jobset.sigs.k8s.io/"
_FIELD = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")
_EXPANSION = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Pod:
    job_index: int
    name: str
    slot: int  # the namespace it runs in
    launched: Launched
    exit_code: int | None = None
    kill_at: float | None = None  # deleted gracefully: when the kubelet SIGKILLs what is left


@dataclass
class JobState:
    index: int
    failures: int = 0  # counted against backoffLimit
    pods: list[Pod] = field(default_factory=list)
    outcome: str | None = None  # "Complete" or "Failed"
    failed_by_policy: bool = False


class EmulatedJobSet:
    """The pods of one JobSet (the rendered object ``jobset``) on ``slots`` namespaces."""

    def __init__(self, objects: list[dict], workdir: Path, slots: int, uid: str = "0f9e8d7c-6b5a"):
        [self.jobset] = [o for o in objects if o["kind"] == "JobSet"]
        self.name = self.jobset["metadata"]["name"]
        self.uid = uid
        [self.rjob] = self.jobset["spec"]["replicatedJobs"]
        self.job_spec = self.rjob["template"]["spec"]
        [self.container] = self.job_spec["template"]["spec"]["containers"]
        self.etcd_set = next((o for o in objects if o["kind"] == "StatefulSet"), None)
        # The etcd client Service: the one that is not headless (a ClusterIP), in front of the members.
        self.etcd_service = next((o["metadata"]["name"] for o in objects if o["kind"] == "Service"
                                  and o["spec"].get("clusterIP") != "None"), None)
        self.workdir = Path(workdir)
        self.cluster = NetnsCluster(nodes=slots, workdir=workdir, etcd=False)
        self.jobs = [JobState(i) for i in range(self.rjob["replicas"])]
        self.free_slots: list[int] = []
        self.etcd_members: list[tuple[str, int]] = []  # (pod name, slot)
        self.outcome: str | None = None  # the JobSet's: "Completed" or "Failed"
        self.restarts = 0  # the JobSet's restarts (failurePolicy): every pod new after one
        self.history: list[Pod] = []  # every pod made, in order
        # True: replacements wait for ``release`` (an image pull, a node to schedule on)
        self.hold_replacements = False
        self.held: list[JobState] = []

    # -- life --------------------------------------------------------------------------

    def __enter__(self) -> EmulatedJobSet:
        self.cluster.__enter__()
        self.free_slots = list(range(self.cluster.nodes))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.cluster.close()
        finally:
            for ns in self.cluster.node_ns:
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def hostname(self, job_index: int) -> str:
        """What JobSet names the pod's host: ``<jobset>-<replicated job>-<job index>-<pod index>``."""
        return f"{self.name}-{self.rjob['name']}-{job_index}-0"

    @property
    def subdomain(self) -> str:
        return (self.jobset["spec"].get("network") or {}).get("subdomain") or self.name

    def start(self) -> None:
        """The etcd StatefulSet's members, then one pod per Job, as the controllers create them."""
        if self.etcd_set is not None and not self.etcd_members:
            self._start_etcd()
        for job in self.jobs:
            self._create_pod(job)

    def _start_etcd(self) -> None:
        """Every member of the StatefulSet, named ``<set>-<i>`` and resolvable under its
        governing headless Service, each running the manifest's own etcd command."""
        members = self.etcd_set["metadata"]["name"]
        for i in range(self.etcd_set["spec"]["replicas"]):
            self.etcd_members.append((f"{members}-{i}", self.free_slots.pop(0)))
        self._publish()
        [container] = self.etcd_set["spec"]["template"]["spec"]["containers"]
        for name, slot in self.etcd_members:
            fields = {"metadata.name": name, "metadata.namespace": "default", "status.podIP": self.cluster.node_ip(slot)}
            env = _environment(container, fields, {})
            self._run(slot, name, container, self.etcd_set["spec"]["template"]["spec"], env, self.workdir / f"{name}.log")

    # -- pods --------------------------------------------------------------------------

    def _create_pod(self, job: JobState) -> Pod:
        if not self.free_slots:
            raise RuntimeError("no namespace left for a new pod: give EmulatedJobSet more slots")
        slot = self.free_slots.pop(0)
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        name = f"{self.name}-{self.rjob['name']}-{job.index}-0-{suffix}"
        fields = {"metadata.name": name, "metadata.namespace": "default", "status.podIP": self.cluster.node_ip(slot)}
        env = {"JOB_COMPLETION_INDEX": "0", **_environment(self.container, fields, self._annotations(job.index))}
        job.pods.append(Pod(job.index, name, slot, launched=None))  # type: ignore[arg-type]
        self.history.append(job.pods[-1])
        self._publish()
        job.pods[-1].launched = self._run(slot, self.hostname(job.index), self.container,
                                          self.job_spec["template"]["spec"], env, self.workdir / f"{name}.log")
        return job.pods[-1]

    def _run(self, slot: int, host: str, container: dict, pod_spec: dict, env: dict[str, str], log: Path) -> Launched:
        """The container's command in namespace ``slot``: its own hostname (a UTS namespace),
        its emptyDir volumes as fresh tmpfs mounts (a mount namespace), its variables."""
        command = [_expand(part, env) for part in [*container.get("command", []), *container.get("args", [])]]
        if command and command[0] == "eft-run":
            command = [*eft_run(), *command[1:]]  # the image's eft-run: this checkout's
        elif command and command[0] == "etcd":
            command = [find_etcd(""), *command[1:]]  # the image's etcd: this machine's
        empty_dirs = {v["name"] for v in pod_spec.get("volumes", []) if "emptyDir" in v}
        mounts = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs]
        setup = "".join(f'mkdir -p "{path}" && mount -t tmpfs tmpfs "{path}" && ' for path in mounts)
        in_pod = ["unshare", "--uts", "--mount", "sh", "-c", setup + 'hostname "$0" && exec "$@"', host, *command]
        return self.cluster.launch(slot, in_pod, log, env=env)

    def _annotations(self, job_index: int) -> dict[str, str]:
        """What JobSet's controller writes on every pod of a Job (labelAndAnnotateObject)."""
        return {
            f"{ANNOTATION}jobset-name": self.name,
            f"{ANNOTATION}jobset-uid": self.uid,
            f"{ANNOTATION}replicatedjob-name": self.rjob["name"],
            f"{ANNOTATION}restart-attempt": str(self.restarts),
            f"{ANNOTATION}replicatedjob-replicas": str(self.rjob["replicas"]),
            f"{ANNOTATION}global-replicas": str(self.rjob["replicas"]),
            f"{ANNOTATION}job-index": str(job_index),
            f"{ANNOTATION}job-global-index": str(job_index),
            "batch.kubernetes.io/job-completion-index": "0",
        }

    def _publish(self) -> None:
        """The names every pod resolves: the etcd Service, and each pod's host as the JobSet's
        headless Service publishes it (a replaced pod's name moves to its new address)."""
        lines = ["127.0.0.1 localhost"]
        if self.etcd_members:
            governing = self.etcd_set["spec"]["serviceName"]
            lines += [f"{self.cluster.node_ip(slot)} {name}.{governing} {name}" for name, slot in self.etcd_members]
            # a ClusterIP in front of the members: here the first member's address
            lines.append(f"{self.cluster.node_ip(self.etcd_members[0][1])} {self.etcd_service}")
        for job in self.jobs:
            if job.pods:
                host = self.hostname(job.index)
                lines.append(f"{self.cluster.node_ip(job.pods[-1].slot)} {host}.{self.subdomain} {host}")
        for slot in [*(slot for _, slot in self.etcd_members), *(pod.slot for pod in self.pods())]:
            folder = Path("/etc/netns") / self.cluster.node_ns[slot]
            folder.mkdir(parents=True, exist_ok=True)
            # in place: a namespace's processes see /etc/hosts through a bind mount of this file
            with open(folder / "hosts", "r+" if (folder / "hosts").exists() else "w") as hosts:
                hosts.truncate(0)
                hosts.write("\n".join(lines) + "\n")

    def delete_pod(self, job_index: int, graceful: bool = False) -> Pod:
        """The Job's running pod deleted. Not ``graceful``: at once, as when its node dies
        (SIGKILL: 137). ``graceful`` (``kubectl delete pod``, a drain): SIGTERM to the
        container's first process, SIGKILL once the pod's termination grace has passed."""
        pod = self.jobs[job_index].pods[-1]
        if not graceful:
            pod.launched.kill_node()
            return pod
        grace = self.job_spec["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        pod.kill_at = time.monotonic() + grace
        pod.launched.proc.send_signal(signal.SIGTERM)
        return pod

    # -- the controllers ---------------------------------------------------------------

    def step(self) -> None:
        """One pass of the Job and JobSet controllers over the pods that exited."""
        for job in self.jobs:
            if job.outcome is not None or not job.pods:
                continue
            pod = job.pods[-1]
            if pod.exit_code is not None:
                continue  # ended and dealt with (its replacement held back)
            code = pod.launched.proc.poll()
            if code is None and pod.kill_at is not None and time.monotonic() > pod.kill_at:
                pod.launched.kill_node()  # its termination grace is over
                code = pod.launched.proc.poll()
            if code is None:
                continue
            pod.exit_code = 128 - code if code < 0 else code  # a signal, as the container runtime says it
            pod.launched.stop()
            self._pod_ended(job, pod)
        self._jobset_outcome()

    def _pod_ended(self, job: JobState, pod: Pod) -> None:
        if pod.exit_code == 0:
            job.outcome = "Complete"
            return
        action = self._policy_action(pod.exit_code)
        if action == "FailJob":
            job.outcome, job.failed_by_policy = "Failed", True
            return
        if action != "Ignore":
            job.failures += 1
            if job.failures > self.job_spec.get("backoffLimit", 6):
                job.outcome = "Failed"
                return
        if self.hold_replacements:
            self.held.append(job)
            return
        self._create_pod(job)  # the replacement: same index, new name, new address

    def release(self) -> None:
        """Start the replacements held back (``hold_replacements``)."""
        held, self.held = self.held, []
        for job in held:
            self._create_pod(job)

    def _policy_action(self, exit_code: int) -> str | None:
        """The first podFailurePolicy rule that matches a container's exit code (conditions
        such as DisruptionTarget never match here: nothing evicts)."""
        for rule in (self.job_spec.get("podFailurePolicy") or {}).get("rules", []):
            codes = rule.get("onExitCodes")
            if not codes or codes.get("containerName", self.container["name"]) != self.container["name"]:
                continue
            inside = exit_code in codes["values"]
            if inside == (codes["operator"] == "In"):
                return rule["action"]
        return None

    def _jobset_outcome(self) -> None:
        """Every Job complete: Completed. A Job failed: Failed when its pod failure policy
        failed it and a FailJobSet rule covers that, else the JobSet restarts (every Job
        made anew) while ``failurePolicy.maxRestarts`` allows."""
        if self.outcome is not None:
            return
        failed = [job for job in self.jobs if job.outcome == "Failed"]
        if not failed:
            if all(job.outcome == "Complete" for job in self.jobs):
                self.outcome = "Completed"
            return
        policy = self.jobset["spec"].get("failurePolicy") or {}
        fail_on_policy = any(r["action"] == "FailJobSet" and "PodFailurePolicy" in r.get("onJobFailureReasons", [])
                             for r in policy.get("rules", []))
        for job in self.jobs:
            if job.pods and job.pods[-1].launched.proc.poll() is None:
                job.pods[-1].launched.kill_node()
        if (fail_on_policy and any(job.failed_by_policy for job in failed)) or self.restarts >= policy.get(
                "maxRestarts", 0):
            self.outcome = "Failed"
            return
        self.restarts += 1
        self.jobs = [JobState(i) for i in range(self.rjob["replicas"])]
        self.start()

    def wait_outcome(self, timeout: float) -> str:
        """Run the controllers until the JobSet completes or fails; its outcome."""
        deadline = time.monotonic() + timeout
        while self.outcome is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"JobSet {self.name} neither completed nor failed in {timeout:g} s")
            self.step()
            time.sleep(0.1)  # polling the pods' exits, as the kubelet's status loop does
        return self.outcome

    def pods(self) -> list[Pod]:
        """Every pod made so far, a JobSet restart's before included, in order."""
        return list(self.history)


def _environment(container: dict, fields: dict[str, str], annotations: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet sets them: in order, each literal may refer
    to those before it (``$(NAME)``); the downward API's fields from ``fields`` (a path:
    its value) and the pod's ``annotations``."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        matched = _FIELD.match(path)
        if matched:
            env[var["name"]] = annotations.get(matched.group(2), "")
        elif path in fields:
            env[var["name"]] = fields[path]
        else:
            raise ValueError(f"the emulation does not know the downward API's field {path!r}")
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a command or a variable (unknown names stay)."""
    return _EXPANSION.sub(lambda m: env.get(m.group(1), m.group(0)), text)
