"""The SLURM time limit, asked of slurmctld by one agent of the job, not by every one.

Where SLURM sets ``SLURM_JOB_END_TIME`` no one asks (``elasticft.slurm.job.end_time``).
Where it does not (SLURM before 23.02), ``squeue`` asks the controller, and one squeue per
agent at start is a burst of 2,048 questions on slurmctld at 2,048 nodes. So the agents of
one attempt share the answer through the run's etcd (``contract.end_time``):

* the agent that creates ``slurm/<attempt>/end-time-asker`` first asks squeue and puts what
  it found (a time, or None) in ``slurm/<attempt>/end-time``;
* every other agent waits for that key, at most ``--eft-slurm-end-time-wait`` seconds from
  its start (etcd not answering yet counts against the same bound): an asker that died, or a
  squeue that hangs, costs the others that wait and a warning, then they go on without a
  time limit (no save ahead of it; SLURM's SIGTERM still comes);
* etcd refusing a request (not merely slow to start) makes the agent ask squeue itself, as
  before: one agent's question, not a hang.

The keys carry the attempt, so a run id reused across requeues never reads the time limit
of the attempt before.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from elasticft.config import flag_name
from elasticft.contract.end_time import SharedEndTime
from elasticft.contract.keys import RunKeys
from elasticft.slurm.job import SlurmJob, end_time
from elasticft.store import EtcdClient, StoreError, StoreOptions, StoreUnavailable, connect

log = logging.getLogger("elasticft")

CONNECT_RETRY_SECONDS = 0.5  # how often to try an etcd that does not answer yet (it may be starting)

AskSqueue = Callable[[SlurmJob], "float | None"]


def shared_end_time(job: SlurmJob, store: StoreOptions, keys: RunKeys, wait: float,
                    ask: AskSqueue = end_time, me: str = "") -> float | None:
    """When SLURM ends ``job`` (unix seconds), asked of squeue by one agent of the attempt;
    None: no limit, no answer, or none within ``wait`` seconds (a warning says which)."""
    if job.end_time is not None or wait <= 0:
        return ask(job)
    me = me or f"{socket.gethostname()}:{os.getpid()}"
    deadline = time.monotonic() + wait
    client = _connect_by(store, deadline)
    if client is None:
        log.warning("etcd at %s did not answer within %s %g s: asking squeue for SLURM job %s's time limit "
                    "from this agent", store.endpoints, flag_name("slurm_end_time_wait"), wait, job.name)
        return ask(job)
    try:
        return _shared(client, job, keys, deadline, wait, ask, me)
    finally:
        client.close()


def _shared(client: EtcdClient, job: SlurmJob, keys: RunKeys, deadline: float, wait: float, ask: AskSqueue,
            me: str) -> float | None:
    value_key = keys.slurm_end_time(job.attempt)
    try:
        asker = client.create(keys.slurm_end_time_asker(job.attempt), me)
    except StoreError as exc:
        log.warning("cannot share SLURM job %s's time limit through etcd (%s): asking squeue from this agent",
                    job.name, exc)
        return ask(job)
    if asker:
        end = ask(job)
        try:
            client.put(value_key, SharedEndTime(end, me).to_json())
        except StoreError as exc:  # the others wait their bound, then go on without it
            log.warning("could not share SLURM job %s's time limit through etcd: %s", job.name, exc)
        return end
    try:
        shared = _wait_for(client, value_key, deadline)
    except StoreError as exc:
        log.warning("cannot read SLURM job %s's time limit from etcd (%s): asking squeue from this agent",
                    job.name, exc)
        return ask(job)
    if shared is None:
        log.warning("the agent that asks squeue for SLURM job %s's time limit did not answer within %s %g s "
                    "(it died, or squeue hangs): going on without a time limit, so no save ahead of it",
                    job.name, flag_name("slurm_end_time_wait"), wait)
        return None
    log.info("SLURM job %s's time limit as agent %s found it: %s", job.name, shared.asker,
             "none" if shared.end_time is None else time.strftime("%H:%M:%S", time.localtime(shared.end_time)))
    return shared.end_time


def _connect_by(store: StoreOptions, deadline: float) -> EtcdClient | None:
    """A client of an etcd that answers, tried until ``deadline`` (monotonic); None if it never did."""
    while True:
        try:
            return connect(store, probe=True)
        except StoreUnavailable:
            if time.monotonic() + CONNECT_RETRY_SECONDS >= deadline:
                return None
            time.sleep(CONNECT_RETRY_SECONDS)
        except StoreError as exc:  # refused for good (TLS, a password): the rendezvous says so in one line
            log.debug("etcd refused the time limit's client: %s", exc)
            return None


def _wait_for(client: EtcdClient, key: str, deadline: float) -> SharedEndTime | None:
    """The asker's record once it is there (a watch from the revision read), None at ``deadline``."""
    found: list[SharedEndTime] = []
    arrived = threading.Event()

    def take(raw: bytes) -> None:
        try:
            found.append(SharedEndTime.from_json(raw))
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring a malformed %s: %s", key, exc)
            return
        arrived.set()

    current, revision = client.get_with_revision(key)
    if current is not None:
        take(current.value)
        if found:
            return found[0]
    cancel = client.watch_range(key, key + "\0", lambda events: [take(e.value) for e in events if not e.deleted],
                                start_revision=revision + 1)
    try:
        arrived.wait(max(0.0, deadline - time.monotonic()))
    finally:
        try:
            cancel()
        except StoreError:
            pass
    return found[0] if found else None
