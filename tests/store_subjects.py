"""The stores that torch's Store contract is checked on, and the helpers its cases share.

A subject is one of torch's TCPStore and FileStore or eft's EtcdStore, used directly or
behind torch's PrefixStore (as torch's agents see the store the rendezvous hands them).
``open_store`` opens the same store again on a connection of its own, which is how a
second process (``tests/store_peer.py``) reaches it.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from elasticft.store import StoreOptions, connect, free_port
from elasticft.store.c10d_store import EtcdStore

TIMEOUT = timedelta(seconds=0.5)
# How late a timed-out call may return: a watch or socket has to notice, on a busy machine
# (torch 2.9's TCPStore returned a 0.5 s get 1.56 s late in a CI run beside three other lanes).
# A store that ignored the timeout would wait torch's default, 5 minutes.
SLACK = 2.0
# The prefix PrefixStore puts before the caller's keys, as torch's elastic agent does per round.
ROUND_PREFIX = "round.1"
SUBJECTS = ["tcp", "tcp+prefix", "file", "file+prefix", "etcd", "etcd+prefix"]

# Keys a fresh store holds of its own (TCPStore and FileStore count the clients that joined).
OWN_KEYS = {"tcp": 1, "file": 1, "etcd": 0}

# What torch's own stores do not do, as measured on torch 2.13; our store must do all of it.
UNSUPPORTED = {
    "file": {
        "queues": "FileStore has no queues (torch raises NotImplementedError)",
        "dist_store_error": "FileStore times out with a plain RuntimeError, after about twice its timeout",
        "wait_timeout": "FileStore.wait ignores the timeout it is given and raises a plain RuntimeError",
        "short_timeout": "FileStore looks at the clock about once a second: a 0.1 s timeout takes a second",
        "delete_absent": "FileStore.delete_key returns True for a key it does not hold",
        "extended_api": "FileStore has no extended API (has_extended_api() is False)",
        "list_keys": "FileStore lists a key of its own ('efcount/') beside the caller's",
    },
}
# torch 2.13's trampoline for Python stores (PythonStore in torch/csrc/distributed/c10d/init.cpp)
# overrides neither the queue methods nor listKeys, so PrefixStore's calls of them reach
# c10d::Store's NotImplementedError before our store sees them.
TORCH_GAPS = {
    "queues": "torch's PythonStore trampoline does not forward queuePush/queuePop/queueLen",
    "list_keys": "torch's PythonStore trampoline does not forward listKeys",
}


@dataclass
class Subject:
    kind: str  # "tcp", "file" or "etcd"
    prefixed: bool
    store: dist.Store
    inner: dist.Store  # held so that a Python store keeps its overrides (pybind forgets them otherwise)
    address: str  # what open_store needs to reach the same store on a connection of its own

    def needs(self, feature: str, request: pytest.FixtureRequest | None = None) -> None:
        """Skip where one of torch's stores lacks ``feature``; where torch's PrefixStore cannot pass it
        to our store, mark the case a strict xfail, so that the day torch forwards it we look again."""
        reason = UNSUPPORTED.get(self.kind, {}).get(feature)
        if reason:
            pytest.skip(reason)
        gap = TORCH_GAPS.get(feature)
        if gap and request is not None and self.kind == "etcd" and self.prefixed:
            request.node.add_marker(pytest.mark.xfail(raises=NotImplementedError, strict=True, reason=gap))


def open_store(kind: str, address: str, timeout: timedelta) -> dist.Store:
    """The store at ``address`` on a connection of its own (a TCPStore client, not its server)."""
    if kind == "tcp":
        host, port = address.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    if kind == "file":
        store = dist.FileStore(address, 1)
        store.set_timeout(timeout)
        return store
    endpoint, prefix = address.split(" ")
    return EtcdStore(connect(StoreOptions(endpoint)), prefix, timeout=timeout)


def make_subject(param: str, request: pytest.FixtureRequest, tmp_path) -> Subject:
    kind, _, wrap = param.partition("+")
    if kind == "tcp":
        port = free_port()
        inner, address = dist.TCPStore("127.0.0.1", port, 1, True, TIMEOUT), f"127.0.0.1:{port}"
    elif kind == "file":
        address = str(tmp_path / "store")
        inner = dist.FileStore(address, 1)
        inner.set_timeout(TIMEOUT)
    else:
        prefix = f"/test/{uuid.uuid4().hex}/"
        inner = EtcdStore(request.getfixturevalue("etcd"), prefix, timeout=TIMEOUT)
        address = f"{request.getfixturevalue('etcd_server').endpoint} {prefix}"
    store = dist.PrefixStore(ROUND_PREFIX, inner) if wrap else inner
    return Subject(kind, bool(wrap), store, inner, address)


def timed(expected: type[Exception], fn, match: str | None = None):
    """Run ``fn``, which must raise ``expected`` (matching ``match``); return (the exception, seconds taken)."""
    start = time.monotonic()
    with pytest.raises(expected, match=match) as raised:
        fn()
    return raised.value, time.monotonic() - start


class InThread(threading.Thread):
    """``fn()`` in a thread; ``result()`` joins it and returns what it returned or raises what it raised."""

    started: list["InThread"] = []  # every one, so a fixture can outwait them before closing the store

    def __init__(self, fn):
        super().__init__(daemon=True)
        self._fn, self._value, self._error = fn, None, None
        InThread.started.append(self)
        self.start()

    @classmethod
    def outwait_all(cls, timeout: float = 15.0) -> None:
        """Join every thread a case left behind (a case that failed before its thread's
        answer came): closing the store under a thread inside gRPC crashes the process."""
        for thread in cls.started:
            thread.join(timeout)
        cls.started = [t for t in cls.started if t.is_alive()]

    def run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the test's thread by result()
            self._error = exc

    def result(self, timeout: float = 10.0):
        self.join(timeout)
        assert not self.is_alive(), f"still running after {timeout} s"
        if self._error is not None:
            raise self._error
        return self._value


def peer_command(subject: Subject) -> list[str]:
    """The command line of a second process that answers ``subject``'s ping (see tests/store_peer.py)."""
    return [sys.executable, "-m", "tests.store_peer", subject.kind, subject.address,
            ROUND_PREFIX if subject.prefixed else ""]
