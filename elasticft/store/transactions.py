"""The client's writes of several operations in one request (etcd transactions):
create-if-absent, compare-and-swap, a put with deletes, batches. A mixin of
``EtcdClient``: every request goes through its ``_call`` (errors, failover, the gate).
"""

from __future__ import annotations

from typing import Callable

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.etcd_requests import (
    absent,
    delete_op,
    get_op,
    key_value,
    modified_at,
    none_in,
    prefix_end,
    put_op,
    txn_op,
    txn_request,
)
from elasticft.store.etcd_rpc import TXN
from elasticft.store.lease import Lease
from elasticft.store.records import KeyValue

MAX_TXN_OPS = 128


class Transactions:
    def _call(self, fn, answered: bool = True):
        raise NotImplementedError

    def get(self, key: str) -> KeyValue | None:
        raise NotImplementedError

    def _txn(self, compare: list, success: list, failure: list = ()) -> api.TxnResponse:
        request = txn_request(compare, success, failure)
        return self._call(lambda rpc: rpc.call(TXN, request))

    def put_and_delete(self, key: str, value: bytes | str, lease: Lease | None, delete: list[str]) -> int:
        """Put ``key`` and delete the keys in ``delete``, atomically (one request); the revision."""
        answer = self._txn([], [put_op(key, value, lease.id if lease else None)] + [delete_op(k) for k in delete])
        return answer.header.revision

    def put_unless_and_read(self, key: str, value: bytes | str, lease: Lease | None, unless: tuple[str, str],
                            read: tuple[str, str], claim: tuple[str, str]) -> tuple[int, list[KeyValue], bool] | None:
        """Put ``key`` unless some key lies in the range ``unless`` [start, end); in the same request
        create ``claim`` (key, value) if absent, then read the range ``read``: (the revision, the keys
        read, whether ``claim`` was created), or None when something lay in ``unless`` (nothing done)."""
        lease_id = lease.id if lease else None
        answer = self._txn([none_in(*unless)],
                           [put_op(key, value, lease_id),
                            txn_op([absent(claim[0])], [put_op(claim[0], claim[1], lease_id)]),
                            get_op(read[0], read[1])])
        if not answer.succeeded:
            return None
        kvs = answer.responses[2].response_range.kvs
        return answer.header.revision, [key_value(kv) for kv in kvs], answer.responses[1].response_txn.succeeded

    def create(self, key: str, value: bytes | str, lease: Lease | None = None, delete: tuple[str, ...] = ()) -> bool:
        """Write ``key`` only if it does not exist (then also delete the keys in ``delete``,
        in the same transaction); True if this call created it."""
        success = [put_op(key, value, lease.id if lease else None)] + [delete_op(k) for k in delete]
        return self._txn([absent(key)], success).succeeded

    def compare_and_swap(
        self, key: str, expected_revision: int | None, value: bytes | str
    ) -> tuple[bool, KeyValue | None]:
        """Put ``value`` if the key's mod_revision is ``expected_revision`` (None: absent).

        Returns (swapped, current): on success ``current`` is the new key-value; on
        failure it is what the key holds now, so the caller can retry from it.
        """
        compare = absent(key) if expected_revision is None else modified_at(key, expected_revision)
        answer = self._txn([compare], [put_op(key, value), get_op(key)], [get_op(key)])
        kvs = answer.responses[-1].response_range.kvs
        if not kvs:
            return answer.succeeded, None
        return answer.succeeded, KeyValue(key, kvs[0].value, kvs[0].mod_revision, kvs[0].lease)

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
            self._txn([], [put_op(k, v) for k, v in items[start:start + MAX_TXN_OPS]])

    def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``; True if this call deleted it."""
        return self.delete_if_unchanged_with(key, mod_revision)

    def delete_if_unchanged_with(self, key: str, mod_revision: int, prefixes: tuple[str, ...] = (),
                                 keys: tuple[str, ...] = ()) -> bool:
        """Delete ``key``, every key under ``prefixes`` and ``keys``, in one transaction, only
        if ``key``'s mod_revision is still ``mod_revision``; True if this call deleted them."""
        success = ([delete_op(key)] + [delete_op(p, prefix_end(p)) for p in prefixes]
                   + [delete_op(k) for k in keys])
        return self._txn([modified_at(key, mod_revision)], success).succeeded

    def delete_keys(self, keys: list[str]) -> None:
        """Delete every key in ``keys``, in transactions of at most MAX_TXN_OPS deletes."""
        for start in range(0, len(keys), MAX_TXN_OPS):
            self._txn([], [delete_op(k) for k in keys[start:start + MAX_TXN_OPS]])
