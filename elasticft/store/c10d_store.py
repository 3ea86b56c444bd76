"""A c10d ``Store`` on etcd v3, the store that the etcd-v3 rendezvous hands to agents.

torch's agents use it to assign ranks, share the master address and run the exit
barrier. Blocking reads (``get``, ``wait``, ``queue_pop``) read and, if there is nothing
yet, watch from the next revision, so they wake as soon as it is written instead of
polling. ``add`` and ``append`` are the client's read-modify-write (a compare-and-swap
on the key's mod_revision); ``compare_set`` is its own compare-and-swap loop.

Key layout: the store's keys are ``<prefix><key>``. A queue's items are
``<prefix without its trailing '/'>.queues/<quoted key>/<uuid>``, ordered by their
create revision: outside ``<prefix>`` so that, as in torch's TCPStore, queue items are
not keys (``num_keys``, ``list_keys`` and ``get`` do not see them), while ``check`` and
``wait`` count a non-empty queue as present, as TCPStore does.

Timeouts raise ``DistStoreError`` worded as TCPStore words them
(``wait timeout after 500ms, keys: <the etcd keys>``), so that code matching torch's
messages matches ours.

torch reaches a Python store through the pybind trampoline ``PythonStore``, which calls
Python methods by name: ``getNumKeys`` and ``deleteKey`` (its C++ names, not the
``num_keys``/``delete_key`` that Python callers use), ``clone``, ``has_extended_api``,
``multi_get``, ``multi_set``, ``append``. torch 2.13's trampoline forwards neither the
queue operations nor ``listKeys``, so behind torch's ``PrefixStore`` those raise torch's
NotImplementedError; called on this store directly they work.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import quote

from torch.distributed import DistStoreError, QueueEmptyError, Store

from elasticft.store.client import EtcdClient


def _as_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(Store):
    """c10d Store whose keys live under ``prefix`` in etcd.

    Hold the store in Python for as long as torch uses it (in a PrefixStore, say): pybind
    forgets a Python store's methods once its Python object is collected, and torch's calls
    then fail with "Tried to call pure virtual function".
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=600),
                 _clones: list | None = None):
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._queue_root = prefix.rstrip("/") + ".queues/"
        # pybind forgets a Python store's overrides once its Python object is collected,
        # and torch's C++ side holds clones without holding their Python objects: every
        # clone stays referenced here, by the whole family, for as long as the family lives.
        self._clones = _clones if _clones is not None else []
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _queue(self, key: str) -> str:
        return self._queue_root + quote(key, safe="") + "/"

    # -- what torch's trampoline and Python callers use -----------------------------

    def clone(self) -> EtcdStore:
        """A store on the same client, prefix and timeout, for use from another thread.

        The clone shares the client rather than opening its own: the client is safe to use from
        many threads (one gRPC channel carries concurrent calls; its watch registry is locked),
        and torch, which holds clones in C++ only, would never close a connection of a clone's own.
        """
        twin = EtcdStore(self._client, self._prefix, self.timeout, _clones=self._clones)
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        # multi_get, multi_set and append are implemented here (not torch's per-key
        # fallbacks), so Gloo may use them when it connects its ranks.
        return True

    def set(self, key: str, value) -> None:
        self._client.put(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_for([key], self.timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(keys, self.timeout)

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        self._client.put_many([(self._key(k), _as_bytes(v)) for k, v in zip(keys, values)])

    def add(self, key: str, num: int) -> int:
        total = self._client.update(self._key(key), lambda old: str(int(old) + num if old else num).encode())
        return int(total)

    def append(self, key: str, value) -> None:
        tail = _as_bytes(value)
        self._client.update(self._key(key), lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            current = self._client.get(full)
            if current is None:
                if expected:  # c10d semantics: an absent key only matches an empty expectation
                    return expected
                ok, _ = self._client.compare_and_swap(full, None, desired)
            elif current.value != expected:
                return current.value
            else:
                ok, _ = self._client.compare_and_swap(full, current.mod_revision, desired)
            if ok:
                return desired

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set or names a non-empty queue (as in TCPStore)."""
        return all(self._present(key)[0] for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set or names a non-empty queue; DistStoreError at ``timeout``."""
        timeout = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + timeout.total_seconds()
        for key in keys:
            while True:
                present, revision = self._present(key)
                if present:
                    break
                self._await_change([self._key(key), self._queue(key)], revision, deadline,
                                   lambda: self._timeout_error(keys, timeout))

    def deleteKey(self, key: str) -> bool:  # the name torch's trampoline calls
        return self._client.delete(self._key(key))

    def getNumKeys(self) -> int:  # the name torch's trampoline calls
        return self._client.count_prefix(self._prefix)

    def delete_key(self, key: str) -> bool:
        return self.deleteKey(key)

    def num_keys(self) -> int:
        """How many keys this store's prefix holds (queues are not keys)."""
        return self.getNumKeys()

    def list_keys(self) -> list[str]:
        """The names of this store's keys, without its prefix (queues are not keys)."""
        return [key[len(self._prefix):] for key in self._client.keys_with_prefix(self._prefix)]

    # -- queues ----------------------------------------------------------------------

    def queue_push(self, key: str, value) -> None:
        # A fresh key per item: its create revision gives the FIFO order, with no counter to race on.
        self._client.put(self._queue(key) + uuid.uuid4().hex, _as_bytes(value))

    def queue_len(self, key: str) -> int:
        return self._client.count_prefix(self._queue(key))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest item of queue ``key``; wait up to the store timeout if ``block``."""
        queue, timeout = self._queue(key), self.timeout
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            head, revision = self._client.first_created(queue)
            if head is not None:
                # Of two poppers that read the same head only one deletes it; the other reads the next.
                if self._client.delete_if_unchanged(head.key, head.mod_revision):
                    return head.value
                continue
            if not block:
                raise QueueEmptyError(f"queue is empty: {queue}")
            self._await_change([queue], revision, deadline, lambda: self._timeout_error([key], timeout))

    # -- waiting ---------------------------------------------------------------------

    def _present(self, key: str) -> tuple[bool, int]:
        """Whether ``key`` is set or its queue holds an item, and a revision to watch from."""
        found, revision = self._client.get_with_revision(self._key(key))
        # A push after the key was read has a later revision: a watch from there sees it.
        return found is not None or self._client.count_prefix(self._queue(key)) > 0, revision

    def _wait_for(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        """The values of ``keys``, waiting for each until ``timeout`` has passed in all."""
        deadline = time.monotonic() + timeout.total_seconds()
        values = []
        present = self._read_together(keys)
        for key in keys:
            full = self._key(key)
            if full in present:
                values.append(present[full])
                continue
            while True:
                found, revision = self._client.get_with_revision(full)
                if found is not None:
                    values.append(found.value)
                    break
                self._await_change([full], revision, deadline, lambda: self._timeout_error(keys, timeout))
        return values

    def _read_together(self, keys: list[str]) -> dict[str, bytes]:
        """The keys already set, read in one range request: a round's rank 0 reads every node's
        key (or Gloo its peers' addresses), and one request per key would be N round trips."""
        if len(keys) < 2:
            return {}
        wanted = {self._key(key) for key in keys}
        found, _ = self._client.get_range(min(wanted), max(wanted) + "\0")
        return {kv.key: kv.value for kv in found if kv.key in wanted}

    def _timeout_error(self, keys: list[str], timeout: timedelta) -> DistStoreError:
        # TCPStore's wording, naming every key waited for (by its etcd key, where one would look).
        milliseconds = round(timeout.total_seconds() * 1000)
        return DistStoreError(f"wait timeout after {milliseconds}ms, keys: {', '.join(map(self._key, keys))}")

    def _await_change(self, prefixes: list[str], revision: int, deadline: float,
                      timeout_error: Callable[[], DistStoreError]) -> None:
        """Return once anything under ``prefixes`` changes after ``revision``; raise ``timeout_error()`` at
        ``deadline``."""
        changed = threading.Event()
        cancels = [self._client.watch_prefix(prefix, lambda _events: changed.set(), start_revision=revision + 1)
                   for prefix in prefixes]
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not changed.wait(remaining):
                raise timeout_error()
        finally:
            for cancel in cancels:
                cancel()
