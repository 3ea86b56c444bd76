"""Close an etcd client while other threads are inside requests, watch creations and watch
callbacks, as an agent's services are when it ends; run by tests/test_store.py in a process
of its own (a crash in gRPC is its exit status). Prints what a thread saw that is not a
StoreError, and exits 1 if there was any.

  python tests/store_close_race.py ENDPOINT ROUNDS
"""

from __future__ import annotations

import sys
import threading
import uuid
from datetime import timedelta

from torch.distributed import DistStoreError

from elasticft.store import StoreError, StoreOptions, connect
from elasticft.store.c10d_store import EtcdStore


def one_round(endpoint: str, writer, unexpected: list[str]) -> None:
    root = f"/close-race/{uuid.uuid4().hex}/"
    client = connect(StoreOptions(endpoint))
    store = EtcdStore(client, root + "c10d/", timeout=timedelta(seconds=5))
    stop = threading.Event()
    after_close = threading.Event()
    refused = []
    both_refused = threading.Event()  # the two threads on the closed client were each refused

    def guarded(request):
        try:
            request()
        except (StoreError, DistStoreError) as exc:
            if after_close.is_set():
                refused.append(exc)
                if len(refused) >= 2:
                    both_refused.set()
        except Exception as exc:  # noqa: BLE001 - what the test is about
            unexpected.append(f"{type(exc).__name__}: {exc}")
            stop.set()

    def loop(request):
        while not stop.is_set():
            guarded(request)

    def on_events(_events):
        guarded(lambda: client.get(root + "x"))  # a watch callback that asks etcd, as watchers do

    client.watch_prefix(root, on_events)
    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in (
        lambda: client.get(root + "x"),  # unary requests
        lambda: store.wait(["never"], timedelta(seconds=0.02)),  # watch made and cancelled
        lambda: writer.put(root + "x", "1"),  # events for the callback
    )]
    for thread in threads:
        thread.start()
    guarded(lambda: store.set("ready", "1"))
    client.close()
    after_close.set()
    both_refused.wait(10)  # each thread tries again after the close, and is refused
    stop.set()
    for thread in threads:
        thread.join(10)


def main() -> None:
    endpoint, rounds = sys.argv[1], int(sys.argv[2])
    writer = connect(StoreOptions(endpoint))
    unexpected: list[str] = []
    for _ in range(rounds):
        one_round(endpoint, writer, unexpected)
        if unexpected:
            break
    writer.close()
    print("\n".join(unexpected) or "clean")
    sys.exit(1 if unexpected else 0)


if __name__ == "__main__":
    main()
