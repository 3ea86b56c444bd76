"""The JobSet pod eft-run runs in, read from the variables its pod spec sets.

JobSet puts what a pod needs to know on the pod as annotations (the JobSet's name and UID,
how often it was restarted, the replicated job's replica count, the Job's index); a
container sees them only through the downward API, as variables the pod spec names. This
module is the contract between the two sides: ``DOWNWARD_API`` is what the manifests
(``manifests.py``) set, ``JobSetPod.from_environ`` what eft-run reads, so neither can name a
variable the other does not know. Pure: a ``JobSetPod`` is made from a mapping.

One pod per Job (``parallelism: 1``): a lost node is one Job's pod, replaced by the Job
controller at the same index (same hostname, a new name and address), while the other
Jobs' pods train on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

ANNOTATION = "jobset.sigs.k8s.io/"
ETCD_PORT = 2379


class PodEnv(enum.StrEnum):
    """The variables eft-run reads in a JobSet pod (``DOWNWARD_API`` says where each comes from)."""

    JOBSET_NAME = "JOBSET_NAME"
    JOBSET_UID = "JOBSET_UID"
    RESTART_ATTEMPT = "JOBSET_RESTART_ATTEMPT"
    REPLICAS = "JOBSET_REPLICATEDJOB_REPLICAS"
    JOB_INDEX = "JOBSET_JOB_INDEX"
    POD_NAME = "POD_NAME"
    POD_IP = "POD_IP"
    # Not from the downward API: the manifest's own literal, the etcd client Service's
    # name (host or host:port); unset: "<jobset name>-etcd", the example's Service.
    ETCD_SERVICE = "EFT_ETCD_SERVICE"


# variable -> the downward API's fieldPath that fills it in the pod spec
DOWNWARD_API: dict[PodEnv, str] = {
    PodEnv.JOBSET_NAME: f"metadata.annotations['{ANNOTATION}jobset-name']",
    PodEnv.JOBSET_UID: f"metadata.annotations['{ANNOTATION}jobset-uid']",
    PodEnv.RESTART_ATTEMPT: f"metadata.annotations['{ANNOTATION}restart-attempt']",
    PodEnv.REPLICAS: f"metadata.annotations['{ANNOTATION}replicatedjob-replicas']",
    PodEnv.JOB_INDEX: f"metadata.annotations['{ANNOTATION}job-index']",
    PodEnv.POD_NAME: "metadata.name",
    PodEnv.POD_IP: "status.podIP",
}


def etcd_service(jobset: str) -> str:
    """The client Service of a JobSet's own etcd: what the manifests name it, what eft-run
    reaches unless ``EFT_ETCD_SERVICE`` names another."""
    return f"{jobset}-etcd"


@dataclass(frozen=True)
class JobSetPod:
    """One pod of one attempt of a JobSet, as the variables of this process describe it."""

    jobset: str  # the JobSet's name
    uid: str  # the JobSet's UID: a JobSet deleted and made again under its name differs
    restart_attempt: int  # JobSet restarts (failurePolicy) so far: every pod is new after one
    replicas: int | None  # the replicated job's Jobs: one pod each, so its nodes
    job_index: int | None  # this pod's Job among them
    pod_name: str | None  # unique to this pod: its replacement gets another
    pod_ip: str | None
    etcd_service: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "JobSetPod | None":
        """The pod of this process, or None outside a JobSet (no ``JOBSET_NAME``).

        Raises ValueError naming the variable when one is set but is no count or index."""
        name = environ.get(PodEnv.JOBSET_NAME)
        if not name:
            return None
        return cls(
            jobset=name,
            uid=environ.get(PodEnv.JOBSET_UID, ""),
            restart_attempt=_count(environ, PodEnv.RESTART_ATTEMPT) or 0,
            replicas=_count(environ, PodEnv.REPLICAS),
            job_index=_count(environ, PodEnv.JOB_INDEX),
            pod_name=environ.get(PodEnv.POD_NAME) or None,
            pod_ip=environ.get(PodEnv.POD_IP) or None,
            etcd_service=environ.get(PodEnv.ETCD_SERVICE) or None,
        )

    @property
    def attempt(self) -> str:
        """This attempt of the JobSet (``NodeRecord.attempt``): name, UID and restart count."""
        uid = f".{self.uid[:8]}" if self.uid else ""
        return f"{self.jobset}{uid}.r{self.restart_attempt}"

    @property
    def run_id(self) -> str:
        """The default ``--rdzv-id``: one per attempt, so that the pods of a JobSet restarted
        (every pod new) never meet the keys of the attempt before, nor two JobSets one another."""
        return "k8s-" + self.attempt.replace(".", "-")

    @property
    def etcd_endpoint(self) -> str:
        """The default ``--rdzv-endpoint``: the etcd client Service, on etcd's port unless named."""
        service = self.etcd_service or etcd_service(self.jobset)
        return service if ":" in service else f"{service}:{ETCD_PORT}"


def _count(environ: Mapping[str, str], name: PodEnv) -> int | None:
    text = environ.get(name, "")
    if text == "":
        return None
    if not text.isdigit():
        raise ValueError(f"{name}: expected a whole number >= 0 (from the pod's "
                         f"{DOWNWARD_API.get(name, 'spec')}), got {text!r}")
    return int(text)
