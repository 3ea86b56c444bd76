"""The job's own etcd on Kubernetes: a StatefulSet of members, its peers' headless Service and
the client Service eft-run's pods reach it by (``<jobset>-etcd``, ``JobSetPod.etcd_endpoint``).

A StatefulSet because etcd members need names that outlive a restart of their container
(``<name>-etcd-<i>``, resolvable through the headless Service) to list one another in
``--initial-cluster`` before any of them runs. Its data lives on an emptyDir: the store holds
one job's rendezvous and records, which a new JobSet (a new run id) never reads again, so no
volume claim has to be provisioned and cleaned up after it.
"""

from __future__ import annotations

from elasticft.kubernetes.pod import ETCD_PORT, etcd_service

PEER_PORT = 2380
DEFAULT_IMAGE = "quay.io/coreos/etcd:v3.5.17"
DATA_DIR = "/var/run/etcd"


def peers_service_name(jobset: str) -> str:
    return f"{jobset}-etcd-peers"


def member_names(jobset: str, members: int) -> list[str]:
    """The StatefulSet's pod names, in order: its pods are ``<statefulset>-<ordinal>``."""
    return [f"{etcd_service(jobset)}-{i}" for i in range(members)]


def initial_cluster(jobset: str, members: int) -> str:
    """``--initial-cluster``: every member by the DNS name the headless Service gives its pod."""
    peers = peers_service_name(jobset)
    return ",".join(f"{m}=http://{m}.{peers}:{PEER_PORT}" for m in member_names(jobset, members))


def etcd_objects(jobset: str, members: int, image: str, namespace: str | None, labels: dict) -> list[dict]:
    """The peers' Service, the StatefulSet and the client Service, in ``namespace`` (None: the
    one ``kubectl apply`` uses); ``labels`` tell this job's objects from another's, and the
    Services select the members by them."""
    selector = {**labels, "app.kubernetes.io/component": "etcd"}
    ports = [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT},
             {"name": "peer", "port": PEER_PORT, "targetPort": PEER_PORT}]
    peers = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _named(namespace, peers_service_name(jobset), selector),
        # publishNotReadyAddresses: members must resolve one another before any is ready
        # (a member is ready only once a quorum of them has met)
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector, "ports": ports},
    }
    client = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _named(namespace, etcd_service(jobset), selector),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports[:1]},
    }
    return [peers, _statefulset(jobset, members, image, namespace, selector), client]


def _statefulset(jobset: str, members: int, image: str, namespace: str | None, selector: dict) -> dict:
    peers = peers_service_name(jobset)
    advertise = f"$(POD_NAME).{peers}"  # the kubelet expands $(POD_NAME) from the env below
    command = [
        "etcd", "--name", "$(POD_NAME)", "--data-dir", f"{DATA_DIR}/data",
        "--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}",
        "--advertise-client-urls", f"http://{advertise}:{ETCD_PORT}",
        "--listen-peer-urls", f"http://0.0.0.0:{PEER_PORT}",
        "--initial-advertise-peer-urls", f"http://{advertise}:{PEER_PORT}",
        "--initial-cluster", initial_cluster(jobset, members),
        "--initial-cluster-state", "new", "--initial-cluster-token", etcd_service(jobset),
    ]
    container = {
        "name": "etcd", "image": image, "command": command,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "client", "containerPort": ETCD_PORT}, {"name": "peer", "containerPort": PEER_PORT}],
        # ready once it serves with a quorum: the client Service sends eft-run only there
        "readinessProbe": {"httpGet": {"path": "/health", "port": ETCD_PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": DATA_DIR}],
    }
    # members on different nodes where the cluster allows: three then survive a lost node
    spread = {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector},
                                                 "topologyKey": "kubernetes.io/hostname"}}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _named(namespace, etcd_service(jobset), selector),
        "spec": {
            "serviceName": peers,
            "replicas": members,
            # every member at once: none is ready until a quorum has started
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {
                    "containers": [container],
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}},
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }


def _named(namespace: str | None, name: str, labels: dict) -> dict:
    return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": dict(labels)}
