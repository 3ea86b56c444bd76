"""Where a formed round's bootstrap store listens: written once by rank 0, seen by the others.

torch's ``RendezvousStoreInfo.build`` has rank 0 write its address into the rendezvous store
and every other rank read it back: at N nodes that is 2(N - 1) reads, most of them made before
rank 0 has written, each then waiting on a watch of its own. Here rank 0 also writes the address
to ``rdzv/ctl/master/<r>`` (under its lease; ``contract/keys.py``), a control key: the other
members see it arrive in the control watch they hold anyway, so it costs them no request.

A rank 0 lost before it wrote leaves the others waiting: they look at the round's losses
(``Rounds.waiting``: the agent's membership watch, or the round's participant keys) every
``RECHECK`` seconds, and join again once one shows; past the store's timeout they give up, as
torch's read of the store would. At those looks they also read the store, where rank 0 writes
the address as well (torch's way, which an agent of an older eft reads and writes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

from elasticft.rendezvous.rounds import Round, Rounds
from elasticft.store.keyset import KeySet

RECHECK = 2.0  # seconds between two looks at the round's losses while rank 0's address is awaited


def publish(rounds: Rounds, formed: Round, addr: str, port: int) -> None:
    """Rank 0: where round ``formed``'s bootstrap store listens. Raises StoreError."""
    rounds.put_mine(rounds.keys.rdzv_master(formed.number), json.dumps({"addr": addr, "port": port}))


def await_master(rounds: Rounds, formed: Round, timeout: float,
                 in_store: Callable[[], tuple[str, int] | None]) -> tuple[str, int] | None:
    """Another rank: ``(addr, port)`` once rank 0 wrote it (``in_store``: where torch's way puts it,
    asked at each look); None when the round lost a member first (its rank 0 may be the one lost:
    join again). Raises RendezvousTimeoutError, StoreError."""
    key = rounds.keys.rdzv_master(formed.number)

    def written(control: KeySet) -> tuple[str, int] | None:
        raw = control.get(key)
        if raw is None:
            return None
        fields = json.loads(raw)
        return str(fields["addr"]), int(fields["port"])

    deadline = time.monotonic() + timeout
    while True:
        found = rounds.await_control(written, min(deadline, time.monotonic() + RECHECK))
        if found is not None or (found := in_store()) is not None:
            return found
        if rounds.waiting() > 0:
            return None
        if time.monotonic() >= deadline:
            raise RendezvousTimeoutError(
                f"round {formed.number} formed, but its rank 0 did not say where its store listens "
                f"within {timeout:g} s ({key})")
