"""The client's writes of several operations in one request (etcd transactions):
create-if-absent, compare-and-swap, a put with deletes, batches. A mixin of
``EtcdClient``: every request goes through its ``_call`` (errors, failover, the gate).
"""

from __future__ import annotations

from typing import Callable

from elasticft.store.lease import Lease
from elasticft.store.records import KeyValue

# etcd refuses a transaction of more operations than its --max-txn-ops (128 by default).
MAX_TXN_OPS = 128


def prefix_end(prefix: str) -> str:
    """The first key after every key under ``prefix`` (etcd's range end for a prefix)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Transactions:
    def _call(self, fn, answered: bool = True):
        raise NotImplementedError

    def get(self, key: str) -> KeyValue | None:
        raise NotImplementedError

    def put_and_delete(self, key: str, value: bytes | str, lease: Lease | None, delete: list[str]) -> int:
        """Put ``key`` and delete the keys in ``delete``, atomically (one request); the revision."""

        def txn(c):
            _, responses = c.transaction(
                compare=[],
                success=[c.transactions.put(key, value, lease.id if lease else None)]
                + [c.transactions.delete(k) for k in delete],
                failure=[],
            )
            return responses[0].response_put.header.revision

        return self._call(txn)

    def put_unless_and_read(self, key: str, value: bytes | str, lease: Lease | None, unless: tuple[str, str],
                            read: tuple[str, str], claim: tuple[str, str]) -> tuple[int, list[KeyValue], bool] | None:
        """Put ``key`` unless some key lies in the range ``unless`` [start, end); in the same request
        create ``claim`` (key, value) if absent, then read the range ``read``: (the revision, the keys
        read, whether ``claim`` was created), or None when something lay in ``unless`` (nothing done)."""

        def txn(c):
            lease_id = lease.id if lease else None
            ok, responses = c.transaction(
                compare=[c.transactions.version(unless[0], range_end=unless[1]) == 0],  # a range: no key in it
                success=[c.transactions.put(key, value, lease_id),
                         c.transactions.txn([c.transactions.create(claim[0]) == 0],
                                            [c.transactions.put(claim[0], claim[1], lease_id)], []),
                         c.transactions.get(read[0], range_end=read[1])],
                failure=[],
            )
            if not ok:
                return None
            return responses[0].response_put.header.revision, [
                KeyValue(meta.key.decode(), kv_value, meta.mod_revision, meta.lease_id, meta.create_revision)
                for kv_value, meta in responses[2]], responses[1].response_txn.succeeded

        return self._call(txn)

    def create(self, key: str, value: bytes | str, lease: Lease | None = None, delete: tuple[str, ...] = ()) -> bool:
        """Write ``key`` only if it does not exist (then also delete the keys in ``delete``,
        in the same transaction); True if this call created it."""

        def txn(c):
            ok, _ = c.transaction(
                compare=[c.transactions.create(key) == 0],
                success=[c.transactions.put(key, value, lease.id if lease else None)]
                + [c.transactions.delete(k) for k in delete],
                failure=[],
            )
            return ok

        return self._call(txn)

    def compare_and_swap(
        self, key: str, expected_revision: int | None, value: bytes | str
    ) -> tuple[bool, KeyValue | None]:
        """Put ``value`` if the key's mod_revision is ``expected_revision`` (None: absent).

        Returns (swapped, current): on success ``current`` is the new key-value; on
        failure it is what the key holds now, so the caller can retry from it.
        """

        def txn(c):
            if expected_revision is None:
                compare = [c.transactions.create(key) == 0]
            else:
                compare = [c.transactions.mod(key) == expected_revision]
            ok, responses = c.transaction(
                compare=compare,
                success=[c.transactions.put(key, value), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )
            ranges = [r for r in responses if isinstance(r, list)]
            items = ranges[-1] if ranges else []
            if not items:
                return ok, None
            v, meta = items[0]
            return ok, KeyValue(key, v, meta.mod_revision, meta.lease_id)

        return self._call(txn)

    def update(self, key: str, change: Callable[[bytes | None], bytes | str]) -> bytes | str:
        """Read-modify-write ``key`` atomically: ``change(current value or None)`` is written
        with a compare-and-swap, retried from what the key holds after a lost race."""
        current = self.get(key)
        while True:
            value = change(current.value if current is not None else None)
            swapped, now = self.compare_and_swap(key, current.mod_revision if current is not None else None, value)
            if swapped:
                return value
            current = now

    def put_many(self, items: list[tuple[str, bytes | str]]) -> None:
        """Write every (key, value), in transactions of at most MAX_TXN_OPS puts, in order."""
        for start in range(0, len(items), MAX_TXN_OPS):
            batch = items[start:start + MAX_TXN_OPS]
            self._call(
                lambda c, batch=batch: c.transaction(
                    compare=[], success=[c.transactions.put(k, v) for k, v in batch], failure=[]
                )
            )

    def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``; True if this call deleted it."""
        return self.delete_if_unchanged_with(key, mod_revision)

    def delete_if_unchanged_with(self, key: str, mod_revision: int, prefixes: tuple[str, ...] = (),
                                 keys: tuple[str, ...] = ()) -> bool:
        """Delete ``key``, every key under ``prefixes`` and ``keys``, in one transaction, only
        if ``key``'s mod_revision is still ``mod_revision``; True if this call deleted them."""

        def txn(c):
            ok, _ = c.transaction(
                compare=[c.transactions.mod(key) == mod_revision],
                success=[c.transactions.delete(key)]
                + [c.transactions.delete(p, range_end=prefix_end(p)) for p in prefixes]
                + [c.transactions.delete(k) for k in keys],
                failure=[],
            )
            return ok

        return self._call(txn)

    def delete_keys(self, keys: list[str]) -> None:
        """Delete every key in ``keys``, in transactions of at most MAX_TXN_OPS deletes."""
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start:start + MAX_TXN_OPS]
            self._call(lambda c, batch=batch: c.transaction(
                compare=[], success=[c.transactions.delete(k) for k in batch], failure=[]))
