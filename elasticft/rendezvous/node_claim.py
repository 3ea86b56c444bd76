"""One live record per node id: what a joining agent does with a record of its id still in etcd.

A node that dies and comes back within its lease's TTL (a quick reboot, a restarted agent, a
SLURM task requeued on the same host) finds its earlier incarnation's record. Written over, it
would never be deleted: the other nodes would not see the loss, would record no ``node_lost``,
and would restart for their failed workers instead (``eft report`` could not name the node). So
the record goes first:

- an incarnation on this host whose process is gone has its lease ended at once: its record
  and its rendezvous keys go, and the others see the loss now, as they would at its expiry;
- one elsewhere, or alive, is awaited until its lease expires (at most twice the TTL);
- a record still there after that belongs to a live agent: two nodes were given one
  ``--eft-node-id``, which is the user's mistake to fix, said in one line.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import psutil

from elasticft.config import ConfigError, flag_name
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import end_node_lease
from elasticft.store import EtcdClient
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)


def claim_node_id(client: EtcdClient, key: str, node_id: str, ttl: float) -> None:
    """Return once no other record of ``node_id`` (at ``key``) is in etcd; raises ConfigError when
    a live agent holds it, StoreError when etcd does not answer."""
    changed = threading.Event()
    record = KeySet(client, key, changed.set, exact=True)
    try:
        value = record.get(key)
        if value is None:
            return
        earlier = _parse(value)
        if earlier is not None and earlier.host == socket.gethostname() and not psutil.pid_exists(earlier.pid):
            if end_node_lease(client, key, lambda now: (now.host, now.pid) == (earlier.host, earlier.pid)):
                log.info("node %s: its earlier agent (pid %d) is gone and its record still there: its lease is "
                         "ended, so that the others see the loss now", node_id, earlier.pid)
                return
        where = f" (pid {earlier.pid} on {earlier.host})" if earlier is not None else ""
        log.info("node %s: a record of this id is still in etcd%s; waiting for its lease to expire", node_id, where)
        deadline = time.monotonic() + 2 * ttl + 1.0
        while key in record and not record.broken and (left := deadline - time.monotonic()) > 0:
            changed.wait(left)
            changed.clear()
        if record.broken:  # the watch failed (etcd away a moment): etcd itself answers at the deadline
            time.sleep(max(deadline - time.monotonic(), 0.0))
            held = client.get(key) is not None
        else:
            held = key in record
        if held:
            raise ConfigError(f"{flag_name('node_id')} {node_id}: a live agent of this run has that id{where}; "
                              "every node needs an id of its own")
    finally:
        record.close()


def _parse(value: bytes) -> NodeRecord | None:
    try:
        return NodeRecord.from_json(value)
    except (ValueError, TypeError, KeyError):
        return None
