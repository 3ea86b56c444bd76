"""torch's c10d Store contract, checked on torch's TCPStore and FileStore and on our EtcdStore.

Each case runs on the three stores side by side, each also behind torch's PrefixStore
(as torch's agents see the store the rendezvous hands them), so that where our store
differs from torch's own ones the difference shows. A case one of torch's stores does
not support is skipped for that store, with the reason.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from elasticft.store import free_port
from elasticft.store.c10d_store import EtcdStore

TIMEOUT = timedelta(seconds=0.5)
# How late a timed-out call may return: a watch or socket has to notice, on a busy machine.
SLACK = 1.0

# What torch's own stores do not do, as measured on torch 2.13; our store must do all of it.
UNSUPPORTED = {
    "file": {
        "queues": "FileStore has no queues (torch raises NotImplementedError)",
        "dist_store_error": "FileStore times out with a plain RuntimeError, after about twice its timeout",
        "wait_timeout": "FileStore.wait ignores the timeout it is given and raises a plain RuntimeError",
        "delete_absent": "FileStore.delete_key returns True for a key it does not hold",
        "extended_api": "FileStore has no extended API (has_extended_api() is False)",
    },
}
# torch 2.13's trampoline for Python stores (PythonStore in torch/csrc/distributed/c10d/init.cpp)
# overrides no queue method, so PrefixStore's queue calls reach c10d::Store's NotImplementedError.
TORCH_QUEUE_GAP = "torch's PythonStore trampoline does not forward queuePush/queuePop/queueLen"


@dataclass
class Subject:
    kind: str  # "tcp", "file" or "etcd"
    prefixed: bool
    store: dist.Store
    inner: dist.Store  # held so that a Python store keeps its overrides (pybind forgets them otherwise)

    def needs(self, feature: str) -> None:
        reason = UNSUPPORTED.get(self.kind, {}).get(feature)
        if reason:
            pytest.skip(reason)


@pytest.fixture(params=["tcp", "tcp+prefix", "file", "file+prefix", "etcd", "etcd+prefix"])
def subject(request, tmp_path):
    kind, _, wrap = request.param.partition("+")
    if kind == "tcp":
        inner = dist.TCPStore("127.0.0.1", free_port(), 1, True, TIMEOUT)
    elif kind == "file":
        inner = dist.FileStore(str(tmp_path / "store"), 1)
        inner.set_timeout(TIMEOUT)
    else:
        client = request.getfixturevalue("etcd")
        inner = EtcdStore(client, f"/test/{uuid.uuid4().hex}/", timeout=TIMEOUT)
    store = dist.PrefixStore("round.1", inner) if wrap else inner
    yield Subject(kind, bool(wrap), store, inner)


@pytest.fixture
def queues(subject, request):
    """``subject``, for a case on queues."""
    subject.needs("queues")
    if subject.kind == "etcd" and subject.prefixed:
        # Not a skip: the day torch forwards queues this strict xfail fails, and we look again.
        request.node.add_marker(pytest.mark.xfail(raises=NotImplementedError, strict=True, reason=TORCH_QUEUE_GAP))
    return subject.store


def timed(expected: type[Exception], fn):
    """Run ``fn``, which must raise ``expected``; return (the exception, seconds it took)."""
    start = time.monotonic()
    with pytest.raises(expected) as raised:
        fn()
    return raised.value, time.monotonic() - start


class InThread(threading.Thread):
    """``fn()`` in a thread; ``result()`` joins it and returns what it returned or raises what it raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self._fn, self._value, self._error = fn, None, None
        self.start()

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


def test_set_then_get(subject):
    subject.store.set("k", "v")
    subject.store.set("b", b"\x00\xff")
    assert subject.store.get("k") == b"v" and subject.store.get("b") == b"\x00\xff"
    subject.store.set("k", "w")
    assert subject.store.get("k") == b"w"


def test_get_of_a_missing_key_times_out_within_the_store_timeout(subject):
    subject.needs("dist_store_error")
    _, took = timed(dist.DistStoreError, lambda: subject.store.get("missing"))
    assert TIMEOUT.total_seconds() * 0.9 <= took <= TIMEOUT.total_seconds() + SLACK


def test_add_counts_up_and_down(subject):
    assert subject.store.add("n", 5) == 5
    assert subject.store.add("n", -7) == -2
    assert subject.store.add("n", 0) == -2
    assert subject.store.get("n") == b"-2"


def test_compare_set(subject):
    store = subject.store
    assert store.compare_set("absent", "x", "y") == b"x"  # a non-empty expectation never matches an absent key
    assert not store.check(["absent"])
    assert store.compare_set("cs", "", "one") == b"one"  # an empty one creates it
    assert store.compare_set("cs", "wrong", "two") == b"one"  # a mismatch returns what is there
    assert store.compare_set("cs", "one", "two") == b"two"
    assert store.get("cs") == b"two"


def test_check(subject):
    subject.store.set("a", "1")
    assert subject.store.check(["a"])
    assert not subject.store.check(["a", "missing"])


def test_wait_returns_for_present_keys_and_times_out_with_its_own_timeout(subject):
    subject.store.set("a", "1")
    subject.store.wait(["a"])
    subject.store.wait(["a"], timedelta(seconds=5))
    subject.needs("wait_timeout")
    short = timedelta(seconds=0.2)  # shorter than the store's: the one given must be the one used
    _, took = timed(dist.DistStoreError, lambda: subject.store.wait(["a", "missing"], short))
    assert short.total_seconds() * 0.9 <= took < TIMEOUT.total_seconds()


def test_wait_wakes_when_the_key_is_set(subject):
    # A TCPStore object serves one thread at a time: a second thread gets a clone, as in torch.
    twin = subject.store.clone()
    waiter = InThread(lambda: twin.wait(["late"], timedelta(seconds=10)))
    subject.store.set("late", "1")
    waiter.result()


def test_delete_key(subject):
    subject.store.set("d", "1")
    assert subject.store.delete_key("d") is True
    assert not subject.store.check(["d"])
    subject.needs("delete_absent")
    assert subject.store.delete_key("d") is False
    assert subject.store.delete_key("never") is False


def test_num_keys_follows_sets_and_deletes(subject):
    # torch's stores count keys of their own (and PrefixStore counts the whole store):
    # what holds for all of them is the change.
    store = subject.store
    before = store.num_keys()
    store.set("a", "1")
    store.set("b", "2")
    store.set("a", "3")
    assert store.num_keys() == before + 2
    store.delete_key("a")
    assert store.num_keys() == before + 1


def test_multi_set_and_multi_get(subject):
    subject.store.multi_set(["m1", "m2", "m3"], ["1", b"2", "3"])
    assert subject.store.multi_get(["m3", "m1", "m2"]) == [b"3", b"1", b"2"]
    assert subject.store.get("m2") == b"2"


def test_append(subject):
    subject.store.append("log", "a")  # an absent key starts empty
    subject.store.append("log", b"bc")
    assert subject.store.get("log") == b"abc"


def test_has_extended_api(subject):
    subject.needs("extended_api")
    assert subject.store.has_extended_api() is True


def test_clone_is_usable_from_another_thread(subject):
    twin = subject.store.clone()
    gc.collect()  # torch holds clones in C++ only: the clone must work with no Python reference to it
    subject.store.set("early", "1")

    def use_twin():
        early = twin.get("early")
        twin.set("from-twin", "2")
        return early, twin.get("late")  # blocks until the main thread sets it

    user = InThread(use_twin)
    subject.store.set("late", "3")
    assert user.result() == (b"1", b"3")
    assert subject.store.get("from-twin") == b"2"


def test_queue_is_fifo(queues):
    for item in (b"1", b"2", "3"):
        queues.queue_push("q", item)
    assert queues.queue_len("q") == 3
    assert [queues.queue_pop("q") for _ in range(3)] == [b"1", b"2", b"3"]
    assert queues.queue_len("q") == 0
    assert queues.queue_len("never-pushed") == 0
    assert not queues.check(["q"])  # a queue is not a key


def test_non_blocking_pop_of_an_empty_queue_raises(queues):
    _, took = timed(dist.QueueEmptyError, lambda: queues.queue_pop("q", False))
    assert took < TIMEOUT.total_seconds()


def test_blocking_pop_times_out_within_the_store_timeout(queues):
    error, took = timed(dist.DistStoreError, lambda: queues.queue_pop("q"))
    assert not isinstance(error, dist.QueueEmptyError), error
    assert TIMEOUT.total_seconds() * 0.9 <= took <= TIMEOUT.total_seconds() + SLACK


def test_blocking_pop_wakes_when_an_item_is_pushed(queues):
    twin = queues.clone()
    popper = InThread(lambda: twin.queue_pop("q"))
    queues.queue_push("q", "x")
    assert popper.result() == b"x"


def test_two_poppers_never_take_the_same_item(queues):
    items = [str(i).encode() for i in range(30)]
    for item in items:
        queues.queue_push("q", item)
    start = threading.Barrier(2)

    def pop_all(store) -> list[bytes]:
        mine = []
        start.wait()
        while True:
            try:
                mine.append(store.queue_pop("q", False))
            except dist.QueueEmptyError:
                return mine

    twins = [queues.clone(), queues.clone()]  # one per thread, as TCPStore needs
    poppers = [InThread(lambda twin=twin: pop_all(twin)) for twin in twins]
    taken = [popper.result(20) for popper in poppers]
    assert sorted(taken[0] + taken[1], key=int) == items  # every item once: none lost, none twice
    assert taken[0] == sorted(taken[0], key=int) and taken[1] == sorted(taken[1], key=int)  # each in FIFO order
