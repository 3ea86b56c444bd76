"""A small etcd v3 client: eft's own, on etcd's gRPC API (etcd_rpc.py, etcd_api.proto).

It offers what eft needs and nothing more: get/put/delete, compare-and-swap on a
key's mod_revision, create-if-absent, leases kept alive by a thread, and prefix
watches delivered to a callback. gRPC's errors become ``StoreError`` (or
``StoreUnavailable`` when etcd cannot be reached) so callers never see gRPC.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from elasticft.store import etcd_api_pb2 as api
from elasticft.store import etcd_rpc
from elasticft.store.auth import TokenRenewal
from elasticft.store.call_gate import CallGate
from elasticft.store.errors import (
    StoreClosed,
    StoreError,
    StoreUnavailable,
    TokenExpired,
    error_of,
    one_line,
    watch_error,
)
from elasticft.store.etcd_requests import delete_request, key_value, prefix_end, put_request, range_request
from elasticft.store.etcd_rpc import MEMBER_DOWN_CODES, Members, NoMemberAvailable
from elasticft.store.etcd_watch import Watches, WatchCompacted, WatchNotCreated
from elasticft.store.lease import Lease, LeaseKeeper
from elasticft.store.options import StoreOptions
from elasticft.store.outage import Outage, outage_of
from elasticft.store.tls import tls_error_behind
from elasticft.store.transactions import MAX_TXN_OPS, Transactions  # noqa: F401 - MAX_TXN_OPS re-exported
from elasticft.store.records import KeyValue, StoreStatus, WatchEvent

log = logging.getLogger(__name__)


OnEvents = Callable[[list[WatchEvent]], None]  # a watch's changes, from the client's watch thread
OnError = Callable[[Exception], None]  # why a watch ended (a StoreError)


class EtcdClient(Transactions):
    def __init__(self, options: StoreOptions, probe: bool = False):
        self.options = options
        # shared by this process's clients of the same etcd; a probe (is etcd up yet?) reports nothing
        self.outage = Outage(options.endpoints, quiet=True) if probe else outage_of(options.endpoints)
        self._rpc = Members(options)
        self._members = len(self._rpc)
        self._auth = TokenRenewal(options.user, options.password)
        self._watches = Watches(self._rpc)
        self._keeper = LeaseKeeper(self)
        self._gate = CallGate(f"etcd at {options.endpoints}")
        if self._auth.possible:
            try:
                self._call(self._auth.renew)
            except StoreUnavailable:
                self._rpc.close()
                raise
            except StoreError as exc:  # e.g. a wrong password
                self._rpc.close()
                raise StoreError(f"cannot connect to etcd at {options.endpoints}: {one_line(exc.__cause__ or exc)}") from exc

    def _call(self, fn, answered: bool = True):
        """``fn(members)`` (etcd_rpc.Members) with errors as StoreError; ``answered``: its return
        means etcd answered (not so for registering a watch, which returns before any reply).

        With several members, a request that found its member down goes to the next one at
        once (Members marked the dead one failed): one dead member of three must cost no
        request, and no agent starting meanwhile, anything. A token that a restarted etcd
        forgot is renewed once (auth.py)."""
        with self._gate.call():  # refused once closed; close() outwaits it
            return self._call_members(fn, answered)

    def _call_members(self, fn, answered: bool):
        tries, renewed = self._members, False
        while tries:
            tries -= 1
            sent = time.monotonic()
            try:
                result = fn(self._rpc)
            except NoMemberAvailable as exc:
                failure = exc
                continue
            except grpc.RpcError as exc:
                if exc.code() in MEMBER_DOWN_CODES:
                    failure = exc
                    continue
                error = error_of(exc)
                if not isinstance(error, TokenExpired) or renewed or not self._auth.possible:
                    raise error from exc
                try:
                    self._auth.renew(self._rpc)
                except grpc.RpcError as again:
                    raise error_of(again) from again
                renewed, tries = True, tries + 1
                continue
            except (WatchCompacted, WatchNotCreated) as exc:
                raise StoreError(f"etcd at {self.options.endpoints}: {exc}") from exc
            except ValueError as exc:
                if "closed channel" in str(exc):  # gRPC's words; the gate keeps eft's own calls off one
                    raise StoreClosed(f"etcd at {self.options.endpoints}: client closed") from exc
                raise
            if answered:
                self.outage.success()
            return result
        self.outage.failure(sent)
        raise StoreUnavailable(f"etcd at {self.options.endpoints} is unreachable") from failure

    # -- reads -------------------------------------------------------------------

    def _range(self, key: str, range_end: str | None = None, **how) -> api.RangeResponse:
        return self._call(lambda rpc: rpc.call(etcd_rpc.RANGE, range_request(key, range_end, **how)))

    def ping(self) -> None:
        """Raise StoreUnavailable unless etcd answers."""

        def read(rpc):
            try:
                rpc.call(etcd_rpc.RANGE, range_request("/eft-ping"))
            except grpc.RpcError as exc:
                # A run's role may cover its own keys only (RBAC); etcd checks permissions
                # after the read's quorum, so a refusal still says etcd is up with a leader.
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise

        self._call(read)

    def get(self, key: str) -> KeyValue | None:
        kvs = self._range(key).kvs
        return KeyValue(key, kvs[0].value, kvs[0].mod_revision, kvs[0].lease) if kvs else None

    def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store revision it was read at, for read-then-watch."""
        response = self._range(key)
        revision = response.header.revision
        if not response.kvs:
            return None, revision
        kv = response.kvs[0]
        return KeyValue(key, kv.value, kv.mod_revision, kv.lease), revision

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        response = self._range(prefix, prefix_end(prefix))
        return [key_value(kv) for kv in response.kvs], response.header.revision

    def get_range(self, start: str, end: str) -> tuple[list[KeyValue], int]:
        """All keys in [start, end) and the store revision they were read at."""
        response = self._range(start, end)
        return [key_value(kv) for kv in response.kvs], response.header.revision

    def count_range(self, start: str, end: str, revision: int | None = None) -> tuple[int, int]:
        """How many keys lie in [start, end) (at ``revision``, else now), and the revision read at.

        Only a count travels: N nodes can each learn their rank from one tiny answer.
        """
        response = self._range(start, end, count_only=True, revision=revision)
        return response.count, response.header.revision

    def count_prefix(self, prefix: str) -> int:
        """How many keys lie under ``prefix`` (etcd counts them; no values travel)."""
        return self._range(prefix, prefix_end(prefix), count_only=True).count

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The names of the keys under ``prefix``, in key order (no values travel)."""
        response = self._range(prefix, prefix_end(prefix), keys_only=True)
        return [kv.key.decode() for kv in response.kvs]

    def first_created(self, prefix: str) -> tuple[KeyValue | None, int]:
        """The oldest key under ``prefix`` by create revision (or None), and the store revision read at."""
        response = self._range(prefix, prefix_end(prefix), limit=1, sort_order="ascend", sort_target="create")
        if not response.kvs:
            return None, response.header.revision
        kv = response.kvs[0]
        return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease), response.header.revision

    def last_modified(self, prefix: str) -> int:
        """The newest mod revision among the keys under ``prefix`` (0: none); one key's name travels."""
        response = self._range(prefix, prefix_end(prefix), keys_only=True, limit=1, sort_order="descend",
                               sort_target="mod")
        return response.kvs[0].mod_revision if response.kvs else 0

    def oldest(self, prefix: str, limit: int, revision: int | None = None) -> list[KeyValue]:
        """The first ``limit`` keys under ``prefix`` in key order (at ``revision``, else now), with their values."""
        response = self._range(prefix, prefix_end(prefix), limit=limit, sort_order="ascend", sort_target="key",
                               revision=revision)
        return [key_value(kv) for kv in response.kvs]

    def status(self) -> StoreStatus:
        """What the member answering says: its database's size, the revision, the leader's name."""

        def read(rpc):
            reply = rpc.call(etcd_rpc.STATUS, api.StatusRequest())
            if not reply.leader:
                return reply, ""
            members = rpc.call(etcd_rpc.MEMBER_LIST, api.MemberListRequest()).members
            return reply, next((m.name for m in members if m.ID == reply.leader), "")

        reply, leader = self._call(read)
        return StoreStatus(reply.dbSize, self.revision(), leader)

    def revision(self) -> int:
        return self._range("/eft-revision").header.revision

    # -- writes ------------------------------------------------------------------

    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        request = put_request(key, value, lease.id if lease else None)
        return self._call(lambda rpc: rpc.call(etcd_rpc.PUT, request)).header.revision

    def compact(self, revision: int) -> None:
        """Drop etcd's history before ``revision`` (every key's, every run's: compaction is
        cluster-wide); reads and watches at ``revision`` or later still work."""
        self._call(lambda rpc: rpc.call(etcd_rpc.COMPACT, api.CompactionRequest(revision=revision)))

    def delete(self, key: str) -> bool:
        return self._call(lambda rpc: rpc.call(etcd_rpc.DELETE_RANGE, delete_request(key))).deleted > 0

    def delete_prefix(self, prefix: str) -> None:
        self._call(lambda rpc: rpc.call(etcd_rpc.DELETE_RANGE, delete_request(prefix, prefix_end(prefix))))

    def lease(self, ttl: float) -> Lease:
        return Lease(self, ttl)

    def revoke_lease(self, lease_id: int) -> None:
        """End a lease held by another process now: its keys go as at its expiry (agent/gone_agents.py)."""
        self._call(lambda rpc: rpc.call(etcd_rpc.LEASE_REVOKE, api.LeaseRevokeRequest(ID=lease_id)))

    # -- watches -----------------------------------------------------------------

    def watch_prefix(self, prefix: str, on_events: OnEvents, start_revision: int | None = None,
                     on_error: OnError | None = None) -> Callable[[], None]:
        """Call ``on_events`` (from the client's watch thread) for every change under ``prefix``.

        Returns a function that cancels the watch.
        """
        return self.watch_range(prefix, prefix_end(prefix), on_events, start_revision, on_error)

    def watch_range(self, start: str, end: str, on_events: OnEvents, start_revision: int | None = None,
                    on_error: OnError | None = None) -> Callable[[], None]:
        """``watch_prefix`` for the keys in [start, end)."""

        def on_answer(answer):
            if not isinstance(answer, api.WatchResponse):
                if on_error is not None:
                    on_error(watch_error(answer, self.options.endpoints))
                return
            events = [
                WatchEvent(key=e.kv.key.decode(), value=e.kv.value, deleted=e.type == api.Event.DELETE,
                           revision=e.kv.mod_revision)
                for e in answer.events
            ]
            if events:
                on_events(events)

        watch_id = self._call(lambda rpc: self._watches.add(start, end, start_revision, on_answer), answered=False)

        def cancel() -> None:
            if not self._gate.closed:  # a closed client's watches ended with its channel
                self._watches.cancel(watch_id)

        return cancel

    def close(self) -> None:
        """Refuse new requests, outwait those in flight, then close the channel (which ends the
        watch stream: watchers hear an error, and any retry of theirs is refused). If a request
        is still in flight after the request timeout, the channel is left open until the
        process ends: closing it under a call is what crashes gRPC (``call_gate.py``)."""
        if self._gate.closed:
            return
        self._keeper.stop()
        if not self._gate.close(self.options.timeout + 1.0):
            log.warning("etcd client left open: a request is still in flight after %g s", self.options.timeout)
            return
        self._watches.close()
        try:
            self._rpc.close()
        except Exception:  # closing a broken channel must not hide the real error
            pass


def connect(options: StoreOptions, check: bool = True, probe: bool = False) -> EtcdClient:
    """A client for ``options``; with ``check``, fail now if etcd does not answer; a ``probe``
    (is etcd up yet?) does not count its failures as an outage of etcd."""
    client = EtcdClient(options, probe=probe)
    if check:
        try:
            client.ping()
        except StoreUnavailable:
            refused = tls_error_behind(options)  # waiting would not mend it
            if refused is None:
                raise
            client.close()
            raise refused from None
    return client


__all__ = ["EtcdClient", "KeyValue", "Lease", "StoreError", "StoreOptions", "StoreStatus", "StoreUnavailable",
           "WatchEvent", "connect"]
