"""Prometheus ``file_sd`` targets from the node records: one scrape config follows a job whose nodes come and go.

Every agent with an endpoint writes its ``host:port`` into its record (``NodeRecord.metrics``), under
its lease: a node that dies drops out of the targets as its lease expires, a node that joins comes
in with its record. Each target carries the labels ``run`` and ``node``, the same as its series
(scrape with ``honor_labels: true``: docs/metrics.md).
"""

from __future__ import annotations

import json

from elasticft.contract.records import NodeRecord, NodeState


def node_key_parts(key: str, prefix: str) -> tuple[str, str] | None:
    """(run, node) of a ``<prefix>/<run>/nodes/<node>`` key; None for any other key."""
    rest = key[len(prefix.rstrip("/")) + 1:] if key.startswith(prefix.rstrip("/") + "/") else ""
    parts = rest.split("/")
    return (parts[0], parts[2]) if len(parts) == 3 and parts[1] == "nodes" and parts[0] and parts[2] else None


def file_sd(nodes: dict[tuple[str, str], NodeRecord]) -> list[dict]:
    """The ``file_sd`` groups (one per node that serves metrics and runs or waits as a spare),
    sorted by run and node."""
    groups = []
    for (run, node), record in sorted(nodes.items()):
        if record.metrics and record.state in (NodeState.RUNNING, NodeState.SPARE):
            groups.append({"targets": [record.metrics], "labels": {"run": run, "node": node}})
    return groups


def render(groups: list[dict]) -> str:
    return json.dumps(groups, indent=2) + "\n"
