"""Everything eft says to etcd goes through this package."""

from .client import (
    EtcdClient,
    KeyValue,
    Lease,
    StoreError,
    StoreOptions,
    StoreUnavailable,
    WatchEvent,
    connect,
)
from .keys import RunKeys
from .server import EmbeddedEtcd, EtcdNotFound, find_etcd, free_port

__all__ = [
    "EmbeddedEtcd",
    "EtcdClient",
    "EtcdNotFound",
    "KeyValue",
    "Lease",
    "RunKeys",
    "StoreError",
    "StoreOptions",
    "StoreUnavailable",
    "WatchEvent",
    "connect",
    "find_etcd",
    "free_port",
]
