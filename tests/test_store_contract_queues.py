"""torch's c10d Store queues (queue_push/queue_pop/queue_len), on TCPStore and on our EtcdStore.

The counterparts of torch's ``test_queues``, ``test_queues_nonblocking``,
``test_queues_bidirectional`` and ``test_queues_timeout`` (``test/distributed/test_store.py``),
and what torch's TCPStore does beyond them: a non-empty queue counts as present for ``check``
and ``wait`` (and wakes a waiter) but is not a key (``num_keys`` and ``get`` do not see it),
and two poppers never take the same item. FileStore has no queues; behind torch's
PrefixStore our store's queues are a strict xfail (see ``store_subjects.TORCH_GAPS``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.store_subjects import (
    SLACK,
    SUBJECTS,
    TIMEOUT,
    InThread,
    make_subject,
    timed,
)


@pytest.fixture(params=SUBJECTS)
def queues(request, tmp_path) -> Iterator[dist.Store]:
    """One of the stores, for a case on queues."""
    subject = make_subject(request.param, request, tmp_path)
    subject.needs("queues", request)
    yield subject.store  # a generator, so that subject.inner (and our store's overrides) lives as long as the case
    InThread.outwait_all()  # an xfail case (PrefixStore) leaves a waiter: the store must outlive it


def test_queue_is_fifo(queues):
    assert queues.queue_len("q") == 0
    for item in (b"1", b"2", "3"):
        queues.queue_push("q", item)
    assert queues.queue_len("q") == 3
    assert [queues.queue_pop("q") for _ in range(3)] == [b"1", b"2", b"3"]
    assert queues.queue_len("q") == 0


def test_a_queue_is_present_while_it_holds_items_but_is_not_a_key(queues):
    keys = queues.num_keys()
    assert not queues.check(["q"])
    queues.queue_push("q", "1")
    queues.queue_push("q", "2")
    assert queues.check(["q"])
    queues.wait(["q"])
    assert queues.num_keys() == keys
    queues.queue_pop("q")
    queues.queue_pop("q")
    assert not queues.check(["q"])


def test_wait_wakes_when_a_queue_gets_an_item(queues):
    twin = queues.clone()
    # the push wakes it at once; behind PrefixStore (xfail) it waits this long, outwaited at teardown
    waiter = InThread(lambda: twin.wait(["q"], timedelta(seconds=3)))
    queues.queue_push("q", "1")
    waiter.result()


def test_non_blocking_pop_of_an_empty_queue_raises(queues):
    _, took = timed(dist.QueueEmptyError, lambda: queues.queue_pop("q", block=False), match="empty")
    assert took < TIMEOUT.total_seconds()
    queues.queue_push("q", "a")
    assert queues.queue_pop("q", block=False) == b"a"


def test_blocking_pop_times_out_within_the_store_timeout(queues):
    error, took = timed(dist.DistStoreError, lambda: queues.queue_pop("q"), match="timeout")
    assert not isinstance(error, dist.QueueEmptyError), error
    assert TIMEOUT.total_seconds() * 0.9 <= took <= TIMEOUT.total_seconds() + SLACK
    queues.set_timeout(timedelta(seconds=0.05))
    _, took = timed(dist.DistStoreError, lambda: queues.queue_pop("q"), match="timeout")
    assert took < TIMEOUT.total_seconds()


def test_blocking_pop_wakes_when_an_item_is_pushed(queues):
    twin = queues.clone()
    popper = InThread(lambda: twin.queue_pop("q"))
    queues.queue_push("q", "x")
    assert popper.result() == b"x"


def test_two_threads_talk_through_two_queues(queues):
    def ask(store):
        store.queue_push("a", "a1")
        return store.queue_pop("b")

    def answer(store):
        question = store.queue_pop("a")
        store.queue_push("b", question + b"->b1")

    asker_store, answerer_store = queues.clone(), queues.clone()  # one per thread, as TCPStore needs
    asker, answerer = InThread(lambda: ask(asker_store)), InThread(lambda: answer(answerer_store))
    answerer.result()
    assert asker.result() == b"a1->b1"


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
