"""eft's own etcd client against the library it replaced (etcd-sdk-python 0.0.7, `pyetcd`), on one etcd.

eft spoke etcd through pyetcd until issue 54 (a container pinning protobuf or grpcio could not
install it: docs/install.md); it now speaks etcd's gRPC API itself (elasticft/store/etcd_rpc.py).
Measured in one run, on one embedded etcd, one request at a time from one thread (an agent's
pattern): puts, gets, a compare-and-swap transaction, and a watch's delivery (a put, then the
event at the watcher). The baseline needs the old library beside eft:

    pip install etcd-sdk-python==0.0.7   # the baseline only; eft does not need it
    python bench/etcd_client.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time
import uuid

from common import table

from elasticft.store import EmbeddedEtcd, StoreOptions, connect


def timed(requests: int, one) -> float:
    """Requests a second of ``one(i)``, called ``requests`` times one after the other."""
    began = time.perf_counter()
    for i in range(requests):
        one(i)
    return requests / (time.perf_counter() - began)


def eft_figures(endpoint: str, requests: int) -> dict[str, float]:
    client = connect(StoreOptions(endpoint))
    prefix = f"/bench/eft/{uuid.uuid4().hex}/"
    try:
        figures = {
            "put /s": timed(requests, lambda i: client.put(f"{prefix}{i % 64}", b"v" * 64)),
            "get /s": timed(requests, lambda i: client.get(f"{prefix}{i % 64}")),
            "compare-and-swap /s": timed(requests, lambda i: client.update(prefix + "cas", lambda old: str(i))),
        }
        events: queue.Queue = queue.Queue()
        cancel = client.watch_prefix(prefix + "w/", lambda batch: [events.put(time.perf_counter()) for _ in batch])
        figures["put to watch event, ms (median; lower is better)"] = _delivery(lambda i: client.put(f"{prefix}w/{i}", b"x"), events, requests)
        cancel()
        return figures
    finally:
        client.close()


def pyetcd_figures(endpoint: str, requests: int) -> dict[str, float] | None:
    try:
        import pyetcd
    except ImportError:
        return None
    host, _, port = endpoint.rpartition("/")[2].rpartition(":")
    client = pyetcd.MultiEndpointEtcd3Client(endpoints=[pyetcd.Endpoint(host, int(port), secure=False)], timeout=10,
                                             failover=False)
    client.call_credentials = None
    prefix = f"/bench/pyetcd/{uuid.uuid4().hex}/"

    def swap(i: int) -> None:  # eft's compare-and-swap as it was written on pyetcd (a read, then a txn)
        _, meta = client.get(prefix + "cas")
        compare = ([client.transactions.create(prefix + "cas") == 0] if meta is None
                   else [client.transactions.mod(prefix + "cas") == meta.mod_revision])
        client.transaction(compare=compare, success=[client.transactions.put(prefix + "cas", str(i)),
                                                     client.transactions.get(prefix + "cas")],
                           failure=[client.transactions.get(prefix + "cas")])

    try:
        figures = {
            "put /s": timed(requests, lambda i: client.put(f"{prefix}{i % 64}", b"v" * 64)),
            "get /s": timed(requests, lambda i: client.get(f"{prefix}{i % 64}")),
            "compare-and-swap /s": timed(requests, swap),
        }
        events: queue.Queue = queue.Queue()
        watch_id = client.add_watch_prefix_callback(
            prefix + "w/", lambda answer: [events.put(time.perf_counter()) for _ in getattr(answer, "events", ())])
        figures["put to watch event, ms (median; lower is better)"] = _delivery(lambda i: client.put(f"{prefix}w/{i}", b"x"), events, requests)
        client.cancel_watch(watch_id)
        return figures
    finally:
        client.close()


def _delivery(put, events: queue.Queue, requests: int) -> float:
    """Milliseconds from a put's start to its event at the watcher, the median of ``requests // 4``."""
    delays = []
    for i in range(max(1, requests // 4)):
        sent = time.perf_counter()
        put(i)
        delays.append((events.get(timeout=10) - sent) * 1000)
    return statistics.median(delays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests of each kind, per client")
    args = parser.parse_args()
    with EmbeddedEtcd() as etcd:
        ours = eft_figures(etcd.endpoint, args.requests)
        theirs = pyetcd_figures(etcd.endpoint, args.requests)
    rows = []
    for what, figure in ours.items():
        base = theirs[what] if theirs else None
        ratio = "" if base is None else f"{figure / base:.2f}x"
        rows.append([what, f"{figure:.1f}", "-" if base is None else f"{base:.1f}", ratio])
    print(table(["measure", "eft's client", "pyetcd (previous design)", "eft / pyetcd"], rows))
    if theirs is None:
        print("baseline not measured: pip install etcd-sdk-python==0.0.7 beside eft to measure it")


if __name__ == "__main__":
    main()
