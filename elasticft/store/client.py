"""A small etcd v3 client: the only module that imports the etcd client library.

It offers what eft needs and nothing more: get/put/delete, compare-and-swap on a
key's mod_revision, create-if-absent, leases kept alive by a thread, and prefix
watches delivered to a callback. Errors from the library become ``StoreError``
(or ``StoreUnavailable`` when etcd cannot be reached) so callers never see gRPC.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exceptions
from pyetcd.events import DeleteEvent

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
from elasticft.store.lease import Lease, LeaseKeeper
from elasticft.store.options import FAILED_ENDPOINT_RETRY, StoreOptions
from elasticft.store.outage import Outage, outage_of
from elasticft.store.tls import tls_error_behind
from elasticft.store.transactions import MAX_TXN_OPS, Transactions, prefix_end  # noqa: F401 - MAX_TXN_OPS re-exported
from elasticft.store.records import KeyValue, StoreStatus, WatchEvent

log = logging.getLogger(__name__)


_UNAVAILABLE = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
)


OnEvents = Callable[[list[WatchEvent]], None]  # a watch's changes, from a library thread
OnError = Callable[[Exception], None]  # why a watch ended (a StoreError)


class EtcdClient(Transactions):
    def __init__(self, options: StoreOptions, probe: bool = False):
        self.options = options
        # shared by this process's clients of the same etcd; a probe (is etcd up yet?) reports nothing
        self.outage = Outage(options.endpoints, quiet=True) if probe else outage_of(options.endpoints)
        endpoints = []
        for host, port in options.parsed_endpoints():
            secure = bool(options.cacert)
            creds = None
            if secure:
                creds = pyetcd.Etcd3Client.get_secure_creds(options.cacert, options.key, options.cert)
            endpoints.append(
                pyetcd.Endpoint(host, port, secure=secure, creds=creds, time_retry=FAILED_ENDPOINT_RETRY,
                                opts=options.channel_options())
            )
        self._members = len(endpoints)
        self._auth = TokenRenewal(options.user, options.password, secure=bool(options.cacert))
        try:
            self._etcd = pyetcd.MultiEndpointEtcd3Client(
                endpoints=endpoints,
                timeout=options.timeout,
                user=options.user,
                password=options.password,
                failover=len(endpoints) > 1,
            )
        except _UNAVAILABLE as exc:
            self.outage.failure(time.monotonic())
            raise StoreUnavailable(f"etcd at {options.endpoints} is unreachable") from exc
        except (etcd_exceptions.Etcd3Exception, grpc.RpcError) as exc:  # e.g. a wrong password
            raise StoreError(f"cannot connect to etcd at {options.endpoints}: {one_line(exc)}") from exc
        if not secure:  # gRPC fails calls with call credentials on a plain channel; the token
            self._etcd.call_credentials = None  # still travels as metadata, as etcdctl's does
        self._keeper = LeaseKeeper(self)
        self._gate = CallGate(f"etcd at {options.endpoints}")

    def _call(self, fn, answered: bool = True):
        """``fn(library client)`` with errors as StoreError; ``answered``: its return means
        etcd answered (not so for registering a watch, which returns before any reply).

        With several members, a request that found its member down goes to the next one at
        once (the library marked the dead one failed): one dead member of three must cost no
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
                result = fn(self._etcd)
            except _UNAVAILABLE as exc:
                failure = exc
                continue
            except (etcd_exceptions.Etcd3Exception, grpc.RpcError) as exc:
                error = error_of(exc)
                if not isinstance(error, TokenExpired) or renewed or not self._auth.possible:
                    raise error from exc
                self._auth.renew(self._etcd)
                renewed, tries = True, tries + 1
                continue
            except ValueError as exc:
                if "closed channel" in str(exc):  # gRPC's words; the gate keeps eft's own calls off one
                    raise StoreClosed(f"etcd at {self.options.endpoints}: client closed") from exc
                if "failed node" not in str(exc):  # pyetcd: "Trying to use a failed node"
                    raise
                failure = exc
                continue
            if answered:
                self.outage.success()
            return result
        self.outage.failure(sent)
        raise StoreUnavailable(f"etcd at {self.options.endpoints} is unreachable") from failure

    # -- reads -------------------------------------------------------------------

    def ping(self) -> None:
        """Raise StoreUnavailable unless etcd answers."""

        def read(c):
            try:
                c.get("/eft-ping")
            except grpc.RpcError as exc:
                # A run's role may cover its own keys only (RBAC); etcd checks permissions
                # after the read's quorum, so a refusal still says etcd is up with a leader.
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise

        self._call(read)

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call(lambda c: c.get(key))
        if meta is None:
            return None
        return KeyValue(key, value, meta.mod_revision, meta.lease_id)

    def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store revision it was read at, for read-then-watch."""
        response = self._call(lambda c: c.get_response(key))
        revision = response.header.revision
        if not response.kvs:
            return None, revision
        kv = response.kvs[0]
        return KeyValue(key, kv.value, kv.mod_revision, kv.lease), revision

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""

        response = self._call(lambda c: c.get_prefix_response(prefix))
        items = [KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
                 for kv in response.kvs]
        return items, response.header.revision

    def get_range(self, start: str, end: str) -> tuple[list[KeyValue], int]:
        """All keys in [start, end) and the store revision they were read at."""
        response = self._call(lambda c: c.get_range_response(start, end))
        items = [KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
                 for kv in response.kvs]
        return items, response.header.revision

    def count_range(self, start: str, end: str, revision: int | None = None) -> tuple[int, int]:
        """How many keys lie in [start, end) (at ``revision``, else now), and the revision read at.

        Only a count travels: N nodes can each learn their rank from one tiny answer.
        """
        response = self._call(lambda c: c.get_range_response(start, end, count_only=True, revision=revision))
        return response.count, response.header.revision

    def count_prefix(self, prefix: str) -> int:
        """How many keys lie under ``prefix`` (etcd counts them; no values travel)."""
        return self._call(lambda c: c.get_prefix_response(prefix, count_only=True)).count

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The names of the keys under ``prefix``, in key order (no values travel)."""
        response = self._call(lambda c: c.get_prefix_response(prefix, keys_only=True))
        return [kv.key.decode() for kv in response.kvs]

    def first_created(self, prefix: str) -> tuple[KeyValue | None, int]:
        """The oldest key under ``prefix`` by create revision (or None), and the store revision read at."""
        response = self._call(
            lambda c: c.get_prefix_response(prefix, limit=1, sort_order="ascend", sort_target="create")
        )
        if not response.kvs:
            return None, response.header.revision
        kv = response.kvs[0]
        return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease), response.header.revision

    def last_modified(self, prefix: str) -> int:
        """The newest mod revision among the keys under ``prefix`` (0: none); one key's name travels."""
        response = self._call(lambda c: c.get_prefix_response(prefix, keys_only=True, limit=1, sort_order="descend",
                                                               sort_target="mod"))
        return response.kvs[0].mod_revision if response.kvs else 0

    def oldest(self, prefix: str, limit: int, revision: int | None = None) -> list[KeyValue]:
        """The first ``limit`` keys under ``prefix`` in key order (at ``revision``, else now), with their values."""
        response = self._call(lambda c: c.get_prefix_response(prefix, limit=limit, sort_order="ascend",
                                                               sort_target="key", revision=revision))
        return [KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.lease, kv.create_revision)
                for kv in response.kvs]

    def status(self) -> StoreStatus:
        reply = self._call(lambda c: c.status())
        return StoreStatus(reply.db_size, self.revision(), reply.leader.name if reply.leader else "")

    def revision(self) -> int:
        def read(c):
            response = c.get_response("/eft-revision")
            return response.header.revision

        return self._call(read)

    # -- writes ------------------------------------------------------------------

    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        response = self._call(lambda c: c.put(key, value, lease=lease.id if lease else None))
        return response.header.revision

    def compact(self, revision: int) -> None:
        """Drop etcd's history before ``revision`` (every key's, every run's: compaction is
        cluster-wide); reads and watches at ``revision`` or later still work."""
        self._call(lambda c: c.compact(revision))

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> None:
        self._call(lambda c: c.delete_prefix(prefix))

    def lease(self, ttl: float) -> Lease:
        return Lease(self, ttl)

    # -- watches -----------------------------------------------------------------

    def watch_prefix(self, prefix: str, on_events: OnEvents, start_revision: int | None = None,
                     on_error: OnError | None = None) -> Callable[[], None]:
        """Call ``on_events`` (from a library thread) for every change under ``prefix``.

        Returns a function that cancels the watch.
        """
        return self.watch_range(prefix, prefix_end(prefix), on_events, start_revision, on_error)

    def watch_range(self, start: str, end: str, on_events: OnEvents, start_revision: int | None = None,
                    on_error: OnError | None = None) -> Callable[[], None]:
        """``watch_prefix`` for the keys in [start, end)."""

        def callback(response):
            if isinstance(response, Exception) or response is None:
                if on_error is not None:
                    on_error(watch_error(response, self.options.endpoints))
                return
            events = [
                WatchEvent(
                    key=e.key.decode(),
                    value=e.value,
                    deleted=isinstance(e, DeleteEvent),
                    revision=e.mod_revision,
                )
                for e in response.events
            ]
            if events:
                on_events(events)

        watch_id = self._call(
            lambda c: c.add_watch_callback(start, callback, range_end=end, start_revision=start_revision),
            answered=False,
        )
        def cancel() -> None:
            if not self._gate.closed:  # a closed client's watches ended with its channel
                self._call(lambda c: c.cancel_watch(watch_id), answered=False)

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
        try:
            self._etcd.close()
        except Exception:  # closing a broken channel must not hide the real error
            pass


def connect(options: StoreOptions, check: bool = True, probe: bool = False) -> EtcdClient:
    """A client for ``options``; with ``check``, fail now if etcd does not answer; a ``probe``
    (is etcd up yet?) does not count its failures as an outage of etcd."""
    client = EtcdClient(options, probe=probe)
    if check:
        try:
            client.ping()
        except StoreUnavailable as exc:
            refused = tls_error_behind(exc, options)  # waiting would not mend it
            if refused is None:
                raise
            client.close()
            raise refused from None
    return client


__all__ = ["EtcdClient", "KeyValue", "Lease", "StoreError", "StoreOptions", "StoreStatus", "StoreUnavailable",
           "WatchEvent", "connect"]
