"""etcd's request messages as eft builds them: keys as text, values as bytes or text, ranges
as [key, range_end), and a transaction's comparisons and operations."""

from __future__ import annotations

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.records import KeyValue

_SORT_ORDER = {None: api.RangeRequest.NONE, "ascend": api.RangeRequest.ASCEND, "descend": api.RangeRequest.DESCEND}
_SORT_TARGET = {None: api.RangeRequest.KEY, "key": api.RangeRequest.KEY, "create": api.RangeRequest.CREATE,
                "mod": api.RangeRequest.MOD}


def key_value(kv: api.KeyValue) -> KeyValue:
    """etcd's key-value as eft's record."""
    return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)


def to_bytes(text: bytes | str) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def prefix_end(prefix: str) -> str:
    """The first key after every key under ``prefix`` (etcd's range end for a prefix)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def range_request(key: str, range_end: str | None = None, *, limit: int = 0, revision: int | None = None,
                  sort_order: str | None = None, sort_target: str | None = None, keys_only: bool = False,
                  count_only: bool = False) -> api.RangeRequest:
    """A read of ``key``, or of [key, range_end) when ``range_end`` is given."""
    return api.RangeRequest(key=to_bytes(key), range_end=to_bytes(range_end) if range_end else b"", limit=limit,
                            revision=revision or 0, sort_order=_SORT_ORDER[sort_order],
                            sort_target=_SORT_TARGET[sort_target], keys_only=keys_only, count_only=count_only)


def put_request(key: str, value: bytes | str, lease: int | None = None) -> api.PutRequest:
    return api.PutRequest(key=to_bytes(key), value=to_bytes(value), lease=lease or 0)


def delete_request(key: str, range_end: str | None = None) -> api.DeleteRangeRequest:
    return api.DeleteRangeRequest(key=to_bytes(key), range_end=to_bytes(range_end) if range_end else b"")


# -- a transaction's parts ----------------------------------------------------------

def absent(key: str) -> api.Compare:
    """True when ``key`` does not exist (its create revision is 0)."""
    return api.Compare(key=to_bytes(key), target=api.Compare.CREATE, result=api.Compare.EQUAL, create_revision=0)


def none_in(start: str, end: str) -> api.Compare:
    """True when no key lies in [start, end) (every key's version there is 0)."""
    return api.Compare(key=to_bytes(start), range_end=to_bytes(end), target=api.Compare.VERSION,
                       result=api.Compare.EQUAL, version=0)


def modified_at(key: str, mod_revision: int) -> api.Compare:
    """True when ``key`` was last written at ``mod_revision``."""
    return api.Compare(key=to_bytes(key), target=api.Compare.MOD, result=api.Compare.EQUAL,
                       mod_revision=mod_revision)


def put_op(key: str, value: bytes | str, lease: int | None = None) -> api.RequestOp:
    return api.RequestOp(request_put=put_request(key, value, lease))


def delete_op(key: str, range_end: str | None = None) -> api.RequestOp:
    return api.RequestOp(request_delete_range=delete_request(key, range_end))


def get_op(key: str, range_end: str | None = None) -> api.RequestOp:
    return api.RequestOp(request_range=range_request(key, range_end))


def txn_request(compare: list[api.Compare], success: list[api.RequestOp],
                failure: list[api.RequestOp] = ()) -> api.TxnRequest:
    return api.TxnRequest(compare=compare, success=success, failure=list(failure))


def txn_op(compare: list[api.Compare], success: list[api.RequestOp]) -> api.RequestOp:
    """A transaction inside a transaction (etcd runs it as one of the outer one's operations)."""
    return api.RequestOp(request_txn=txn_request(compare, success))
