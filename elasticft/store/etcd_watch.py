"""A client's watches: one gRPC stream to etcd carries them all, one thread reads it.

etcd numbers a stream's watches in the order it creates them, and answers each create request
with ``created`` and the watch's id; so one create is in flight at a time and the next ``created``
answer is its. When the stream ends (etcd went away, the client closed), every watch hears why
(its ``on_answer`` gets the error, or None for a clean end) and is gone; the next watch opens a
new stream, on whichever member is up then (etcd_rpc.Members).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.etcd_requests import to_bytes
from elasticft.store.etcd_rpc import WATCH, Members

log = logging.getLogger(__name__)

# a WatchResponse with events, or why the watch ended: a gRPC error, a WatchCompacted, None (closed)
OnAnswer = Callable[[object], None]


class WatchCompacted(RuntimeError):
    """The watch asked for history etcd has compacted away (the revision is gone)."""

    def __init__(self, compact_revision: int):
        super().__init__(f"etcd compacted its history up to revision {compact_revision}: the watch's start is gone")
        self.compact_revision = compact_revision


class WatchNotCreated(RuntimeError):
    """etcd did not answer a watch's create request within the request timeout."""


class _Pending:
    def __init__(self, on_answer: OnAnswer):
        self.on_answer = on_answer
        self.id: int | None = None
        self.error: BaseException | None = None
        self.answered = False


class Watches:
    def __init__(self, members: Members):
        self._members = members
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._requests: queue.Queue | None = None  # the open stream's requests (None: no stream)
        self._callbacks: dict[int, OnAnswer] = {}
        self._pending: _Pending | None = None
        self._closed = False

    def add(self, start: str, end: str, start_revision: int | None, on_answer: OnAnswer) -> int:
        """Watch [start, end) from ``start_revision`` (None: from now); the watch's id once etcd
        created it. Raises the stream's gRPC error, WatchCompacted or WatchNotCreated."""
        request = api.WatchRequest(create_request=api.WatchCreateRequest(
            key=to_bytes(start), range_end=to_bytes(end), start_revision=start_revision or 0))
        with self._changed:
            self._changed.wait_for(lambda: self._pending is None)
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")  # gRPC's words (client.py)
            if self._requests is None:
                self._open_stream()
            pending = self._pending = _Pending(on_answer)
            self._requests.put(request)
            try:
                if not self._changed.wait_for(lambda: pending.answered, self._members.timeout):
                    raise WatchNotCreated(f"etcd did not create a watch within {self._members.timeout:g} s")
                if pending.error is not None:
                    raise pending.error
                return pending.id
            finally:
                self._pending = None
                self._changed.notify_all()

    def cancel(self, watch_id: int) -> None:
        with self._lock:
            if self._callbacks.pop(watch_id, None) is not None and self._requests is not None:
                self._requests.put(api.WatchRequest(cancel_request=api.WatchCancelRequest(watch_id=watch_id)))

    def close(self) -> None:
        """End the stream (its watches hear None); no watch is added after."""
        with self._lock:
            self._closed = True
            if self._requests is not None:
                self._requests.put(None)

    def _open_stream(self) -> None:
        requests = self._requests = queue.Queue()
        answers = self._members.stream(WATCH, _until_none(requests))
        threading.Thread(target=self._read, args=(requests, answers), name="eft-etcd-watch", daemon=True).start()

    def _read(self, requests: queue.Queue, answers) -> None:
        ended: BaseException | None = None
        try:
            for answer in answers:
                self._dispatch(answer)
        except grpc.RpcError as exc:
            ended = exc
        finally:
            with self._changed:
                callbacks, self._callbacks = self._callbacks, {}
                if self._requests is requests:
                    self._requests = None
                requests.put(None)  # the request iterator ends with the stream
                if self._pending is not None and not self._pending.answered:
                    self._pending.error = ended or grpc_closed()
                    self._pending.answered = True
                self._changed.notify_all()
            for on_answer in callbacks.values():
                _safely(on_answer, ended)

    def _dispatch(self, answer: api.WatchResponse) -> None:
        with self._changed:
            if answer.created:
                pending = self._pending
                if pending is None or pending.answered:  # its creator gave up: nobody wants it
                    self._requests.put(api.WatchRequest(cancel_request=api.WatchCancelRequest(
                        watch_id=answer.watch_id)))
                    return
                if answer.compact_revision:
                    pending.error = WatchCompacted(answer.compact_revision)
                else:
                    pending.id = answer.watch_id
                    self._callbacks[answer.watch_id] = pending.on_answer
                pending.answered = True
                self._changed.notify_all()
                if not answer.events:
                    return
            on_answer = self._callbacks.get(answer.watch_id)
            if on_answer is not None and (answer.compact_revision or answer.canceled):
                del self._callbacks[answer.watch_id]
        if on_answer is None:
            return  # a cancelled watch's last answers
        if answer.compact_revision:
            _safely(on_answer, WatchCompacted(answer.compact_revision))
        elif answer.canceled:
            _safely(on_answer, RuntimeError(f"etcd cancelled the watch: {answer.cancel_reason or 'no reason given'}"))
        elif answer.events:
            _safely(on_answer, answer)


def grpc_closed() -> RuntimeError:
    return RuntimeError("the watch stream closed")


def _until_none(requests: queue.Queue):
    while (request := requests.get()) is not None:
        yield request


def _safely(on_answer: OnAnswer, answer) -> None:
    try:
        on_answer(answer)
    except Exception:
        log.exception("an etcd watch's callback failed")
