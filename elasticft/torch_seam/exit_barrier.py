"""torch's exit barrier, where its agents meet once their workers are done.

A finished agent counts itself in (``_TERMINAL_STATE_SYNC_ID`` + ``_NUM_MEMBERS``) and waits
up to ``exit_barrier_timeout`` (300 s) for the others: the store lives in one of them, which
must not leave first. Two kinds of node see it from outside: a spare, with no workers of its
own, finishes once a working node is in; and a node stopped by a signal after its workers
saved (a pod deleted, a node drained) counts itself in without waiting, so that the nodes the
signal did not reach, whose workers stopped with the same save, do not wait 300 s for one
that is gone.
"""

from __future__ import annotations

import inspect
from typing import Any

from elasticft.torch_seam import TorchSeamError, _attribute, rendezvous_store

try:
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS, _barrier_nonblocking
except ImportError as exc:
    raise TorchSeamError(str(exc)) from exc

if tuple(inspect.signature(_barrier_nonblocking).parameters) != ("store", "world_size", "key_prefix"):
    raise TorchSeamError(f"_barrier_nonblocking takes {tuple(inspect.signature(_barrier_nonblocking).parameters)}, "
                         "not (store, world_size, key_prefix)")


def exit_barrier_key() -> str:
    """The store key torch's exit barrier counts finished agents under: its existence means
    some node's workers are done."""
    return _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS


def exit_barrier_reached(store: Any) -> bool:
    """True once any agent entered torch's exit barrier in ``store``.

    Store errors propagate: the caller decides what a store in trouble means.
    """
    return bool(store.check([exit_barrier_key()]))


def check_in_at_exit(agent: Any) -> None:
    """Count ``agent`` in at its round's exit barrier and return at once (torch's own
    check-in, without its wait). Store errors propagate: the store may have left with its host."""
    store = rendezvous_store(agent)
    if store is None:
        return  # no round formed: no one waits for this node
    group = _attribute(agent, "_worker_group")
    _barrier_nonblocking(store, group.group_world_size, _TERMINAL_STATE_SYNC_ID)
