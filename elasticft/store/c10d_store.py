"""A c10d ``Store`` on etcd v3, the store that the etcd-v3 rendezvous hands to agents.

torch's agents use it to assign ranks, share the master address and run the exit
barrier. Blocking reads (``get``, ``wait``) read the key and, if it is absent, watch
it from the next revision, so they wake as soon as it is written instead of polling.
Counters (``add``) are compare-and-swap loops on the key's mod_revision.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from elasticft.store.client import EtcdClient


def _as_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(Store):
    """c10d Store whose keys live under ``prefix`` in etcd."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=600)):
        super().__init__()
        self._client = client
        self._prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value) -> None:
        self._client.put(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        self._wait_for([key], self.timeout)
        found = self._client.get(self._key(key))
        if found is None:  # deleted between the wait and the read
            raise LookupError(f"key {key!r} vanished from the etcd store")
        return found.value

    def add(self, key: str, num: int) -> int:
        full = self._key(key)
        while True:
            current = self._client.get(full)
            value = int(current.value) + num if current else num
            ok, _ = self._client.compare_and_swap(
                full, current.mod_revision if current else None, str(value).encode()
            )
            if ok:
                return value

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            current = self._client.get(full)
            if current is None:
                if expected:  # c10d semantics: an absent key only matches an empty expectation
                    return expected
                ok, now = self._client.compare_and_swap(full, None, desired)
            elif current.value != expected:
                return current.value
            else:
                ok, now = self._client.compare_and_swap(full, current.mod_revision, desired)
            if ok:
                return desired

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout if timeout is not None else self.timeout)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        items, _ = self._client.get_prefix(self._prefix)
        return len(items)

    def _wait_for(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        for key in keys:
            full = self._key(key)
            while True:
                found, revision = self._client.get_with_revision(full)
                if found is not None:
                    break
                changed = threading.Event()
                cancel = self._client.watch_prefix(full, lambda _events: changed.set(), start_revision=revision + 1)
                try:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not changed.wait(remaining):
                        raise DistStoreError(f"timed out after {timeout} waiting for key {key!r} in the etcd store")
                finally:
                    cancel()
