"""Everything eft says to etcd goes through this package."""

from elasticft.store.client import (
    EtcdClient,
    KeyValue,
    Lease,
    StoreError,
    StoreOptions,
    StoreStatus,
    StoreUnavailable,
    WatchEvent,
    connect,
)
from elasticft.store.server import EmbeddedEtcd, EtcdNotFound, find_etcd, free_port

__all__ = [
    "EmbeddedEtcd",
    "EtcdClient",
    "EtcdNotFound",
    "KeyValue",
    "Lease",
    "StoreError",
    "StoreOptions",
    "StoreStatus",
    "StoreUnavailable",
    "WatchEvent",
    "connect",
    "find_etcd",
    "free_port",
]
