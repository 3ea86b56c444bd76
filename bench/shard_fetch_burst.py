"""N nodes fetching one file from one shard server at once: a restart's checkpoint-wide files.

At a restart every survivor fetches the memory checkpoint's checkpoint-wide files
(``.metadata``, ``common.pt``) from one of their two holders' shard servers at the same moment
(``memckpt/restore.py``). A connection the server's listen queue has no room for is dropped
by the kernel and retried by the client's TCP after 1, 3, 7, 15, 31 s: a burst larger than the
queue is seconds of a restart with idle cores. Measured: the slowest of N fetches from a
``ShardServer`` (N threads, each its own connection, released at once), with the listen queue
eft gives it against the standard library's default of 5 (the previous design), in one run.

    python bench/shard_fetch_burst.py [--clients 64,256,512]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
import zlib
from pathlib import Path

from common import table

from elasticft.memckpt import server as shard_server
from elasticft.memckpt.node_dir import NodeDir, iter_name
from elasticft.memckpt.transfer import TransferError, fetch

ITERATION = 7


def burst(clients: int, queue: int | None, work: Path) -> list[float]:
    """Seconds each of ``clients`` simultaneous fetches took; ``queue``: the server's listen queue
    (None: eft's)."""
    node_dir = NodeDir(work / "holder")
    node_dir.create()
    where = node_dir.own / "g1" / iter_name(ITERATION)
    where.mkdir(parents=True, exist_ok=True)
    data = b"x" * (64 << 10)
    (where / ".metadata").write_bytes(data)
    saved = shard_server._Server.request_queue_size
    if queue is not None:
        shard_server._Server.request_queue_size = queue
    try:
        server = shard_server.ShardServer(node_dir, "holder", "run", "127.0.0.1").start()
    finally:
        shard_server._Server.request_queue_size = saved
    go, seconds = threading.Event(), [0.0] * clients

    def one(i: int) -> None:
        go.wait()
        began = time.perf_counter()
        try:
            fetch(server.address, "run", "holder", ITERATION, ".metadata", work / f"got-{i}", zlib.crc32(data), 120.0)
            seconds[i] = time.perf_counter() - began
        except TransferError:  # a connection the kernel dropped too often: reset or timed out
            seconds[i] = math.inf

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    server.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="64,256,512", help="simultaneous fetches, comma separated")
    args = parser.parse_args()
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        for name, queue in (("queue 5 (before)", 5), (f"eft's ({shard_server._Server.request_queue_size})", None)):
            with tempfile.TemporaryDirectory() as work:
                seconds = sorted(burst(clients, queue, Path(work)))
            done = [s for s in seconds if s != math.inf]
            rows.append([clients, name, f"{done[len(done) // 2]:.3f}", f"{done[-1]:.3f}",
                         sum(s > 0.9 for s in done), clients - len(done)])
    print(table(["fetches", "listen queue", "median s", "slowest done s", "over 0.9 s", "failed"], rows))


if __name__ == "__main__":
    main()
