"""Before issue 22: torch's ``DynamicRendezvousHandler`` on one pickled state key.

Every join rewrites the whole O(N) state with a compare-and-swap, so a round costs
O(N^2) bytes and the CAS losers retry in a storm (no round of 128 nodes within 600 s).
Kept for two uses only: ``bench/rdzv_scale.py`` measures it beside the keys-based
handler, and the tests play an agent of the old version with it (a mixed-version job
must fail in one line).

torch notices a dead node only when its heartbeat is older than
``keep_alive_interval * keep_alive_max_attempt``; when a node's lease vanishes the
backend ages that node's heartbeat in the state it returns
(``torch_seam.aged_rendezvous_state``), so torch's own sanitizer drops it.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)

from elasticft.contract.keys import BACKEND_NAME, RunKeys
from elasticft.rendezvous.backend import (
    DEFAULT_LAST_CALL_TIMEOUT,
    EtcdRendezvousOptions,
    _connect_until,
)
from elasticft.rendezvous.membership import Membership
from elasticft.store import EtcdClient
from elasticft.store.c10d_store import EtcdStore
from elasticft.torch_seam import aged_rendezvous_state


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, compare-and-swapped on its mod_revision."""

    def __init__(self, client: EtcdClient, keys: RunKeys, membership: Membership | None = None):
        self._client = client
        self._key = keys.rdzv_state
        self._membership = membership

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._client.get(self._key)
        if found is None:
            return None
        return self._age_lost_nodes(found.value), found.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        expected = token if isinstance(token, int) else None
        swapped, current = self._client.compare_and_swap(self._key, expected, state)
        if current is None:
            return None
        return self._age_lost_nodes(current.value), current.mod_revision, swapped

    def _age_lost_nodes(self, state_bits: bytes) -> bytes:
        """Make nodes whose lease vanished look long silent to torch's sanitizer."""
        if self._membership is None:
            return state_bits
        return aged_rendezvous_state(state_bits, self._membership.lost_rdzv_identities())


def create_blob_handler(params: RendezvousParameters, client: EtcdClient | None = None) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler on the pickled-state backend (the old etcd-v3)."""
    options = EtcdRendezvousOptions.from_params(params)
    client = client or _connect_until(options)
    keys = RunKeys(params.run_id, options.key_prefix)
    membership = Membership(client, keys)
    backend = EtcdRendezvousBackend(client, keys, membership)
    store = EtcdStore(client, keys.c10d, timeout=timedelta(seconds=options.store_timeout))
    if params.config.get("last_call_timeout") is None:
        params.config["last_call_timeout"] = DEFAULT_LAST_CALL_TIMEOUT
    handler = create_dynamic_handler(store, backend, params)
    handler.eft_membership = membership  # closed by whoever made the handler
    return handler
