"""A second process on a store: ``python -m tests.store_peer KIND ADDRESS [PREFIX]``.

It opens the store on a connection of its own (``store_subjects.open_store``), behind
``PrefixStore(PREFIX)`` if one is given, sets ``ready``, blocks in ``wait(["ping"])`` until
the test's process sets it, and answers by setting ``pong`` to the ping's value.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from tests.store_subjects import open_store

# Long enough for a busy machine; the test fails on its own timeout long before.
PEER_TIMEOUT = timedelta(seconds=30)


def main(kind: str, address: str, prefix: str = "") -> None:
    inner = open_store(kind, address, PEER_TIMEOUT)
    store = dist.PrefixStore(prefix, inner) if prefix else inner
    store.set("ready", "1")
    store.wait(["ping"])
    store.set("pong", store.get("ping"))


if __name__ == "__main__":
    main(*sys.argv[1:])
