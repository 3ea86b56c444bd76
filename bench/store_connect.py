"""N workers connecting at once to the round's TCPStore: time to connect, and where it goes (issue 53).

One TCPStore server made as eft's etcd-v3 handler makes the round's (``rendezvous/handler.py``
``_formed``: is_master, multi_tenant, torch's default libuv backend, port 0), N clients made as
torch's env:// makes a worker's (``torch.distributed.rendezvous._create_c10d_store`` with the agent
store: is_master False), as threads released together. Each N runs in a fresh process, twice:

* ``system``: glibc's resolver as configured (the baseline, what bench/restart_scale.py got);
* ``use-vc``: ``RES_OPTIONS=use-vc``, the same lookups sent over TCP instead of UDP.

Why the resolver: torch 2.15 looks up the peer's name on every TCPStore connection, on both
sides (``socket.cpp`` ``formatSockAddr``: ``getnameinfo`` without ``NI_NUMERICHOST``; on the
client from ``SocketImpl``'s constructor in ``SocketConnectOp::tryConnect``, on the server from
``LibUVStoreDaemon::onConnect``, on the store's one loop thread, one connection after another).
The address is IPv4-mapped IPv6 (torch prefers AF_INET6 with AI_V4MAPPED), which /etc/hosts never
answers, so each is a DNS PTR query; a query lost is retried after glibc's 5 s RES_TIMEOUT (twice,
then EAI_AGAIN). Also printed: 100 PTR lookups one at a time, to show the resolver's own loss.

  python bench/store_connect.py                 # 32,128 clients
  python bench/store_connect.py --clients 8,32,128,512
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import threading
import time
from datetime import timedelta

from common import table

TIMEOUT = timedelta(seconds=60)
MASTER = "127.0.0.1"  # the harness's master address (its nodes' local_addr)


def _connect_all(n: int, out) -> None:
    import torch.distributed as dist

    server = dist.TCPStore(host_name=MASTER, port=0, is_master=True, multi_tenant=True)
    took = [0.0] * n
    go = threading.Event()

    def client(i: int) -> None:
        go.wait()
        began = time.monotonic()
        store = dist.TCPStore(MASTER, server.port, is_master=False, timeout=TIMEOUT)
        took[i] = time.monotonic() - began
        store.set(f"rank{i}", b"up")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    out.put(sorted(took))


def _serial_lookups(count: int, out) -> None:
    """``count`` PTR lookups of the master's IPv4-mapped address one after another, as the store's
    loop thread makes them."""
    took = []
    for _ in range(count):
        began = time.monotonic()
        try:
            socket.getnameinfo((f"::ffff:{MASTER}", 1, 0, 0), socket.NI_NUMERICSERV)
        except socket.gaierror:
            pass  # EAI_AGAIN after the retries: torch prints the address instead
        took.append(time.monotonic() - began)
    out.put(sorted(took))


def in_child(target, arg, res_options: str | None) -> list[float]:
    """``target(arg)`` in a fresh process: glibc reads RES_OPTIONS as each thread's resolver starts."""
    ctx = multiprocessing.get_context("spawn")
    saved = os.environ.get("RES_OPTIONS")
    if res_options is None:
        os.environ.pop("RES_OPTIONS", None)
    else:
        os.environ["RES_OPTIONS"] = res_options
    try:
        out = ctx.Queue()
        child = ctx.Process(target=target, args=(arg, out))
        child.start()
    finally:
        if saved is None:
            os.environ.pop("RES_OPTIONS", None)
        else:
            os.environ["RES_OPTIONS"] = saved
    took = out.get(timeout=300)
    child.join(30)
    return took


def summary(took: list[float]) -> list:
    n = len(took)
    quantiles = (took[n // 2], took[min(n - 1, int(0.9 * n))], took[-1])
    return [f"{t:.3f}" for t in quantiles] + [sum(t > 1.0 for t in took)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="32,128", help="clients connecting at once, comma separated")
    parser.add_argument("--lookups", type=int, default=100, help="PTR lookups one at a time (0: skip)")
    args = parser.parse_args()
    settings = {"system": None, "use-vc": "use-vc"}
    rows = []
    for n in [int(s) for s in args.clients.split(",")]:
        worst = {}
        for name, options in settings.items():
            took = in_child(_connect_all, n, options)
            worst[name] = took[-1]
            rows.append([n, name] + summary(took) + [""])
            print(rows[-1][:-1], flush=True)
        rows[-1][-1] = f"{worst['system'] / max(worst['use-vc'], 1e-6):.0f}x"
    print()
    print("N TCPStore clients released at once against one server (the round's, as eft's handler makes it); "
          "seconds to connect")
    print(table(["clients", "resolver", "median s", "p90 s", "max s", "over 1 s", "max system/use-vc"],
                rows))
    if args.lookups:
        took = in_child(_serial_lookups, args.lookups, None)
        ms = [t * 1e3 for t in took]
        print(f"\n{args.lookups} PTR lookups of ::ffff:{MASTER} one at a time (system resolver): median "
              f"{ms[len(ms) // 2]:.2f} ms, max {ms[-1]:.0f} ms, {sum(t > 1.0 for t in took)} over 1 s")


if __name__ == "__main__":
    main()
