"""One live record per node id: what a joining agent does with a record of its id still in etcd.

A node that dies and comes back within its lease's TTL (a quick reboot, a restarted agent, a
SLURM task requeued on the same host) finds its earlier incarnation's record. Written over, it
would never be deleted: the other nodes would not see the loss, would record no ``node_lost``,
and would restart for their failed workers instead (``eft report`` could not name the node). So
the record goes first:

- an incarnation on this host whose process is gone is deleted at once: the others see the
  loss now, as they would at its lease's expiry;
- one elsewhere, or alive, is awaited until its lease expires (at most twice the TTL);
- a record still there after that belongs to a live agent: two nodes were given one
  ``--eft-node-id``, which is the user's mistake to fix, said in one line.
"""

from __future__ import annotations

import logging
import socket
import threading

import psutil

from elasticft.config import ConfigError
from elasticft.contract.records import NodeRecord
from elasticft.store import EtcdClient, WatchEvent

log = logging.getLogger(__name__)


def claim_node_id(client: EtcdClient, key: str, node_id: str, ttl: float) -> None:
    """Return once no other record of ``node_id`` (at ``key``) is in etcd; raises ConfigError when
    a live agent holds it, StoreError when etcd does not answer."""
    item, revision = client.get_with_revision(key)
    if item is None:
        return
    try:
        earlier = NodeRecord.from_json(item.value)
    except (ValueError, TypeError, KeyError):
        earlier = None
    if earlier is not None and earlier.host == socket.gethostname() and not psutil.pid_exists(earlier.pid):
        log.info("node %s: its earlier agent (pid %d) is gone and its record still there: deleting it, so that "
                 "the others see the loss now", node_id, earlier.pid)
        client.delete(key)
        return
    gone = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        if any(event.key == key and event.deleted for event in events):
            gone.set()

    cancel = client.watch_range(key, key + "\0", on_events, start_revision=revision + 1)
    try:
        where = f" (pid {earlier.pid} on {earlier.host})" if earlier is not None else ""
        log.info("node %s: a record of this id is still in etcd%s; waiting for its lease to expire", node_id, where)
        if not gone.wait(2 * ttl + 1.0):
            raise ConfigError(f"--eft-node-id {node_id}: a live agent of this run has that id{where}; "
                              "every node needs an id of its own")
    finally:
        cancel()

