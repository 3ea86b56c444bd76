"""The rendezvous handlers torch's handler contract is checked on, and the helpers its cases share.

A subject is eft's ``etcd-v3`` handler on the session's real etcd, or torch's own ``c10d``
handler on a real TCPStore; either is built by torch's ``rendezvous_handler_registry``
from ``RendezvousParameters``, as torchrun builds it. A subject's probe reads its
backend's storage; the tests use it only to await an event (a spare registered, a
waiter in round 0) before they check public behaviour.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import uuid
from base64 import b64decode
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

from elasticft.contract.keys import RunKeys

SUBJECTS = ["eft", "c10d"]

# torch's own --rdzv-conf keys, which both handlers accept (short: rounds form in seconds)
COMMON = {"join_timeout": "20", "last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


class EftProbe:
    def __init__(self, etcd):
        self._etcd = etcd

    def first_round_size(self, run_id: str) -> int:
        return self._etcd.count_prefix(RunKeys(run_id).rdzv_participants(0))

    def spare_registered(self, run_id: str, member) -> bool:
        return self._etcd.count_prefix(RunKeys(run_id).rdzv_participants(member.round.number + 1)) > 0

    @staticmethod
    def lose(handler) -> None:
        handler.leave_without_closing()  # its lease and keys go, as when the lease expires

    @staticmethod
    def forget(handler) -> None:
        handler.rounds.leave()


class C10dProbe:
    EMPTY = b"Y2FuaW1hZGFt"  # C10dRendezvousBackend's placeholder before the first state

    def __init__(self, store: dist.TCPStore):
        self._store = store

    def _state(self, run_id: str):
        key = f"torch.rendezvous.{run_id}"
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)
        return None if raw == self.EMPTY else pickle.loads(b64decode(raw))

    def first_round_size(self, run_id: str) -> int:
        state = self._state(run_id)
        return len(state.participants) if state is not None and state.round == 0 else 0

    def spare_registered(self, run_id: str, member) -> bool:
        state = self._state(run_id)
        return state is not None and bool(state.redundancy_list)

    @staticmethod
    def lose(handler) -> None:
        handler._stop_heartbeats()  # as torch's own IntegrationTest does

    @staticmethod
    def forget(handler) -> None:
        handler._stop_heartbeats()


@dataclass
class Subject:
    name: str
    backend: str
    endpoint: str
    extra: dict  # the backend's own --rdzv-conf keys
    default_last_call: float  # eft's is 1 s on purpose (backend.DEFAULT_LAST_CALL_TIMEOUT), torch's 30 s
    probe: EftProbe | C10dProbe

    def params(self, run_id: str, min_nodes: int, max_nodes: int, local_addr: str = "127.0.0.1",
               endpoint: str | None = None, **conf) -> RendezvousParameters:
        conf = {k: v for k, v in {**COMMON, **self.extra, **conf}.items() if v is not None}
        return RendezvousParameters(backend=self.backend, endpoint=endpoint or self.endpoint, run_id=run_id,
                                    min_nodes=min_nodes, max_nodes=max_nodes, local_addr=local_addr, **conf)


def eft_subject(etcd_server, etcd) -> Subject:
    return Subject("eft", "etcd-v3", etcd_server.endpoint, {"lease_ttl": "2"}, 1.0, EftProbe(etcd))


def c10d_subject(store: dist.TCPStore) -> Subject:
    return Subject("c10d", "c10d", f"127.0.0.1:{store.port}", {"is_host": "false", "read_timeout": "5"}, 30.0,
                   C10dProbe(store))


def c10d_store() -> dist.TCPStore:
    """The TCPStore a c10d run lives on (hosted here, so no handler has to host it)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))


class Run:
    """Handlers of one fresh run of the subject, made by torch's registry; closed and left by ``close``."""

    def __init__(self, subject: Subject):
        self.subject = subject
        self.run_id = uuid.uuid4().hex
        self.made = []

    def handler(self, min_nodes: int, max_nodes: int, **conf):
        self.made.append(rendezvous_handler_registry.create_handler(
            self.subject.params(self.run_id, min_nodes, max_nodes, **conf)))
        return self.made[-1]

    def handlers(self, n: int, min_nodes: int, max_nodes: int, **conf):
        return [self.handler(min_nodes, max_nodes, **conf) for _ in range(n)]

    def close(self) -> None:
        for handler in self.made[:1]:  # ends any thread still waiting in next_rendezvous
            with contextlib.suppress(Exception):  # the store may be gone on purpose
                handler.set_closed()
        for handler in self.made:
            with contextlib.suppress(Exception):
                self.subject.probe.forget(handler)


def in_thread(call) -> Future:
    """``call()`` in a daemon thread (a waiter that never returns cannot hang the session)."""
    future: Future = Future()

    def target():
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return future


def join_all(handlers, timeout: float = 30):
    """``next_rendezvous`` on every handler at once (a thread each); their infos in order."""
    futures = [in_thread(h.next_rendezvous) for h in handlers]
    return [f.result(timeout=timeout) for f in futures]


def assert_one_world(infos, size: int) -> None:
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}


def bootstrap_of(info) -> tuple[str, int]:
    return info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port


def reach(addr: str, port: int) -> bytes:
    """Connect to a bootstrap store as a worker would, write and read back one key."""
    client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
    client.set("reached", b"yes")
    return client.get("reached")


def raises(call, kind: type[BaseException]) -> bool:
    try:
        call()
    except kind:
        return True
    return False
