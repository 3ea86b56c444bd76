"""The shard server and the transfer functions over real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import os
import zlib

import pytest

from elasticft.contract.memory import CHECKSUM_HEADER, NODE_HEADER, RUN_HEADER
from elasticft.memckpt.chunks import checksum_part
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.replicator import needs_of
from elasticft.memckpt.server import ShardServer
from elasticft.memckpt.transfer import TransferError, fetch, push
from tests.memckpt_parts import write_metadata

RUN = "run-1"


@pytest.fixture
def server(tmp_path):
    node_dir = NodeDir(tmp_path / "shm" / RUN / "b")
    node_dir.create()
    received = []
    srv = ShardServer(node_dir, "b", RUN, "127.0.0.1", on_received=lambda o, k: received.append((o, k))).start()
    srv.received = received
    yield srv
    srv.close()


def request(server, method, path, body=b"", headers=None):
    host, port = server.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=body or None, headers={RUN_HEADER: RUN, **(headers or {})})
    response = conn.getresponse()
    status = response.status
    response.read()
    conn.close()
    return status


def source(tmp_path, data=b"x" * 100_000):
    path = tmp_path / "src" / "__0_0.distcp"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path, zlib.crc32(data)


def test_push_then_fetch_gives_the_same_bytes(server, tmp_path):
    src, crc = source(tmp_path, os.urandom(300_000))
    push(server.address, RUN, "a", 7, src, crc)
    assert server.received == [("a", 7)]
    assert (server.node_dir.held_part("a", 7) / src.name).read_bytes() == src.read_bytes()
    dest = tmp_path / "got"
    fetch(server.address, RUN, "a", 7, src.name, dest, crc)
    assert dest.read_bytes() == src.read_bytes()


def test_fetch_checks_the_index_crc_not_the_senders(server, tmp_path):
    src, crc = source(tmp_path)
    push(server.address, RUN, "a", 7, src, crc)
    held = server.node_dir.held_part("a", 7) / src.name
    held.write_bytes(b"y" + held.read_bytes()[1:])  # corrupted at rest: the sender checksums the bad bytes
    with pytest.raises(TransferError, match="checksum mismatch") as info:
        fetch(server.address, RUN, "a", 7, src.name, tmp_path / "got", crc)
    assert server.address in str(info.value) and src.name in str(info.value)
    assert not list(tmp_path.glob("*got*"))


def test_a_bad_crc_is_refused_and_leaves_nothing(server, tmp_path):
    src, crc = source(tmp_path)
    with pytest.raises(TransferError, match="400"):
        push(server.address, RUN, "a", 7, src, crc ^ 1)
    assert list(server.node_dir.held_part("a", 7).iterdir()) == []
    assert server.received == []


def test_another_run_is_refused(server, tmp_path):
    src, crc = source(tmp_path)
    with pytest.raises(TransferError, match="403"):
        push(server.address, "another-run", "a", 7, src, crc)
    push(server.address, RUN, "a", 7, src, crc)
    with pytest.raises(TransferError, match="403"):
        fetch(server.address, "another-run", "a", 7, src.name, tmp_path / "got", crc)


@pytest.mark.parametrize("path", ["/part/a/7/..", "/part/a/7/..%2F..%2Fsecret", "/part/..%2F..%2Fx/7/y",
                                  "/part/a/7/%2Fetc%2Fpasswd", "/part/a/x/y", "/part/a/7/y/z"])
def test_paths_outside_the_node_dir_are_refused(server, tmp_path, path):
    (server.node_dir.root.parent / "secret").write_text("no")
    assert request(server, "GET", path) in (400, 404)


def test_a_put_cannot_write_outside_the_node_dir(server):
    body = b"evil"
    headers = {"Content-Length": str(len(body)), CHECKSUM_HEADER: str(zlib.crc32(body))}
    for path in ("/held/..%2F..%2F/7/evil", "/held/a/7/..%2F..%2Fevil", "/held/../7/evil"):
        assert request(server, "PUT", path, body, headers) in (400, 404)
    assert not [p for p in server.node_dir.root.parent.parent.rglob("evil*")]


def test_an_absent_file_is_404(server, tmp_path):
    with pytest.raises(TransferError, match="404"):
        fetch(server.address, RUN, "a", 7, "__0_0.distcp", tmp_path / "got", 0)


def test_an_own_part_is_served_from_the_newest_generation(server, tmp_path):
    for generation, data in ((1, b"old"), (2, b"new")):
        folder = server.node_dir.own / f"g{generation}" / "iter_0000007"
        folder.mkdir(parents=True)
        (folder / "__1_0.distcp").write_bytes(data)
    fetch(server.address, RUN, "b", 7, "__1_0.distcp", tmp_path / "got", zlib.crc32(b"new"))
    assert (tmp_path / "got").read_bytes() == b"new"


def get_range(server, path, first, last, node="n9"):
    host, port = server.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path, headers={RUN_HEADER: RUN, NODE_HEADER: node, "Range": f"bytes={first}-{last}"})
    response = conn.getresponse()
    answer = (response.status, response.getheader("Content-Range"), response.read())
    conn.close()
    return answer


def test_a_byte_range_is_served_alone_and_counted_for_the_node_that_asked(server, tmp_path):
    data = os.urandom(50_000)
    folder = server.node_dir.own / "g1" / "iter_0000007"
    folder.mkdir(parents=True)
    (folder / "__1_0.distcp").write_bytes(data)
    assert get_range(server, "/part/b/7/__1_0.distcp", 1000, 1999) == (206, "bytes 1000-1999/50000", data[1000:2000])
    assert get_range(server, "/part/b/7/__1_0.distcp", 49_999, 49_999, node="n8")[2] == data[-1:]
    assert server.served() == {"n9": 1000, "n8": 1}
    for first, last in ((2000, 1999), (0, 50_000)):  # backwards, past the end
        assert get_range(server, "/part/b/7/__1_0.distcp", first, last)[0] == 416
    fetch(server.address, RUN, "b", 7, "__1_0.distcp", tmp_path / "whole", zlib.crc32(data), node="n9")
    assert server.served() == {"n9": 51_000, "n8": 1}


def test_needs_come_from_a_real_dcp_metadata(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    write_metadata(plain, 1, plain)  # DCP's own single-process save, shard file and all
    assert needs_of(plain) == [".metadata", "__0_0.distcp"]
    part = tmp_path / "part"
    part.mkdir()
    write_metadata(part, 3, tmp_path / "scratch")
    (part / "common.pt").write_bytes(b"c")
    assert needs_of(part) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "common.pt"]
    assert list(checksum_part(part)) == [".metadata", "common.pt"]
    (part / ".metadata").write_bytes(b"torn")
    assert needs_of(part) is None


def test_a_restarts_burst_of_connections_waits_in_the_listen_queue_not_in_tcp_retries(tmp_path):
    """At a restart every survivor connects to one of two holders at once. Connections beyond the
    server's listen queue are dropped by the kernel and retried by the client's TCP a second later
    (then 3, 7, 15, 31 s): with nothing accepting yet, 64 clients must all be through the handshake
    at once, not 6 of them (the standard library's queue of 5)."""
    import socket
    import threading

    from elasticft.memckpt.node_dir import NodeDir
    from elasticft.memckpt.server import ShardServer

    node_dir = NodeDir(tmp_path / "holder")
    node_dir.create()
    server = ShardServer(node_dir, "holder", "run", "127.0.0.1")  # listening, not started: nobody accepts
    host, port = server.address.rsplit(":", 1)
    connected, lock, go = [], threading.Lock(), threading.Event()

    def connect() -> None:
        go.wait()
        try:
            conn = socket.create_connection((host, int(port)), timeout=0.5)  # under the 1 s SYN retry
        except OSError:
            return
        with lock:
            connected.append(conn)

    threads = [threading.Thread(target=connect) for _ in range(64)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    for conn in connected:
        conn.close()
    server.close()
    assert len(connected) == 64
