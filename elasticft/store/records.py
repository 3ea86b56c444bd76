"""What the etcd client hands back: plain records, free of the etcd library's types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int
    create_revision: int = 0


@dataclass(frozen=True)
class StoreStatus:
    """What the answering etcd member says of itself: its database file's size (bytes; it
    grows with history until compacted, and does not shrink without a defragment), the
    store revision, and the name of the member it knows as the cluster's leader ("" while
    there is none: an election)."""

    db_size: int
    revision: int
    leader: str = ""


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix; ``value`` is empty for deletes."""

    key: str
    value: bytes
    deleted: bool
    revision: int
