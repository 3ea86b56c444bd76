"""The ``etcd-v3`` rendezvous: what --rdzv-endpoint/--rdzv-conf say, and the handler built from them.

torch's own ``etcd``/``etcd-v2`` backends speak the v2 API that etcd 3.6 removed.
``create_handler`` builds eft's ``EtcdRendezvousHandler`` (``handler.py``): membership
as one etcd key per node under its lease, a small closing decision per round, ranks
from a count (``rounds.py``): O(N) bytes per round where torch's pickled state, which
eft used before (``blob.py``, kept for the bench and the mixed-version check), costs
O(N^2) and a compare-and-swap storm. The c10d Store handed to agents is ``EtcdStore``
(``elasticft.store.c10d_store``).

Registered as ``etcd-v3`` through the ``torchrun.handlers`` entry point
(``elasticft.rendezvous.plugin``), so
``torchrun --rdzv-backend etcd-v3`` works as well as ``eft-run``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
)

from elasticft.config import MIN_LEASE_TTL
from elasticft.contract.keys import RunKeys
from elasticft.rendezvous.handler import (
    EtcdRendezvousHandler,
    RendezvousStoreUnavailable,
    node_name,
)
from elasticft.rendezvous.decision import SegmentRule
from elasticft.rendezvous.held import Admission
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.rendezvous.rounds import RoundLimits, Rounds
from elasticft.rendezvous.standby import Standby
from elasticft.store import EtcdClient, StoreOptions, StoreUnavailable, connect
from elasticft.store.c10d_store import EtcdStore
from elasticft import torch_seam

log = logging.getLogger(__name__)

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

    etcd_outage_limit: float = 600.0
    peer_probe_timeout: float = 10.0  # 0: no node ever stands aside (rendezvous/aside.py)

    ETCD_KEYS = ("key_prefix", "cacert", "cert", "key", "user", "password", "lease_ttl", "etcd_timeout",
                 "etcd_outage_limit", "peer_probe_timeout")

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> EtcdRendezvousOptions:
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

        def number(name: str, default: float | None, minimum: float = 0.0, zero_is_off: bool = False) -> float | None:
            raw = config.get(name)
            if raw is None:
                return default
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise RendezvousConfigError(f"--rdzv-conf: {name} expects seconds, got {raw!r}") from None
            if zero_is_off and value == 0:
                return 0.0
            if not value > 0 or value < minimum:
                limit = f">= {minimum:g}" if minimum else "> 0" + (" (or 0: off)" if zero_is_off else "")
                raise RendezvousConfigError(f"--rdzv-conf: {name} must be {limit}, got {raw!r}")
            return value

        for name in TORCH_OPTIONS:
            number(name, None)
        if ("cert" in config) != ("key" in config):
            raise RendezvousConfigError("--rdzv-conf: cert and key must be given together")
        if "https://" in params.endpoint and "cacert" not in config:
            raise RendezvousConfigError("--rdzv-conf: an https:// endpoint needs cacert=FILE "
                                        "(the CA that signed etcd's certificate)")
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
            etcd_outage_limit=number("etcd_outage_limit", 600.0),
            peer_probe_timeout=number("peer_probe_timeout", 10.0, zero_is_off=True),
        )


def _connect_until(options: EtcdRendezvousOptions) -> EtcdClient:
    """Connect, retrying until the join timeout: etcd may start after the agents.

    This is the job's first contact with its etcd. Until etcd has answered once, silence is
    as likely a mistyped --rdzv-endpoint as an etcd still starting, so the wait says so and
    when it gives up (an etcd that answered before and went away is an outage: outage.py)."""
    started = time.monotonic()
    deadline = started + options.join_timeout
    delay, said = 0.2, None
    while True:
        try:
            probe = connect(options.store, probe=True)  # its failures are not an outage of etcd
        except StoreUnavailable:
            now = time.monotonic()
            if now + delay > deadline:
                raise RendezvousStoreUnavailable(
                    f"--rdzv-endpoint: no etcd answered at {options.store.endpoints} "
                    f"within the join timeout ({options.join_timeout:g} s)"
                ) from None
            if said is None or now - said >= FIRST_CONTACT_REPORT_EVERY:
                _say_first_contact(options, now - started, deadline - now, first=said is None)
                said = now
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        probe.close()
        return connect(options.store)


FIRST_CONTACT_REPORT_EVERY = 30.0  # seconds between two "no etcd yet" lines


def _say_first_contact(options: EtcdRendezvousOptions, waited: float, left: float, first: bool) -> None:
    gives_up = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
    if first:
        log.warning("no etcd answers at %s: this is the job's first contact with it (is --rdzv-endpoint right?); "
                    "waiting for it up to the join timeout, %g s: giving up at %s (--rdzv-conf join_timeout)",
                    options.store.endpoints, options.join_timeout, gives_up)
    else:
        log.warning("still no etcd at %s after %.0f s: giving up in %.0f s, at %s (--rdzv-conf join_timeout)",
                    options.store.endpoints, waited, left, gives_up)


# Handlers made in this process; torch never tells a handler it is done, so the
# launcher stops their watches before it stops an embedded etcd.
_open_rounds: list[Rounds] = []


def close_watches() -> None:
    while _open_rounds:
        _open_rounds.pop().stop_watching()


# The lease of a handler's participant keys when --rdzv-conf names none: eft's --eft-lease-ttl default.
DEFAULT_LEASE_TTL = 3.0


def rendezvous_limits(params: RendezvousParameters, options: EtcdRendezvousOptions) -> RoundLimits:
    last_call = params.config.get("last_call_timeout")
    return RoundLimits(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        last_call=float(last_call) if last_call is not None else DEFAULT_LAST_CALL_TIMEOUT,
        join_timeout=options.join_timeout,
    )


def create_handler(params: RendezvousParameters, client: EtcdClient | None = None) -> RendezvousHandler:
    """Build eft's keys-based handler (the registry's creator); ``client`` shares a connection (bench)."""
    options = EtcdRendezvousOptions.from_params(params)
    client = client or _connect_until(options)
    keys = RunKeys(params.run_id, options.key_prefix)
    rounds = Rounds(client, keys, node_name(params.local_addr), rendezvous_limits(params, options),
                    lease_ttl=options.lease_ttl or DEFAULT_LEASE_TTL)
    _open_rounds.append(rounds)
    store = EtcdStore(client, keys.c10d, timeout=timedelta(seconds=options.store_timeout))
    close_timeout = params.config.get("close_timeout")  # validated by from_params
    return EtcdRendezvousHandler(rounds, store, params.run_id, params.local_addr,
                                 close_timeout=float(close_timeout) if close_timeout is not None else None,
                                 outage_limit=options.etcd_outage_limit, probe_timeout=options.peer_probe_timeout)


def share_node_lease(handler: RendezvousHandler, node: NodeLease, membership: Membership) -> Standby | None:
    """Under eft's agent: the rendezvous keys go under the node's lease, and the rendezvous
    learns of lost members from the agent's membership watch instead of a watch of its own
    (one keep-alive and one watch event per node, not two; ``round_lease``, ``member_losses``).
    Returns the node's ``Standby`` (``standby.py``: when it waits as a spare); None on another backend."""
    if isinstance(handler, EtcdRendezvousHandler):
        handler.rounds.share_with_agent(node.lease, node.rejoin, membership.lost.is_set)
        return handler.rounds.standby
    return None


def use_segments(handler: RendezvousHandler, rule: SegmentRule) -> None:
    """Under eft's agent with ``--eft-segment``: rounds take whole segments (``segments.py``).
    Other backends know no segments (eft-run refuses --eft-segment with them)."""
    if isinstance(handler, EtcdRendezvousHandler):
        handler.rounds.segments = rule


def hold_joins(handler: RendezvousHandler, admission: Admission) -> None:
    """Under eft's agent: ask ``admission`` before nodes waiting to join count as waiting
    (``held.py``; ``--eft-join-at``). Other backends: nodes join as torch lets them."""
    if isinstance(handler, EtcdRendezvousHandler):
        handler.rounds.admission = admission


def close_for_everyone(handler: RendezvousHandler) -> None:
    """Close eft's rendezvous (torch's ``set_closed``): nodes waiting to join leave; etcd out of
    reach costs a warning (torch's launcher tries again as the agent returns)."""
    if isinstance(handler, EtcdRendezvousHandler):
        try:
            handler.set_closed()
        except RendezvousError as exc:
            log.warning("could not close the rendezvous: %s", exc)


def rendezvous_closed(handler: RendezvousHandler) -> bool:
    """Whether eft's rendezvous is closed (the job ended); False when etcd does not say."""
    try:
        return isinstance(handler, EtcdRendezvousHandler) and handler.is_closed()
    except RendezvousError:
        return False


def rendezvous_round(handler: RendezvousHandler) -> int:
    """The round this node joined last: the same number on every node of the round (one
    restart cycle job-wide, as ``agent/restart_budget.py`` counts them)."""
    if isinstance(handler, EtcdRendezvousHandler):
        if handler.round is None:
            raise RuntimeError("rendezvous_round() before the first next_rendezvous()")
        return handler.round.number
    return torch_seam.rendezvous_round(handler)  # torch's own handler (the old blob backend)


def rendezvous_revision(handler: RendezvousHandler) -> int | None:
    """The etcd revision the members of the round this node joined last were counted at
    (None: not eft's etcd-v3 handler, or no round yet)."""
    if isinstance(handler, EtcdRendezvousHandler) and handler.round is not None:
        return handler.round.revision
    return None


def stand_aside_if_cut(handler: RendezvousHandler) -> bool:
    """After a round's ranks are assigned: True when this node stood aside from it (it
    cannot reach the round's master; ``aside.py``) and may now join a new round."""
    return isinstance(handler, EtcdRendezvousHandler) and handler.stand_aside_if_cut()


def leave_without_closing(handler: RendezvousHandler) -> None:
    """Stop taking part in the rendezvous without closing it for the nodes that stay.

    torch's ``launch_agent`` calls ``handler.shutdown()`` whenever the agent returns,
    and a handler's shutdown *closes* the rendezvous: right when the job is over, fatal
    to the others when one node leaves a running job. The node's keys vanish with its
    lease, so the others re-rendezvous without it at once.
    """
    if isinstance(handler, EtcdRendezvousHandler):
        handler.leave_without_closing()
        return
    # torch's own handler (the old blob backend, in the bench and tests): stop its heartbeats only
    torch_seam.stop_heartbeats(handler)

    def shutdown() -> bool:
        return True

    handler.shutdown = shutdown
