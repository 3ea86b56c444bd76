"""This node's shard server: other agents read parts from it and push replicas into it.

Two requests only, both under the run's header (a request for another run, e.g. a stale
agent of a previous job on the same port, is refused with 403):

* ``GET /part/<origin>/<iteration>/<name>``: a file of this node's own part (origin == this
  node; the newest generation that wrote the iteration) or of a replica it holds; whole (with
  its crc32 as it is now), or one byte range (``Range: bytes=A-B``, 206): what a restarting
  rank reads, checked by the rank against the part's chunk table;
* ``PUT /held/<origin>/<iteration>/<name>``: a replica file, with Content-Length and the crc32
  header. It is streamed to a tmp name, verified, then renamed: a half-received or corrupt
  file never carries the final name (400 on a mismatch, and nothing is left behind).

Every path component from the request must be one plain name (``safe_component``): nothing
may reach outside the node directory. Failures are logged as one line, never a traceback.
The server counts the bytes it serves to each requesting node (``NODE_HEADER``): what a
restore costs the network, per node.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import unquote

from elasticft.contract.memory import CHECKSUM_HEADER, NODE_HEADER, RUN_HEADER
from elasticft.memckpt.node_dir import CHUNK, NodeDir, crc32_of, safe_component

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")  # one range, both ends given: all a reader asks for


class _Refused(Exception):
    def __init__(self, status: int, why: str):
        super().__init__(why)
        self.status = status


def _parse(path: str, kind: str) -> tuple[str, int, str]:
    """(origin, iteration, name) of ``/<kind>/<origin>/<iteration>/<name>``, or _Refused."""
    pieces = path.split("?", 1)[0].split("/")
    if len(pieces) != 5 or pieces[0] or pieces[1] != kind:
        raise _Refused(404, f"no such resource {path!r}")
    origin, iteration, name = unquote(pieces[2]), pieces[3], unquote(pieces[4])
    if not (safe_component(origin) and safe_component(name) and iteration.isdigit()):
        raise _Refused(400, f"refused path {path!r}")
    return origin, int(iteration), name


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # one debug line per request, not stderr
        log.debug("shard server %s: " + fmt, self.server.owner.node_id, *args)

    def _answer(self, status: int, text: str = "") -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _serve(self, method: Callable[[], None]) -> None:
        owner = self.server.owner
        try:
            if self.headers.get(RUN_HEADER) != owner.run_id:
                raise _Refused(403, f"not run {owner.run_id}")
            method()
        except _Refused as exc:
            if exc.status not in (404, 507):  # (the sender says once that a holder has no room)
                log.warning("shard server %s refused %s %s from %s: %s", owner.node_id, self.command, self.path,
                            self.client_address[0], exc)
            self.close_connection = True  # an unread request body must not be taken for the next request
            self._answer(exc.status, str(exc))
        except OSError as exc:
            log.warning("shard server %s: %s %s failed: %s", owner.node_id, self.command, self.path, exc)
            self.close_connection = True
            try:
                self._answer(500, str(exc))
            except OSError:
                pass

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_PUT(self) -> None:
        self._serve(self._put)

    def _get(self) -> None:
        owner = self.server.owner
        origin, iteration, name = _parse(self.path, "part")
        if origin == owner.node_id:
            part = owner.node_dir.own_part(iteration)
        else:
            part = owner.node_dir.held_part(origin, iteration)
        path = part / name if part is not None else None
        if path is None or not path.is_file():
            raise _Refused(404, f"no {name} of {origin} iteration {iteration} here")
        wanted = self.headers.get("Range")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if wanted is None:
                start, left = 0, size
                self.send_response(200)
                # of the bytes as they are now; the reader checks them against the index
                self.send_header(CHECKSUM_HEADER, str(crc32_of(path)))
            else:
                match = _RANGE.match(wanted.strip())
                if match is None or not int(match[1]) <= int(match[2]) < size:
                    raise _Refused(416, f"range {wanted!r} of {name} ({size} bytes)")
                start, left = int(match[1]), int(match[2]) - int(match[1]) + 1
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{start + left - 1}/{size}")
            self.send_header("Content-Length", str(left))
            self.end_headers()
            f.seek(start)
            while left > 0 and (chunk := f.read(min(CHUNK, left))):
                # counted before it goes: a reader that has the bytes finds them counted
                owner.count(self.headers.get(NODE_HEADER, ""), len(chunk))
                self.wfile.write(chunk)
                left -= len(chunk)

    def _put(self) -> None:
        owner = self.server.owner
        origin, iteration, name = _parse(self.path, "held")
        if origin == owner.node_id:
            raise _Refused(400, "a node holds no replica of its own part")
        length, crc = self.headers.get("Content-Length", ""), self.headers.get(CHECKSUM_HEADER, "")
        if not length.isdigit() or not crc.isdigit():
            raise _Refused(400, f"PUT needs Content-Length and {CHECKSUM_HEADER}")
        if not owner.room(int(length)):
            raise _Refused(507, f"no room for {name} of {origin} within this node's memory budget")
        folder = owner.node_dir.held_part(origin, iteration)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            got, left = 0, int(length)
            with open(tmp, "wb") as f:
                while left > 0:
                    chunk = self.rfile.read(min(CHUNK, left))
                    if not chunk:
                        raise _Refused(400, f"{name}: the body ended {left} bytes early")
                    got = zlib.crc32(chunk, got)
                    f.write(chunk)
                    left -= len(chunk)
            if got != int(crc):
                raise _Refused(400, f"{name} of {origin} iteration {iteration}: checksum mismatch "
                                    f"(got {got:08x}, sent {int(crc):08x})")
            owner.hold(iteration)
            os.replace(tmp, folder / name)
        finally:
            tmp.unlink(missing_ok=True)
        # Before the answer: once the sender has its 200, the replica is the tier's to count.
        owner.on_received(origin, iteration)
        self._answer(200, "ok")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # At a restart every survivor fetches the checkpoint-wide files from one of two holders, and every
    # rank reads byte ranges from holders, all at once. The standard library listens with a queue of 5:
    # the kernel drops the connections beyond it and the clients' TCP retries them after 1, 3, 7, 15,
    # 31 s (bench/shard_fetch_burst.py: 256 fetches, the slowest 59 s). The kernel caps this at
    # net.core.somaxconn (4096 on current kernels).
    request_queue_size = 4096
    owner: "ShardServer"


class ShardServer:
    """Serves ``node_dir`` on ``host:port`` (port 0: any free one) from a daemon thread."""

    def __init__(self, node_dir: NodeDir, node_id: str, run_id: str, host: str, port: int = 0,
                 on_received: Callable[[str, int], None] = lambda origin, iteration: None):
        self.node_dir = node_dir
        self.node_id = node_id
        self.run_id = run_id
        self.on_received = on_received  # a replica file arrived: the tier re-checks its budget
        # Whether this node takes a replica file of so many bytes now: a spare only within its budget
        # (a member's replicas are never refused: its budget pauses the snapshots instead).
        self.room: Callable[[int], bool] = lambda nbytes: True
        self.slow: tuple[int, float] | None = None  # injected (replica_slow): from iteration, seconds per file
        self._server = _Server((host, port), _Handler)
        self._server.owner = self
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None
        self._served: dict[str, int] = {}  # requesting node ("" unnamed) -> bytes served to it
        self._served_lock = threading.Lock()

    def count(self, node: str, nbytes: int) -> None:
        with self._served_lock:
            self._served[node] = self._served.get(node, 0) + nbytes

    def served(self) -> dict[str, int]:
        """Bytes of part files served so far, per requesting node."""
        with self._served_lock:
            return dict(self._served)

    def hold(self, iteration: int) -> None:
        """An injected slow link (``--eft-inject replica_slow``): hold a received replica file a while."""
        if self.slow is not None and iteration >= self.slow[0]:
            time.sleep(self.slow[1])  # the fault itself: a slow link, not a wait for anything

    def start(self) -> "ShardServer":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="eft-shard-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()
