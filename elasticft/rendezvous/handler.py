"""``EtcdRendezvousHandler``: torch's ``RendezvousHandler`` interface on etcd keys.

The rounds themselves (membership as keys, one small closing decision, ranks from a
count) are ``rounds.Rounds``; this class is what torch's agent talks to, with the
semantics of torch's ``DynamicRendezvousHandler``: ``next_rendezvous`` returns this
round's rank, world size, a store prefixed by the round and the workers' bootstrap
store (hosted by the rank-0 agent unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
``num_nodes_waiting``, ``is_closed``, ``set_closed``, ``shutdown`` (closes) as torch's.
As torch's handler does, it reports an unreachable store as ``RendezvousConnectionError``
(here one that is also eft's ``StoreUnavailable``) and ``shutdown`` returns False when it
cannot close the rendezvous (torch's ``launch_agent`` calls it in a ``finally``).

Unlike torch's handler it rebuilds the bootstrap store address at every round, so a
survivor never sends its workers to the store of a rank 0 that was lost; and a node that
reaches etcd but not its round's master stands aside from the round (``aside.py``, through
``stand_aside_if_cut``, which eft's agent calls once the round's ranks are assigned).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
)

from elasticft.contract.keys import BACKEND_NAME
from elasticft.rendezvous import master
from elasticft.rendezvous.aside import Aside, PeerCheck
from elasticft.rendezvous.rounds import OddOneOut, Round, Rounds
from elasticft.store import StoreError, StoreUnavailable
from elasticft.store.errors import LeaseNotFound
from elasticft.store.outage import through_outage

log = logging.getLogger(__name__)

_handlers_in_process = itertools.count()


class RendezvousStoreError(RendezvousConnectionError, StoreError):
    """An etcd request failed: torch's kind of error for it, and still eft's ``StoreError``."""


class RendezvousStoreUnavailable(RendezvousStoreError, StoreUnavailable):
    """etcd did not answer: torch's kind of error for it, and still eft's ``StoreUnavailable``."""


@contextlib.contextmanager
def store_errors_as_connection_errors() -> Iterator[None]:
    try:
        yield
    except RendezvousConnectionError:
        raise
    except StoreError as exc:
        kind = RendezvousStoreUnavailable if isinstance(exc, StoreUnavailable) else RendezvousStoreError
        raise kind(f"etcd-v3 rendezvous: {exc}") from exc


def node_name(local_addr: str | None) -> str:
    """This handler's participant name: ``<addr>_<pid>_<n>``, torch's node descriptor shape."""
    return f"{local_addr or socket.getfqdn()}_{os.getpid()}_{next(_handlers_in_process)}"


class EtcdRendezvousHandler(RendezvousHandler):
    def __init__(self, rounds: Rounds, store: dist.Store, run_id: str, local_addr: str | None,
                 close_timeout: float | None = None, outage_limit: float = 600.0, probe_timeout: float = 10.0):
        self._rounds = rounds
        self._outage_limit = outage_limit
        self._peers = PeerCheck(rounds, self._master_of, probe_timeout, wait_limit=rounds.limits.join_timeout)
        self._store = store
        self._addr = local_addr or socket.getfqdn()
        limits = rounds.limits
        self._settings = RendezvousSettings(
            run_id=run_id,
            min_nodes=limits.min_nodes,
            max_nodes=limits.max_nodes,
            # close: only reported (closing is one put, bounded by the etcd request timeout)
            timeout=RendezvousTimeout(join=timedelta(seconds=limits.join_timeout),
                                      last_call=timedelta(seconds=limits.last_call),
                                      close=timedelta(seconds=close_timeout) if close_timeout else None),
            # liveness is the lease: these only describe it to code that reads them
            keep_alive_interval=timedelta(seconds=1),
            keep_alive_max_attempt=1,
        )
        self._tcp_store_server: dist.TCPStore | None = None
        self._bootstrap: RendezvousStoreInfo | None = None  # the master of the round just formed
        self.round: Round | None = None

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    @property
    def rounds(self) -> Rounds:
        return self._rounds

    @property
    def peers(self) -> PeerCheck:
        return self._peers

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def next_rendezvous(self) -> RendezvousInfo:
        """The next round; a node that most of a round cannot reach waits outside first."""
        while True:
            try:
                with store_errors_as_connection_errors():
                    self.round = formed = self._join_through_outages()
                    info = self._formed(formed)
                if info is None:  # a member was lost before rank 0 said where its store listens
                    continue
                self._bootstrap = info.bootstrap_store_info
                return info
            except OddOneOut as exc:  # most of a round cannot reach this node: out until it reaches theirs
                self._stand_aside(Aside(exc.number - 1, self._rounds.node))

    def stand_aside_if_cut(self) -> bool:
        """Stand aside from the round just formed when this node cannot reach its master, or
        most nodes cannot reach this one (``aside.py``); True once it may join again.

        Called by eft's agent once the round's ranks are assigned: torch's agent assigns
        them through the store with every member of the round, so a node must not leave
        before. The others then see it leave, and re-rendezvous without it.
        """
        formed, master = self.round, self._bootstrap
        if formed is None or master is None or not self.use_agent_store:
            return False  # without the agent's store nothing listens at the master's address yet
        try:
            aside = self._peers.check(formed, master.master_addr, master.master_port)
        except StoreError as exc:  # etcd away: go on as before this check (gloo finds out)
            log.warning("etcd-v3 rendezvous: could not check the master of round %d: %s", formed.number, exc)
            return False
        if aside is None:
            return False
        self._tcp_store_server = None
        self._stand_aside(aside)
        return True

    def _stand_aside(self, aside: Aside) -> None:
        self._bootstrap = None
        with store_errors_as_connection_errors():
            through_outage(lambda: self._peers.stand_aside(aside), self._outage_limit,
                           f"the rendezvous of {self._settings.run_id}")

    def _master_of(self, number: int) -> tuple[str, int] | None:
        """Where round ``number``'s master listens, once its rank 0 wrote it (None before)."""
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{number}", self._store)
        keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        if not store.check(keys):
            return None
        return store.get(keys[0]).decode(), int(store.get(keys[1]).decode())

    def _formed(self, formed: Round) -> RendezvousInfo | None:
        """The round's info; rank 0 starts the bootstrap store and says where (``master.py``).
        None: a member was lost before rank 0 said so (join again). Raises StoreError."""
        store = dist.PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{formed.number}", self._store)
        if formed.rank != 0:
            address = master.await_master(self._rounds, formed, self._store.timeout.total_seconds(),
                                          lambda: self._master_of(formed.number))
            return None if address is None else RendezvousInfo(store, formed.rank, formed.size,
                                                               RendezvousStoreInfo(*address))
        server_port = None
        if self.use_agent_store:
            # A new server every round: the workers' keys carry no generation (torch
            # relies on a new store per retry), so on the old one a new rank would read
            # the gloo address of the rank it replaces, dead or not. The old workers are
            # stopped by now; dropping the old server closes it.
            self._tcp_store_server = dist.TCPStore(host_name=self._addr, port=0, is_master=True, multi_tenant=True)
            server_port = self._tcp_store_server.port
        # torch's way as well (the address in the store: what ``_master_of`` reads), then the control key
        bootstrap = RendezvousStoreInfo.build(0, store, local_addr=self._addr, server_port=server_port)
        master.publish(self._rounds, formed, bootstrap.master_addr, bootstrap.master_port)
        return RendezvousInfo(store, formed.rank, formed.size, bootstrap)

    def _join_through_outages(self) -> Round:
        """Join a round; while etcd is out of reach, wait for it up to the outage limit.

        A worker that dies while etcd is away needs a rendezvous that cannot happen yet.
        Failing the job for it would let the control plane stop training; waiting costs
        only the outage, since every other node restarts into the same round when etcd is back.
        """

        leave_if = self._peers.odd_one_out if self._peers.enabled else None

        def join() -> Round:
            try:
                return self._rounds.join(leave_if)
            except LeaseNotFound:  # expired while this node was frozen or cut off: again, under a new one
                return self._rounds.join(leave_if)

        return through_outage(join, self._outage_limit, f"the rendezvous of {self._settings.run_id}")

    def is_closed(self) -> bool:
        with store_errors_as_connection_errors():
            return self._rounds.is_closed()

    def set_closed(self) -> None:
        with store_errors_as_connection_errors():
            self._rounds.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._rounds.waiting()

    def shutdown(self) -> bool:
        """torch's meaning: this job is over for everyone; close, then leave.

        False when the rendezvous could not be closed (etcd unreachable), as torch's
        handler answers: torch's agent calls this on its way out, which must not raise.
        """
        try:
            self.set_closed()
            closed = True
        except RendezvousConnectionError as exc:
            log.warning("etcd-v3 rendezvous %s: could not close it: %s", self._settings.run_id, exc)
            closed = False
        with contextlib.suppress(StoreError):  # the lease expires on its own
            self._rounds.leave()
        return closed

    def leave_without_closing(self) -> None:
        """This node leaves a job that goes on: its keys vanish, the others re-rendezvous."""
        self._rounds.leave()

        def shutdown() -> bool:
            return True

        self.shutdown = shutdown
