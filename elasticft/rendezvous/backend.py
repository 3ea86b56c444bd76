"""The ``etcd-v3`` rendezvous: torch's dynamic rendezvous on an etcd v3 backend.

torch's own ``etcd``/``etcd-v2`` backends speak the v2 API that etcd 3.6 removed.
This module keeps torch's ``DynamicRendezvousHandler`` (its state machine, its
heartbeats, its TCPStore sharing) and supplies the two pieces it asks for:

* ``EtcdRendezvousBackend``: the rendezvous state as one etcd key, written with a
  compare-and-swap on the key's mod_revision (the token torch passes back);
* ``EtcdStore`` (in ``elasticft.store.c10d_store``): the c10d Store handed to agents.

One thing is added. torch notices a dead node only when its heartbeat is older than
``keep_alive_interval * keep_alive_max_attempt`` (15 s by default). eft agents also
hold a lease per node; when a lease vanishes without a clean exit, the backend ages
that node's heartbeat in the state it returns (``torch_seam.aged_rendezvous_state``),
so torch's own sanitizer drops it at the next sync. Nodes with no lease record
(plain torchrun) keep torch's behaviour.

Registered as ``etcd-v3`` through the ``torchrun.handlers`` entry point
(``elasticft.rendezvous.plugin``), so
``torchrun --rdzv-backend etcd-v3`` works as well as ``eft-run``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)

from elasticft.config import MIN_LEASE_TTL
from elasticft.contract.keys import BACKEND_NAME, RunKeys
from elasticft.rendezvous.membership import Membership
from elasticft.store import EtcdClient, StoreOptions, StoreUnavailable, connect
from elasticft.store.c10d_store import EtcdStore
from elasticft.torch_seam import aged_rendezvous_state, stop_heartbeats

# Faster than torch's 30 s: a survivor set that meets --nnodes' minimum should
# resume training at once; late joiners are admitted at the next round anyway.
DEFAULT_LAST_CALL_TIMEOUT = 1

# torch's own keys: create_dynamic_handler reads these from --rdzv-conf, and
# torchrun's LaunchConfig always adds "timeout" (the c10d store's timeout).
TORCH_OPTIONS = (
    "timeout",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)


class RendezvousConfigError(ValueError):
    """A malformed --rdzv-conf / --rdzv-endpoint for the etcd-v3 backend."""


@dataclass(frozen=True)
class EtcdRendezvousOptions:
    """What ``--rdzv-endpoint`` and ``--rdzv-conf`` say about etcd."""

    store: StoreOptions
    key_prefix: str = "/eft"
    lease_ttl: float | None = None
    join_timeout: float = 600.0
    store_timeout: float = 900.0

    ETCD_KEYS = ("key_prefix", "cacert", "cert", "key", "user", "password", "lease_ttl", "etcd_timeout")

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> "EtcdRendezvousOptions":
        config = params.config
        unknown = sorted(set(config) - set(cls.ETCD_KEYS) - set(TORCH_OPTIONS))
        if unknown:
            raise RendezvousConfigError(
                f"--rdzv-conf: unknown option {unknown[0]!r} for etcd-v3; "
                f"expected some of {', '.join(cls.ETCD_KEYS + TORCH_OPTIONS)}"
            )
        if not params.endpoint:
            raise RendezvousConfigError("--rdzv-endpoint: etcd-v3 needs HOST:PORT of an etcd server")
        try:
            StoreOptions(params.endpoint).parsed_endpoints()
        except ValueError as exc:
            raise RendezvousConfigError(f"--rdzv-endpoint: {exc}") from None

        def number(name: str, default: float | None, minimum: float = 0.0) -> float | None:
            raw = config.get(name)
            if raw is None:
                return default
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise RendezvousConfigError(f"--rdzv-conf: {name} expects seconds, got {raw!r}") from None
            if not value > 0 or value < minimum:
                limit = f">= {minimum:g}" if minimum else "> 0"
                raise RendezvousConfigError(f"--rdzv-conf: {name} must be {limit}, got {raw!r}")
            return value

        for name in TORCH_OPTIONS:
            number(name, None)
        if ("cert" in config) != ("key" in config):
            raise RendezvousConfigError("--rdzv-conf: cert and key must be given together")
        if ("user" in config) != ("password" in config):
            raise RendezvousConfigError("--rdzv-conf: user and password must be given together")
        store = StoreOptions(
            endpoints=params.endpoint,
            cacert=config.get("cacert"),
            cert=config.get("cert"),
            key=config.get("key"),
            user=config.get("user"),
            password=config.get("password"),
            timeout=number("etcd_timeout", 10.0),
        )
        return cls(
            store=store,
            key_prefix=config.get("key_prefix", "/eft"),
            # the same floor as --eft-lease-ttl: one knob, two spellings, one rule
            lease_ttl=number("lease_ttl", None, MIN_LEASE_TTL),
            join_timeout=number("join_timeout", 600.0),
            store_timeout=number("timeout", 900.0),
        )


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


def _connect_until(options: EtcdRendezvousOptions) -> EtcdClient:
    """Connect, retrying until the join timeout: etcd may start after the agents."""
    deadline = time.monotonic() + options.join_timeout
    delay = 0.2
    while True:
        try:
            return connect(options.store)
        except StoreUnavailable:
            if time.monotonic() + delay > deadline:
                raise StoreUnavailable(
                    f"--rdzv-endpoint: no etcd answered at {options.store.endpoints} "
                    f"within the join timeout ({options.join_timeout:g} s)"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


# Watches opened for handlers in this process; torch never tells a backend it is
# done, so the launcher closes them before it stops an embedded etcd.
_open_memberships: list[Membership] = []


def close_watches() -> None:
    while _open_memberships:
        _open_memberships.pop().close()


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build torch's DynamicRendezvousHandler on etcd v3 (the registry's creator)."""
    options = EtcdRendezvousOptions.from_params(params)
    client = _connect_until(options)
    keys = RunKeys(params.run_id, options.key_prefix)
    membership = Membership(client, keys)
    _open_memberships.append(membership)
    backend = EtcdRendezvousBackend(client, keys, membership)
    store = EtcdStore(client, keys.c10d, timeout=timedelta(seconds=options.store_timeout))
    if params.config.get("last_call_timeout") is None:
        params.config["last_call_timeout"] = DEFAULT_LAST_CALL_TIMEOUT
    return create_dynamic_handler(store, backend, params)


def leave_without_closing(handler: RendezvousHandler) -> None:
    """Stop taking part in the rendezvous without closing it for the nodes that stay.

    torch's ``launch_agent`` calls ``handler.shutdown()`` whenever the agent returns,
    and the dynamic handler's shutdown *closes* the rendezvous: right when the job is
    over, fatal to the others when one node leaves a running job (their next round
    would fail as closed). So this handler's shutdown becomes "stop the heartbeats";
    the node's revoked lease makes the others' backends drop it from the round at once.
    """
    stop_heartbeats(handler)

    def shutdown() -> bool:
        return True

    handler.shutdown = shutdown
